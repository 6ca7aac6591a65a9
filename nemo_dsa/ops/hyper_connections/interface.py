"""The hyper-connection parts with their gradients, on the fused Triton kernels or the references.

``backend``: ``"auto"`` runs the kernels on CUDA bf16 streams when Triton is importable, the
references otherwise (and says once in the log when CUDA streams fall back because Triton is
missing); ``"triton"`` asks for the kernels (on CPU tensors only under ``TRITON_INTERPRET=1``, as
the tests run them); ``"torch"`` the references. Every function checks its inputs once, here.

What the kernels keep for the backward: the bf16 streams (which the decoder block keeps anyway),
the sublayer output, the fp32 coefficients and one fp32 1/RMS a token; the references keep what
autograd keeps for nemo-automodel's code (two fp32 copies of the streams per mix).
"""

from __future__ import annotations

import math

import torch

from nemo_dsa.ops._triton import interpreting, load_kernels, next_power_of_2
from nemo_dsa.ops.dispatch import report_reference_fallback
from nemo_dsa.ops.hyper_connections.naive import (
    MIX_ORDERS,
    ROUNDINGS,
    collapse_reference,
    expand_reference,
    stream_mix_reference,
)

HC_BACKENDS = ("auto", "triton", "torch")

_MIX_BLOCK_T, _MIX_BLOCK_K = 64, 64
_BLOCK_D = 256


def _kernels():
    return load_kernels("nemo_dsa.ops.hyper_connections.kernels")


def resolve_hc_backend(backend: str, streams: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for ``backend`` and these streams (see the module docstring)."""
    if backend not in HC_BACKENDS:
        raise ValueError(f"hyper-connection backend must be one of {HC_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if not streams.is_cuda or streams.dtype != torch.bfloat16:
            return "torch"
        if _kernels() is None:
            report_reference_fallback("Triton is not installed: the hyper-connections run their torch references")
            return "torch"
        return "triton"
    if _kernels() is None:
        raise ValueError("hyper-connection backend 'triton' needs Triton installed")
    if streams.dtype != torch.bfloat16:
        raise ValueError(f"hyper-connection backend 'triton' takes bf16 streams, got {streams.dtype}")
    if not streams.is_cuda and not interpreting():
        raise ValueError("hyper-connection backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU)")
    return "triton"


def _check_streams(streams: torch.Tensor, name: str = "streams") -> None:
    if not isinstance(streams, torch.Tensor) or not streams.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor [..., M, D]")
    if streams.ndim < 2 or streams.shape[-1] == 0 or streams.shape[-2] == 0:
        raise ValueError(f"{name} must be [..., M, D] with M, D >= 1, got shape {tuple(streams.shape)}")


def _check_coefficients(name: str, value: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        raise TypeError(f"{name} must be an fp32 tensor of shape {shape}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device}, the streams on {device}")


# ------------------------------------------------------------------------------------------------
# the mix: fn applied to the RMS-normalised streams
# ------------------------------------------------------------------------------------------------


class _StreamMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
        kernels = _kernels()
        lead = streams.shape[:-2]
        x = streams.reshape(-1, streams.shape[-2] * streams.shape[-1])
        tokens, width = x.shape
        mixes = fn.shape[0]
        padded = max(16, next_power_of_2(mixes))
        fn_t = fn.new_zeros(width, padded)
        fn_t[:, :mixes] = fn.t()
        mix = x.new_empty(tokens, mixes, dtype=torch.float32)
        rstd = x.new_empty(tokens, dtype=torch.float32)
        if tokens:
            grid = (math.ceil(tokens / _MIX_BLOCK_T),)
            kernels._mix_forward[grid](x, fn_t, mix, rstd, tokens, width, eps, W=mixes, WP=padded,
                                       BT=_MIX_BLOCK_T, BK=_MIX_BLOCK_K)  # fmt: skip
        ctx.save_for_backward(streams, fn, mix, rstd)
        ctx.padded = padded
        return mix.view(*lead, mixes)

    @staticmethod
    def backward(ctx, dmix: torch.Tensor):
        streams, fn, mix, rstd = ctx.saved_tensors
        kernels = _kernels()
        x = streams.reshape(-1, streams.shape[-2] * streams.shape[-1])
        tokens, width = x.shape
        mixes, padded = fn.shape[0], ctx.padded
        dmix = dmix.reshape(tokens, mixes).float()
        g = dmix.new_zeros(tokens, padded)
        g[:, :mixes] = dmix * rstd[:, None]
        dstreams = dfn = None
        if ctx.needs_input_grad[0]:
            # d(rstd)/dx = -rstd^3 x / K: its share of the gradient is -(rstd^2 / K) (dmix . mix) x.
            coef = (dmix * mix).sum(-1) * rstd.square() / width
            fn_pad = fn.new_zeros(padded, width)
            fn_pad[:mixes] = fn
            dx = torch.empty_like(x)
            if tokens:
                grid = (math.ceil(tokens / _MIX_BLOCK_T), math.ceil(width / _MIX_BLOCK_K))
                kernels._mix_backward_streams[grid](g, fn_pad, x, coef, dx, tokens, width, WP=padded,
                                                    BT=_MIX_BLOCK_T, BK=_MIX_BLOCK_K)  # fmt: skip
            dstreams = dx.view_as(streams)
        if ctx.needs_input_grad[1]:
            dfn = fn.new_zeros(mixes, width)
            if tokens:
                grid = (math.ceil(width / _MIX_BLOCK_K),)
                kernels._mix_backward_fn[grid](g, x, dfn, tokens, width, W=mixes, WP=padded, BT=_MIX_BLOCK_T,
                                               BK=_MIX_BLOCK_K)  # fmt: skip
        return dstreams, dfn, None


def stream_mix(streams: torch.Tensor, fn: torch.Tensor, eps: float, *, order: str, backend: str = "auto") -> torch.Tensor:
    """``fn`` (``[W, M*D]`` fp32) applied to the RMS-normalised streams ``[..., M, D]``: fp32
    ``[..., W]``. ``order`` is the reference's rounding order (``naive.MIX_ORDERS``); the kernel
    projects first and scales by 1/RMS (equal up to fp32 rounding)."""
    _check_streams(streams)
    if order not in MIX_ORDERS:
        raise ValueError(f"order must be one of {MIX_ORDERS}, got {order!r}")
    width = streams.shape[-2] * streams.shape[-1]
    if not isinstance(fn, torch.Tensor) or fn.ndim != 2 or fn.shape[1] != width:
        raise ValueError(f"fn must be [W, M*D] = [W, {width}], got {getattr(fn, 'shape', type(fn).__name__)}")
    if not (isinstance(eps, float) and eps >= 0):
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")
    if resolve_hc_backend(backend, streams) == "torch":
        return stream_mix_reference(streams, fn, eps, order)
    return _StreamMix.apply(streams.contiguous(), fn.float().contiguous(), eps)


# ------------------------------------------------------------------------------------------------
# collapse
# ------------------------------------------------------------------------------------------------


class _Collapse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        kernels = _kernels()
        m, d = streams.shape[-2:]
        x = streams.reshape(-1, m, d)
        out = x.new_empty(x.shape[0], d)
        if x.shape[0]:
            grid = (x.shape[0], math.ceil(d / _BLOCK_D))
            kernels._collapse_forward[grid](x, pre.reshape(-1, m), out, d, M=m, MP=next_power_of_2(m),
                                            BD=_BLOCK_D)  # fmt: skip
        ctx.save_for_backward(streams, pre)
        return out.view(*streams.shape[:-2], d)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        streams, pre = ctx.saved_tensors
        kernels = _kernels()
        m, d = streams.shape[-2:]
        x = streams.reshape(-1, m, d)
        dx = torch.empty_like(x)
        dpre = pre.new_empty(x.shape[0], m)
        if x.shape[0]:
            kernels._collapse_backward[(x.shape[0],)](x, pre.reshape(-1, m), dout.contiguous(), dx, dpre, d, M=m,
                                                      MP=next_power_of_2(m), BD=_BLOCK_D)  # fmt: skip
        return dx.view_as(streams), dpre.view_as(pre)


def collapse_streams(streams: torch.Tensor, pre: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``sum_m pre[..., m] * streams[..., m, :]`` in fp32, in the streams' dtype: ``[..., D]``."""
    _check_streams(streams)
    _check_coefficients("pre", pre, tuple(streams.shape[:-1]), streams.device)
    if resolve_hc_backend(backend, streams) == "torch":
        return collapse_reference(streams, pre)
    return _Collapse.apply(streams.contiguous(), pre.contiguous())


# ------------------------------------------------------------------------------------------------
# expand
# ------------------------------------------------------------------------------------------------


class _Expand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sublayer_out, streams, post, comb, round_terms: bool):
        kernels = _kernels()
        m, d = streams.shape[-2:]
        x = streams.reshape(-1, m, d)
        out = torch.empty_like(x)
        if x.shape[0]:
            grid = (x.shape[0], math.ceil(d / _BLOCK_D))
            kernels._expand_forward[grid](sublayer_out.reshape(-1, d), x, post.reshape(-1, m), comb.reshape(-1, m, m),
                                          out, d, M=m, MP=next_power_of_2(m), BD=_BLOCK_D,
                                          ROUND_TERMS=round_terms)  # fmt: skip
        ctx.save_for_backward(sublayer_out, streams, post, comb)
        ctx.round_terms = round_terms
        return out.view_as(streams)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        sublayer_out, streams, post, comb = ctx.saved_tensors
        kernels = _kernels()
        m, d = streams.shape[-2:]
        x = streams.reshape(-1, m, d)
        tokens = x.shape[0]
        da = torch.empty_like(sublayer_out).reshape(-1, d)
        dx = torch.empty_like(x)
        dpost = post.new_empty(tokens, m)
        dcomb = comb.new_empty(tokens, m, m)
        if tokens:
            kernels._expand_backward[(tokens,)](sublayer_out.reshape(-1, d), x, post.reshape(-1, m),
                                                comb.reshape(-1, m, m), dout.contiguous().view(-1, m, d), da, dx,
                                                dpost, dcomb, d, M=m, MP=next_power_of_2(m), BD=_BLOCK_D,
                                                ROUND_TERMS=ctx.round_terms)  # fmt: skip
        return da.view_as(sublayer_out), dx.view_as(streams), dpost.view_as(post), dcomb.view_as(comb), None


def expand_streams(
    sublayer_out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    rounding: str,
    backend: str = "auto",
) -> torch.Tensor:
    """The new streams ``post[n] * sublayer_out + sum_m comb[m, n] * streams[m]`` ``[..., M, D]``,
    rounded as ``rounding`` says (``naive.ROUNDINGS``: V4's ``"terms"``, V4.1's ``"once"``)."""
    _check_streams(streams)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    lead, (m, d) = tuple(streams.shape[:-2]), tuple(streams.shape[-2:])
    if not isinstance(sublayer_out, torch.Tensor) or tuple(sublayer_out.shape) != (*lead, d):
        raise ValueError(f"sublayer_out must have shape {(*lead, d)}, got {getattr(sublayer_out, 'shape', None)}")
    if sublayer_out.dtype != streams.dtype:
        raise TypeError(f"sublayer_out is {sublayer_out.dtype}, the streams {streams.dtype}: they must match")
    _check_coefficients("post", post, (*lead, m), streams.device)
    _check_coefficients("comb", comb, (*lead, m, m), streams.device)
    if resolve_hc_backend(backend, streams) == "torch":
        return expand_reference(sublayer_out, streams, post, comb, rounding)
    return _Expand.apply(sublayer_out.contiguous(), streams.contiguous(), post.contiguous(), comb.contiguous(),
                         rounding == "terms")  # fmt: skip
