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

from nemo_dsa.ops.rotary import check_arithmetic, rotate_pairs, rotation

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


def rope_inv_freq(
    rope_dim: int, theta: float, rope_scaling: Mapping | None = None, arithmetic: str = "v4"
) -> torch.Tensor:
    """Per-pair inverse frequencies ``theta^(-2k/rope_dim)`` (YaRN-blended when asked), fp32 ``[rope_dim // 2]``.

    Computed in fp32 as the built-in attention of ``arithmetic``'s model computes them (so the
    angles, and every rotated value, are bitwise its): the ramp over the pairs is
    ``clamp((k - low) / (high - low), 0, 1)``; DeepSeek-V4 (``"v4"``) blends
    ``f / factor * (1 - smooth) + f * smooth`` with ``smooth = 1 - ramp`` (its reference's form),
    DeepSeek-V4.1 (``"v41"``) ``f / factor * ramp + f * (1 - ramp)``; the two can differ in the
    last bit where ``1 - (1 - ramp) != ramp``.
    """
    check_arithmetic(arithmetic)
    half = rope_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    yarn = yarn_parameters(rope_scaling)
    if yarn is not None and half > 0:

        def pair_index(rotations: float) -> float:
            # The rotary dim whose frequency turns `rotations` times over the original context.
            context = yarn["original_max_position_embeddings"]
            return rope_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(pair_index(yarn["beta_fast"])), 0)
        high = min(math.ceil(pair_index(yarn["beta_slow"])), rope_dim - 1)
        factor = yarn["factor"]
        pairs = torch.arange(half, dtype=torch.float32)
        if arithmetic == "v41":
            ramp = ((pairs - low) / max(high - low, 1e-3)).clamp(0, 1)
            inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
        else:
            smooth = 1.0 - ((pairs - low) / ((high + 0.001 if high == low else high) - low)).clamp(0, 1)
            inv_freq = inv_freq / factor * (1.0 - smooth) + inv_freq * smooth
    return inv_freq


def rope_angles(
    positions: torch.Tensor, rope_dim: int, theta: float, rope_scaling: Mapping | None = None, arithmetic: str = "v4"
) -> torch.Tensor:
    """Angles ``positions * inv_freq`` in fp32, shape ``[*positions.shape, rope_dim // 2]``."""
    inv_freq = rope_inv_freq(rope_dim, theta, rope_scaling, arithmetic).to(positions.device)
    return positions.to(torch.float32).unsqueeze(-1) * inv_freq


def apply_rope(x: torch.Tensor, angles: torch.Tensor, *, inverse: bool = False, arithmetic: str = "v4") -> torch.Tensor:
    """Rotate the last ``2 * angles.shape[-1]`` channels of ``x`` (``[B, S, ..., D]``).

    ``angles`` is ``[B, S, rope_dim // 2]``; it broadcasts over any head axes between S and D.
    ``inverse=True`` applies the opposite rotation (used on the attention output, whose values
    carry the keys' rotation). The math runs in fp32 in ``arithmetic``'s roundings
    (``nemo_dsa.ops.rotary``: V4's real cos / sin products or V4.1's complex multiply); the
    result has ``x``'s dtype.

    Values are :func:`apply_rope_reference`'s, bit for bit. Its backward under autograd writes the
    whole ``x``-sized gradient several times (each slice's backward fills a zero tensor, then the
    two are added) although only the rotary channels change; :class:`_RopeFunction` writes it once
    and rotates the rotary channels' gradient back with the same fp32 products (the same values,
    up to the sign of zeros). Angles that need a gradient take the reference's autograd.
    """
    if angles.shape[-1] == 0:
        return x
    if angles.requires_grad:
        return apply_rope_reference(x, angles, inverse=inverse, arithmetic=arithmetic)
    return _RopeFunction.apply(x, _turn(x, angles, inverse, arithmetic), arithmetic)


def apply_rope_reference(
    x: torch.Tensor, angles: torch.Tensor, *, inverse: bool = False, arithmetic: str = "v4"
) -> torch.Tensor:
    """:func:`apply_rope` as plain torch ops (its autograd is the reference backward)."""
    half = angles.shape[-1]
    if half == 0:
        return x
    turn = _turn(x, angles, inverse, arithmetic)
    plain, rotary = x[..., : -2 * half], x[..., -2 * half :]
    return torch.cat((plain, rotate_pairs(rotary.float(), turn, arithmetic).to(x.dtype)), dim=-1)


def _turn(x: torch.Tensor, angles: torch.Tensor, inverse: bool, arithmetic: str) -> torch.Tensor:
    while angles.ndim < x.ndim:
        angles = angles.unsqueeze(-2)
    return rotation(angles, arithmetic, inverse=inverse)


class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, turn, arithmetic):
        width = 2 * turn.shape[-1]
        out = x.clone(memory_format=torch.contiguous_format)
        out[..., -width:] = rotate_pairs(x[..., -width:].float(), turn, arithmetic).to(x.dtype)
        ctx.save_for_backward(turn)
        ctx.arithmetic = arithmetic
        return out

    @staticmethod
    def backward(ctx, grad):
        (turn,) = ctx.saved_tensors
        width = 2 * turn.shape[-1]
        d_x = grad.clone(memory_format=torch.contiguous_format)
        # The transpose of the rotation, as autograd composes it from the forward's products:
        # d_even = g_e cos + g_o sin, d_odd = g_o cos - g_e sin (rotating by -angle; V4.1: the
        # complex multiply by the conjugate, as autograd of its complex product).
        back = torch.complex(turn.real, -turn.imag)
        d_x[..., -width:] = rotate_pairs(grad[..., -width:].float(), back, ctx.arithmetic).to(grad.dtype)
        return d_x, None, None
