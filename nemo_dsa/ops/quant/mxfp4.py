"""MXFP4 quantize-dequantize (E2M1 values, power-of-two block scale) with a straight-through gradient.

docs/semantics.md "Index scoring", MXFP4: per block of 32 consecutive channels (a shorter last block
as if filled with zeros), scale = the smallest power of
two >= max|x| / 6 (max clamped to at least 6 * 2^-126), taken from the fp32 bit pattern rather
than a logarithm; x / scale is clamped to [-6, 6] and rounded to the nearest of
+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}, a tie going to the level whose E2M1 mantissa bit is 0; the result
times scale is returned in the input dtype. The backward is the identity. A block holding a NaN
or inf comes back as NaN. (Rounding up to 4 * scale can exceed the dtype's largest value for
blocks whose max is within 1/8 of it, e.g. float16 from 57344: those give inf, as the rule says.)
"""

from __future__ import annotations

import torch

from nemo_dsa.ops.quant.blocks import power_of_two_ceil, straight_through_quant_dequant

BLOCK = 32
E2M1_MAX = 6.0
# The non-negative E2M1 levels; the mantissa bit of level n is n % 2, so "ties to even mantissa"
# means "ties to the even position" in this table.
E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _round_to_e2m1(magnitude: torch.Tensor) -> torch.Tensor:
    """Round |x/scale| in [0, 6] to the nearest E2M1 level, ties to the even table position."""
    levels = magnitude.new_tensor(E2M1_LEVELS)
    midpoints = (levels[1:] + levels[:-1]) / 2  # 0.25, 0.75, ..., 5 (exact in fp32)
    position = (magnitude.unsqueeze(-1) > midpoints).sum(-1)  # strictly above = the upper level
    at_tie = (magnitude.unsqueeze(-1) == midpoints).any(-1)
    # On a tie `position` is the lower neighbour; move up when that neighbour is odd.
    position = position + (at_tie & (position % 2 == 1)).to(position.dtype)
    return levels[position]


def _quant_dequant(x: torch.Tensor) -> torch.Tensor:
    channels = x.shape[-1]
    # A last block shorter than 32 is filled with zeros, as the release does: they leave its
    # maximum, and so its scale and every real channel's value, unchanged.
    padded = torch.nn.functional.pad(x.float(), (0, -channels % BLOCK))
    blocks = padded.reshape(*x.shape[:-1], padded.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(E2M1_MAX * 2.0**-126)
    # Correctly rounded fp32 division never lands on a power of two from above: the nearest fp32
    # above 6 * 2^k is 6 * 2^k + 2^(k-21), whose quotient exceeds 2^k by more than half an ulp.
    # So this is the exact ceiling of the real amax / 6 (a reciprocal multiply would not be).
    scale = power_of_two_ceil(amax / E2M1_MAX)
    normalized = (blocks / scale).clamp(-E2M1_MAX, E2M1_MAX)  # exact: scale is a power of two
    rounded = torch.copysign(_round_to_e2m1(normalized.abs()), normalized)
    out = rounded * scale
    # A NaN or inf in a block has no scale: the whole block becomes NaN, so the bad input shows
    # downstream instead of quantizing to zeros (NaN) or to NaNs of another origin (inf).
    out = out.masked_fill(~torch.isfinite(amax), float("nan"))
    return out.reshape(padded.shape)[..., :channels].to(x.dtype)


def mxfp4_quant_dequant(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """MXFP4 quantize-dequantize ``x [..., C]`` in its own dtype, blocks of 32 channels (a shorter
    last block as if zero-filled); identity gradient. On the fused kernel or the reference above
    (``backend``: ``ops/quant/fused.py``)."""
    return straight_through_quant_dequant(x, BLOCK, _reference, "mxfp4", backend)


def _reference(x: torch.Tensor, block_size: int) -> torch.Tensor:
    return _quant_dequant(x)
