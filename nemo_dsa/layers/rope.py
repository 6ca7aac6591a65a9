"""Rotary position embedding on the trailing ``rope_dim`` channels, interleaved pairs.

DeepSeek-V3/V4 rotate channel pairs (2k, 2k+1) (complex multiplication in their inference
code), not the Llama ``rotate_half`` pairs (k, k + d/2); we follow DeepSeek so released
weights would see the layout they were trained with.
"""

from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, rope_dim: int, theta: float) -> torch.Tensor:
    """Angles ``positions * theta^(-2k/rope_dim)`` in fp32, shape ``[*positions.shape, rope_dim // 2]``."""
    exponent = torch.arange(0, rope_dim, 2, device=positions.device, dtype=torch.float64) / rope_dim
    inv_freq = (1.0 / (theta**exponent)).to(torch.float32)
    return positions.to(torch.float32).unsqueeze(-1) * inv_freq


def apply_rope(x: torch.Tensor, angles: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * angles.shape[-1]`` channels of ``x`` (``[B, S, ..., D]``).

    ``angles`` is ``[B, S, rope_dim // 2]``; it broadcasts over any head axes between S and D.
    ``inverse=True`` applies the opposite rotation (used on the attention output, whose values
    carry the keys' rotation). The math runs in fp32; the result has ``x``'s dtype.
    """
    half = angles.shape[-1]
    if half == 0:
        return x
    while angles.ndim < x.ndim:
        angles = angles.unsqueeze(-2)
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    plain, rotary = x[..., : -2 * half], x[..., -2 * half :]
    pairs = rotary.float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((plain, rotated.to(x.dtype)), dim=-1)
