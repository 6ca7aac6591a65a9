"""V4's per-head q RMS norm + RoPE: the public op, its validation and backend dispatch.

``backend="torch"`` (and ``"auto"`` on CPU) runs the reference (``naive.head_rms_rope_reference``,
autograd through eager ops); ``"tilelang"`` (``"auto"`` on CUDA) runs ``kernels.py`` through
``HeadRmsRopeFunction``, which keeps x and the fp32 ``rstd`` of each row for the backward.
"""

from __future__ import annotations

import torch

from nemo_dsa._checks import check_finite_float, check_tensor
from nemo_dsa.ops.dispatch import resolve_backend
from nemo_dsa.ops.head_norm_rope.naive import head_rms_rope_reference


def _rows_and_tables(x: torch.Tensor, angles: torch.Tensor):
    batch, seq, heads, dim = x.shape
    half = angles.shape[-1]
    cos = angles.cos().reshape(batch * seq, half) if half else x.new_zeros(batch * seq, 1, dtype=torch.float32)
    sin = angles.sin().reshape(batch * seq, half) if half else x.new_zeros(batch * seq, 1, dtype=torch.float32)
    return x.reshape(batch * seq * heads, dim), cos.contiguous(), sin.contiguous()


def _kernel(which: str, x: torch.Tensor, rope_dim: int):
    from nemo_dsa.ops._tilelang import compile_cached
    from nemo_dsa.ops.head_norm_rope import kernels

    factory = kernels.forward_kernel if which == "forward" else kernels.backward_kernel
    return compile_cached(factory, dim=x.shape[-1], rope_dim=rope_dim, block_heads=kernels.block_heads_for(x.shape[2]))


class HeadRmsRopeFunction(torch.autograd.Function):
    """The TileLang forward and backward; keeps ``x`` (bf16) and ``rstd`` (fp32, one a row)."""

    @staticmethod
    def forward(ctx, x, angles, eps):
        x = x.contiguous()
        rows, cos, sin = _rows_and_tables(x, angles)
        q = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        if rows.shape[0]:
            _kernel("forward", x, 2 * angles.shape[-1])(rows, cos, sin, q, rstd, x.shape[2], float(eps))
        ctx.save_for_backward(x, angles, rstd)
        return q.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, angles, rstd = ctx.saved_tensors
        rows, cos, sin = _rows_and_tables(x, angles)
        grad_rows = grad.to(x.dtype).contiguous().view(rows.shape)
        dx = torch.empty_like(rows)
        if rows.shape[0]:
            _kernel("backward", x, 2 * angles.shape[-1])(grad_rows, rows, rstd, cos, sin, dx, x.shape[2])
        return dx.view(x.shape), None, None


def head_rms_rope(x: torch.Tensor, angles: torch.Tensor, eps: float, *, backend: str = "auto") -> torch.Tensor:
    """V4's query preparation: per-head RMS norm of ``x [B, S, H, D]`` without a weight, then RoPE on
    its last ``2 * angles.shape[-1]`` channels (interleaved pairs) by ``angles [B, S, half]`` (fp32).

    The kernels take bf16 ``x`` on CUDA (the angles are not differentiated); the result has x's dtype.
    """
    check_tensor("x", x, ndim=4, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64))
    batch, seq, _heads, dim = x.shape
    check_tensor("angles", angles, ndim=3, dtypes=(torch.float32,), shape=(batch, seq, None), device=x.device)
    if 2 * angles.shape[-1] > dim:
        raise ValueError(f"angles rotate {2 * angles.shape[-1]} channels, more than x's head dim {dim}")
    check_finite_float("eps", eps)
    backend = resolve_backend(backend, x, angles)
    if backend == "torch":
        return head_rms_rope_reference(x, angles, eps)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must have dtype bfloat16 for the TileLang kernels, got {str(x.dtype).replace('torch.', '')}")
    if not kernels_support(dim, 2 * angles.shape[-1]):
        raise ValueError(f"the TileLang kernels take head dims that are multiples of 128, got {dim}; use backend='torch'")
    return HeadRmsRopeFunction.apply(x, angles.detach(), eps)


def kernels_support(dim: int, rope_dim: int) -> bool:
    """Whether the TileLang kernels take this head dim and rotary width (``kernels.supports``)."""
    from nemo_dsa.ops.head_norm_rope import kernels

    return kernels.supports(dim, rope_dim)
