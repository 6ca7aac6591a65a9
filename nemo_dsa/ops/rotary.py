"""RoPE's rotation in the releases' fp32 arithmetic (shared by ``layers/rope.py`` and ``ops/head_norm_rope``).

Two arithmetics, named by the model whose built-in attention computes them (nemo-automodel 0.7.0),
both on fp32 angles from fp32 frequencies (``layers/rope.py``), on interleaved pairs (e, o):
  ``"v4"``: cos and sin by ``torch.cos`` / ``torch.sin``, then ``(e cos - o sin, e sin + o cos)``
            as real products (DeepSeek-V4's rotary embedding);
  ``"v41"``: the rotation ``torch.polar(1, angle)`` and one complex multiply ``(e + i o) * rotation``
            (DeepSeek-V4.1's, the release's complex-multiply rounding: ``torch.polar``'s cos and
            sin are not always ``torch.cos``'s, so the two differ in the last bit of some values).
The inverse rotation (the attention output, gradients) uses the conjugate.
"""

from __future__ import annotations

import torch

ROPE_ARITHMETICS = ("v4", "v41")


def check_arithmetic(arithmetic: str) -> str:
    if arithmetic not in ROPE_ARITHMETICS:
        raise ValueError(f"rope arithmetic must be one of {ROPE_ARITHMETICS}, got {arithmetic!r}")
    return arithmetic


def rotation(angles: torch.Tensor, arithmetic: str = "v4", *, inverse: bool = False) -> torch.Tensor:
    """complex64 ``cos + i sin`` of fp32 ``angles`` in ``arithmetic``'s cos and sin (conjugated
    with ``inverse``); same shape as ``angles``."""
    if check_arithmetic(arithmetic) == "v41":
        turned = torch.polar(torch.ones_like(angles), angles)
        cos, sin = turned.real, turned.imag
    else:
        cos, sin = angles.cos(), angles.sin()
    return torch.complex(cos, -sin if inverse else sin)


def rotate_pairs(rotary: torch.Tensor, turn: torch.Tensor, arithmetic: str = "v4") -> torch.Tensor:
    """fp32 ``rotary [..., 2 * half]`` (interleaved pairs) rotated by ``turn [..., half]``
    (``rotation``, broadcast) in ``arithmetic``'s products; fp32, ``rotary``'s shape."""
    pairs = rotary.unflatten(-1, (turn.shape[-1], 2))
    if check_arithmetic(arithmetic) == "v41":
        return torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn).flatten(-2)
    cos, sin = turn.real, turn.imag
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
