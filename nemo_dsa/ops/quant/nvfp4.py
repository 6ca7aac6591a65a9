"""NVFP4 quantize-dequantize of the released DeepSeek-V4.1 compressed KV, straight-through gradient.

The rule (DeepSeek-V4.1 rounds its compressed KV this way, after RoPE), per block of
``block_size`` (16) consecutive channels, in fp32:

- ``amax`` = max |x| over the block (a final partial block counts only its own channels);
- ``scale`` = ``e4m3(max(amax, 6 * 2^-9) / 6)``: the fp32 quotient rounded to ``float8_e4m3fn``
  (nearest, ties to even), so not a power of two in general;
- ``v = clamp(x / scale, -6, 6)`` (a correctly rounded fp32 division), rounded to the nearest E2M1
  level +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; a value exactly half-way between two levels goes to the
  level whose E2M1 mantissa bit is 0 (0, 1, 2, 4 and 6 are "even": 0.25 -> 0, 0.75 -> 1,
  1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4);
- the result ``level * scale`` is returned in the input dtype. The backward is the identity.

A block holding a NaN or inf comes back as NaN. A block whose max exceeds 6 * 448 gets the largest
E4M3 scale, 448 (saturating, as the release does), so its values clamp to +-6 * 448.
"""

from __future__ import annotations

import torch

from nemo_dsa.ops.quant.blocks import channel_blocks, from_channel_blocks, straight_through_quant_dequant

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
AMAX_FLOOR = 6.0 * 2.0**-9
# Non-negative E2M1 levels in code order: code n has mantissa bit n % 2.
E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_to_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``values`` in [-6, 6] to the nearest E2M1 level, ties to the even code."""
    levels = values.new_tensor(E2M1_LEVELS)
    magnitude = values.abs()
    distance = (magnitude.unsqueeze(-1) - levels).abs()
    nearest = distance.min(-1, keepdim=True).values
    # Among the (one or two) nearest levels prefer an even code: rank ties by code parity.
    # At most two levels are nearest, and then they are neighbours: one even code, one odd.
    parity = torch.arange(len(E2M1_LEVELS), device=values.device) % 2
    code = torch.where(distance == nearest, parity, 2).argmin(-1)
    return torch.copysign(levels[code], values)


def _quant_dequant(x: torch.Tensor, block_size: int) -> torch.Tensor:
    blocks = channel_blocks(x, block_size)
    amax = blocks.abs().amax(-1, keepdim=True)
    # Saturate before the cast: torch's float8 cast saturates on the CPU but gives NaN on CUDA.
    scale = (amax.clamp_min(AMAX_FLOOR) / E2M1_MAX).clamp_max(E4M3_MAX).to(torch.float8_e4m3fn).float()
    out = round_to_e2m1((blocks / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale
    out = torch.where(torch.isfinite(amax), out, float("nan"))
    return from_channel_blocks(out, x)


def nvfp4_quant_dequant(x: torch.Tensor, block_size: int = BLOCK, *, backend: str = "auto") -> torch.Tensor:
    """NVFP4 quantize-dequantize ``x [..., C]`` per ``block_size`` channels (module docstring),
    on the fused kernel or the reference above (``backend``: ``ops/quant/fused.py``)."""
    return straight_through_quant_dequant(x, block_size, _quant_dequant, "nvfp4", backend)
