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

from nemo_dsa.ops.quant.blocks import (
    channel_blocks,
    from_channel_blocks,
    power_of_two_ceil,
    straight_through_quant_dequant,
)

BLOCK = 32
E4M3_MAX = 448.0
AMAX_FLOOR = 1e-4


def _quant_dequant(x: torch.Tensor, block_size: int) -> torch.Tensor:
    blocks = channel_blocks(x, block_size)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = power_of_two_ceil(amax.clamp_min(AMAX_FLOOR) * (1 / E4M3_MAX))
    codes = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = codes.float() * scale
    out = torch.where(torch.isfinite(amax), out, float("nan"))
    return from_channel_blocks(out, x)


def fp8_quant_dequant(x: torch.Tensor, block_size: int = BLOCK, *, backend: str = "auto") -> torch.Tensor:
    """FP8 E4M3 quantize-dequantize ``x [..., C]`` per ``block_size`` channels (module docstring),
    on the fused kernel or the reference above (``backend``: ``ops/quant/fused.py``)."""
    return straight_through_quant_dequant(x, block_size, _quant_dequant, "fp8", backend)
