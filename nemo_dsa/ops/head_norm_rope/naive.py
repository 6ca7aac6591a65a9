"""The reference: DeepSeek-V4's per-head q RMS norm (no weight) then RoPE, as eager torch ops.

Each rounding is the release's: ``y = bf16(x * rsqrt(mean(x^2) + eps))`` in fp32, then the last
``2 * half`` channels of ``y`` rotate as interleaved pairs ``(2i, 2i + 1)`` by ``angles[..., i]``
in fp32 and round to bf16 again; the other channels are ``y``. Autograd through these ops is the
reference backward (its bf16 roundings included: the rotary channels' gradient is rounded to the
input's dtype before the norm's backward, as the ``.float()`` cast's backward does).
"""

from __future__ import annotations

import torch


def head_rms_rope_reference(x: torch.Tensor, angles: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [B, S, H, D]`` normalised per head, its last ``2 * angles.shape[-1]`` channels rotated by
    ``angles [B, S, half]`` (fp32); returned in ``x``'s dtype."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return rope_reference(y, angles)


def rope_reference(y: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """The rotation alone: ``y``'s last ``2 * angles.shape[-1]`` channels as interleaved pairs, in
    fp32, rounded to ``y``'s dtype; the other channels unchanged."""
    half = angles.shape[-1]
    if half == 0:
        return y
    cos, sin = angles.cos().unsqueeze(-2), angles.sin().unsqueeze(-2)
    pairs = y[..., -2 * half :].float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((y[..., : -2 * half], rotated.to(y.dtype)), dim=-1)
