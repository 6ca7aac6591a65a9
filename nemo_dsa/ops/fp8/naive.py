"""FP8 E4M3 quantize-dequantize of the released DeepSeek-V4.1 window KV, straight-through gradient.

The rule (DeepSeek-V4.1 rounds its sliding-window KV cache this way, after RoPE), per block of
``block_size`` (32) consecutive channels, in fp32:

- ``amax`` = max |x| over the block (a final partial block counts only its own channels);
- ``scale`` = the smallest power of two >= ``max(amax, 1e-4) * fp32(1/448)`` (a multiply by the
  fp32 reciprocal, as the release computes it, then the exponent read off the fp32 bits);
- each value becomes ``e4m3(clamp(x / scale, -448, 448)) * scale``: the division is exact (scale
  is a power of two) and the cast to ``float8_e4m3fn`` rounds to nearest, ties to even;
- the result is returned in the input dtype. The backward is the identity.

A block holding a NaN or inf comes back as NaN (it has no scale), so a bad value shows downstream
instead of being quantized into something finite.
"""

from __future__ import annotations

import torch

from nemo_dsa._checks import check_tensor, is_positive_int

BLOCK = 32
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def power_of_two_at_least(values: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= each positive, normal fp32 value, from its bits (no logarithm)."""
    bits = values.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x [..., C]`` as fp32 ``[..., ceil(C / block), block]``, a partial last block zero-filled."""
    channels = x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (0, -channels % block_size))
    return padded.unflatten(-1, (-1, block_size))


def _quant_dequant(x: torch.Tensor, block_size: int) -> torch.Tensor:
    blocks = _blocks(x, block_size)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = power_of_two_at_least(amax.clamp_min(AMAX_FLOOR) * (1 / E4M3_MAX))
    codes = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = codes.float() * scale
    out = torch.where(torch.isfinite(amax), out, float("nan"))
    return out.flatten(-2)[..., : x.shape[-1]].to(x.dtype)


class _FP8QuantDequant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, block_size: int) -> torch.Tensor:
        return _quant_dequant(x, block_size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None  # straight-through estimator


def fp8_quant_dequant(x: torch.Tensor, block_size: int = BLOCK) -> torch.Tensor:
    """FP8 E4M3 quantize-dequantize ``x [..., C]`` per ``block_size`` channels (module docstring)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.ndim < 1:
        raise ValueError(f"x must have a channel dimension, got shape {tuple(x.shape)}")
    if not is_positive_int(block_size):
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    return _FP8QuantDequant.apply(x, block_size)
