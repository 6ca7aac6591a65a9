"""Rotary position embedding on the trailing ``rope_dim`` channels, interleaved pairs, with YaRN.

DeepSeek-V3/V4 rotate channel pairs (2k, 2k+1) (complex multiplication in their inference
code), not the Llama ``rotate_half`` pairs (k, k + d/2); we follow DeepSeek so released
weights see the layout they were trained with.

YaRN (``rope_scaling = {"type" or "rope_type": "yarn", "factor", "original_max_position_embeddings",
"beta_fast", "beta_slow"}``) as DeepSeek-V4 applies it on its compressed layers: frequencies that
turn fewer than ``beta_slow`` times over the original context are divided by ``factor``, those
turning more than ``beta_fast`` times are kept, and a linear ramp over the rotary dims blends the
two. The release multiplies neither cos/sin nor the softmax scale by YaRN's mscale (its attention
factor is 1), so neither does this module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}


def yarn_parameters(rope_scaling: Mapping | None) -> dict | None:
    """The YaRN parameters of a ``rope_scaling`` mapping, or None when it asks for no YaRN.

    Both spellings of the type key are read (``type``, as DeepSeek's config.json writes it, and
    transformers' ``rope_type``); ``"default"`` / no type means plain RoPE. Any other type is a
    ValueError naming ``rope_scaling``.
    """
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise TypeError(f"rope_scaling must be a mapping or None, got {type(rope_scaling).__name__}")
    kind = str(rope_scaling.get("type", rope_scaling.get("rope_type", "default")) or "default").lower()
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"rope_scaling: only YaRN (type 'yarn') is supported, got type {kind!r}")
    try:
        params = {
            "factor": float(rope_scaling["factor"]),
            "original_max_position_embeddings": int(rope_scaling["original_max_position_embeddings"]),
            "beta_fast": float(rope_scaling.get("beta_fast", YARN_DEFAULTS["beta_fast"])),
            "beta_slow": float(rope_scaling.get("beta_slow", YARN_DEFAULTS["beta_slow"])),
        }
    except KeyError as err:
        raise ValueError(f"rope_scaling: YaRN needs {err.args[0]!r}") from None
    if params["factor"] <= 0 or params["original_max_position_embeddings"] < 1:
        raise ValueError(f"rope_scaling: YaRN factor must be > 0 and original_max_position_embeddings >= 1, got {params}")
    return params


def rope_inv_freq(rope_dim: int, theta: float, rope_scaling: Mapping | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies ``theta^(-2k/rope_dim)`` (YaRN-blended when asked), fp32 ``[rope_dim // 2]``."""
    half = rope_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    yarn = yarn_parameters(rope_scaling)
    if yarn is not None and half > 0:

        def pair_index(rotations: float) -> float:
            # The rotary dim whose frequency turns `rotations` times over the original context.
            context = yarn["original_max_position_embeddings"]
            return rope_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(pair_index(yarn["beta_fast"])), 0)
        high = min(math.ceil(pair_index(yarn["beta_slow"])), rope_dim - 1)
        span = (high - low) if high != low else 0.001
        interpolated = ((torch.arange(half, dtype=torch.float64) - low) / span).clamp(0, 1)
        inv_freq = inv_freq * (1 - interpolated) + inv_freq / yarn["factor"] * interpolated
    return inv_freq.to(torch.float32)


def rope_angles(
    positions: torch.Tensor, rope_dim: int, theta: float, rope_scaling: Mapping | None = None
) -> torch.Tensor:
    """Angles ``positions * inv_freq`` in fp32, shape ``[*positions.shape, rope_dim // 2]``."""
    inv_freq = rope_inv_freq(rope_dim, theta, rope_scaling).to(positions.device)
    return positions.to(torch.float32).unsqueeze(-1) * inv_freq


def apply_rope(x: torch.Tensor, angles: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * angles.shape[-1]`` channels of ``x`` (``[B, S, ..., D]``).

    ``angles`` is ``[B, S, rope_dim // 2]``; it broadcasts over any head axes between S and D.
    ``inverse=True`` applies the opposite rotation (used on the attention output, whose values
    carry the keys' rotation). The math runs in fp32; the result has ``x``'s dtype.

    Values are :func:`apply_rope_reference`'s, bit for bit. Its backward under autograd writes the
    whole ``x``-sized gradient several times (each slice's backward fills a zero tensor, then the
    two are added) although only the rotary channels change; :class:`_RopeFunction` writes it once
    and rotates the rotary channels' gradient back with the same fp32 products (the same values,
    up to the sign of zeros). Angles that need a gradient take the reference's autograd.
    """
    if angles.shape[-1] == 0:
        return x
    if angles.requires_grad:
        return apply_rope_reference(x, angles, inverse=inverse)
    cos, sin = _cos_sin(x, angles, inverse)
    return _RopeFunction.apply(x, cos, sin)


def apply_rope_reference(x: torch.Tensor, angles: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """:func:`apply_rope` as plain torch ops (its autograd is the reference backward)."""
    half = angles.shape[-1]
    if half == 0:
        return x
    cos, sin = _cos_sin(x, angles, inverse)
    plain, rotary = x[..., : -2 * half], x[..., -2 * half :]
    return torch.cat((plain, _rotate(rotary.float(), cos, sin).to(x.dtype)), dim=-1)


def _cos_sin(x: torch.Tensor, angles: torch.Tensor, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    while angles.ndim < x.ndim:
        angles = angles.unsqueeze(-2)
    cos, sin = angles.cos(), angles.sin()
    return cos, (-sin if inverse else sin)


def _rotate(rotary: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """fp32 interleaved pairs ``(e, o)`` -> ``(e cos - o sin, e sin + o cos)``."""
    pairs = rotary.unflatten(-1, (cos.shape[-1], 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        width = 2 * cos.shape[-1]
        out = x.clone(memory_format=torch.contiguous_format)
        out[..., -width:] = _rotate(x[..., -width:].float(), cos, sin).to(x.dtype)
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        width = 2 * cos.shape[-1]
        d_x = grad.clone(memory_format=torch.contiguous_format)
        # The transpose of the rotation, as autograd composes it from the forward's products:
        # d_even = g_e cos + g_o sin, d_odd = g_o cos - g_e sin (rotating by -angle).
        d_x[..., -width:] = _rotate(grad[..., -width:].float(), cos, -sin).to(grad.dtype)
        return d_x, None, None
