"""Window + compressed sparse attention: the public op, its validation and backend dispatch.

``backend="torch"`` (and ``"auto"`` on CPU) runs the readable reference
(:func:`naive.window_compressed_attention_reference`); ``"tilelang"`` (``"auto"`` on CUDA)
runs the Hopper kernels of ``kernels.py`` through :class:`SparseWindowAttentionFunction`.
TileLang is imported only when the kernels are first used. :func:`sparse_window_attention`
validates every argument; :func:`attend` (the attention layer's entry) takes the metadata's
:class:`~nemo_dsa.visibility.KeyRanges` or the layer's own selection and checks nothing.
"""

from __future__ import annotations

import torch

from nemo_dsa._checks import INT32_MAX, check_finite_float, check_has_data, check_index_range, check_positive_int, check_tensor
from nemo_dsa.ops.dispatch import resolve_backend
from nemo_dsa.ops.sparse_attention.configs import MAX_DIM, MAX_HEADS, MAX_SELECTED
from nemo_dsa.ops.sparse_attention.naive import attend_window_and_compressed, check_dropout_p
from nemo_dsa.visibility import KeyRanges, check_ks_ke

# Limits of the kernels (the reference has none).
KERNEL_MAX_HEADS, KERNEL_MAX_DIM, KERNEL_MAX_SELECTED = MAX_HEADS, MAX_DIM, MAX_SELECTED
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class SparseWindowAttentionFunction(torch.autograd.Function):
    """Autograd over the TileLang kernels: gradients for q, raw_kv, compressed_kv and sink.

    ``lse`` is returned as a non-differentiable output (its consumers use it detached).
    """

    @staticmethod
    def forward(ctx, q, raw_kv, window_start, window, compressed_kv, indices, ks, ke, sink, scale):
        from nemo_dsa.ops.sparse_attention import kernels

        inputs = kernels.KernelInputs(q, raw_kv, window_start, window, compressed_kv, indices, ks, ke, sink, scale)
        out, lse = kernels.sparse_window_forward(inputs)
        # Tensors go through save_for_backward (not ctx attributes) so that activation
        # checkpointing and saved-tensor hooks see them; backward rebuilds the padded operands.
        ctx.save_for_backward(q, raw_kv, window_start, compressed_kv, indices, ks, ke, sink, out, lse)
        ctx.window, ctx.scale = window, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        from nemo_dsa.ops.sparse_attention import kernels

        q, raw_kv, window_start, compressed_kv, indices, ks, ke, sink, out, lse = ctx.saved_tensors
        inputs = kernels.KernelInputs(
            q, raw_kv, window_start, ctx.window, compressed_kv, indices, ks, ke, sink, ctx.scale
        )
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        has_compressed = compressed_kv is not None
        need_dq, need_d_raw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_d_comp = has_compressed and ctx.needs_input_grad[4]
        need_d_sink = sink is not None and ctx.needs_input_grad[8]
        # Only the gradients some input needs are computed (e.g. frozen compressed kv or q); with
        # none of dq / d raw / d compressed wanted, the sink's delta is all that runs.
        dq, d_raw, d_comp, delta = kernels.sparse_window_backward(
            inputs, out, lse, grad_out, need_dq=need_dq, need_d_raw=need_d_raw, need_d_comp=need_d_comp
        )
        if d_comp is not None and d_comp.shape != compressed_kv.shape:  # zero slots: nothing read
            d_comp = d_comp.new_zeros(compressed_kv.shape)
        d_sink = None
        if need_d_sink:
            # d lse / d sink = p_sink; d out / d sink = -p_sink * out, so dL/dsink = -p_sink * delta.
            p_sink = torch.exp(sink.view(1, 1, -1) - lse)
            d_sink = -(p_sink * delta).sum(dim=(0, 1))
        return dq, d_raw, None, None, d_comp, None, None, None, d_sink, None


def _validate(q, raw_kv, window_start, window, compressed_kv, indices, ks, ke, sink, scale) -> KeyRanges | None:
    """Check every argument (the index range or the ranges' values with one host read); returns
    the ranges of the range form."""
    check_tensor("q", q, ndim=4, dtypes=_FLOAT_DTYPES)
    check_has_data("q", q)
    batch, seq_len, heads, dim = q.shape
    device = q.device
    check_tensor("raw_kv", raw_kv, ndim=3, dtypes=(q.dtype,), shape=(batch, None, dim), device=device)
    if raw_kv.shape[1] < seq_len:
        raise ValueError(f"raw_kv must hold at least one row per query ({seq_len}), got {raw_kv.shape[1]}")
    check_tensor("window_start", window_start, ndim=2, dtypes=(torch.int32,), shape=(batch, seq_len), device=device)
    check_positive_int("window", window, maximum=INT32_MAX)
    check_finite_float("scale", scale)
    if sink is not None:
        check_tensor("sink", sink, ndim=1, dtypes=(torch.float32,), shape=(heads,), device=device)
    if compressed_kv is None:
        if indices is not None or ks is not None or ke is not None:
            raise ValueError("indices / ks / ke need compressed_kv: got compressed_kv=None")
        return None
    check_tensor("compressed_kv", compressed_kv, ndim=3, dtypes=(q.dtype,), shape=(batch, None, dim), device=device)
    num_keys = compressed_kv.shape[1]
    if indices is not None:
        if ks is not None or ke is not None:
            raise ValueError("give either indices or (ks, ke), not both")
        check_tensor("indices", indices, ndim=3, dtypes=(torch.int32,), shape=(batch, seq_len, None), device=device)
        check_index_range("indices", indices, num_keys, meaning=f"-1 = none; compressed_kv has {num_keys} rows")
        return None
    if ks is None and ke is None:
        raise ValueError("compressed_kv needs indices or (ks, ke) to say which rows each query sees")
    return check_ks_ke(ks, ke, batch=batch, queries=seq_len, num_keys=num_keys, device=device)


def _check_kernel_limits(q, indices) -> None:
    heads, dim = q.shape[2], q.shape[3]
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must have dtype bfloat16 for the TileLang kernels, got {str(q.dtype).replace('torch.', '')}")
    if heads > KERNEL_MAX_HEADS:
        raise ValueError(f"q must have at most {KERNEL_MAX_HEADS} heads for the TileLang kernels, got {heads}")
    if dim > KERNEL_MAX_DIM:
        raise ValueError(f"q's head dim must be <= {KERNEL_MAX_DIM} for the TileLang kernels, got {dim}")
    if indices is not None and indices.shape[-1] > KERNEL_MAX_SELECTED:
        raise ValueError(f"indices must have at most {KERNEL_MAX_SELECTED} slots for the TileLang kernels, got {indices.shape[-1]}")


def sparse_window_attention(
    q: torch.Tensor,
    raw_kv: torch.Tensor,
    window_start: torch.Tensor,
    window: int,
    compressed_kv: torch.Tensor | None = None,
    *,
    indices: torch.Tensor | None = None,
    ks: torch.Tensor | None = None,
    ke: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    scale: float,
    backend: str = "auto",
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-query attention over each query's sliding window plus its compressed keys.

    Args:
        q: [B, S, H, D] queries (bf16 for the kernels).
        raw_kv: [B, N_raw, D] raw key/value rows, N_raw >= S; query i owns row i + N_raw - S
            (rows in front are history, e.g. the previous context-parallel rank's tail).
        window_start: int32 [B, S], first raw row of each query's document; the query sees raw
            rows [max(window_start, own - window + 1), own] (none if window_start > own).
        window: sliding-window length (>= 1, the query itself included).
        compressed_kv: [B, K, D] compressed rows, or None for window-only attention.
        indices: int32 [B, S, T] compressed rows per query (-1 = none; repeats count per slot),
        ks, ke: or int32 [B, S]: every compressed row j with ks <= j < ke.
        sink: fp32 [H] per-head sink logits (denominator only), or None.
        scale: softmax scale on q . k.
        backend: "auto" (kernels on CUDA, reference on CPU) | "tilelang" | "torch".
        dropout_p: dropout on the attention probabilities (the reference only: the kernels have
            none, so ``dropout_p > 0`` with ``backend="tilelang"`` is a ValueError).

    Returns:
        out [B, S, H, D] in q's dtype and lse fp32 [B, S, H] (natural log, sink included; -inf
        for a query that sees nothing and has no sink, whose output and gradients are zero).
    """
    ranges = _validate(q, raw_kv, window_start, window, compressed_kv, indices, ks, ke, sink, scale)
    # A window longer than raw_kv sees every row a window of raw_kv's length sees (none lies
    # before row 0): bounded so, the reference allocates no [S, window] index list beyond the rows.
    window = min(window, max(raw_kv.shape[1], 1))
    return attend(q, raw_kv, window_start, window, compressed_kv, indices=indices, ranges=ranges, sink=sink,
                  scale=scale, backend=backend, dropout_p=check_dropout_p(dropout_p))  # fmt: skip


def attend(
    q: torch.Tensor,
    raw_kv: torch.Tensor,
    window_start: torch.Tensor,
    window: int,
    compressed_kv: torch.Tensor | None = None,
    *,
    indices: torch.Tensor | None = None,
    ranges: KeyRanges | None = None,
    sink: torch.Tensor | None = None,
    scale: float,
    backend: str = "auto",
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sparse_window_attention` on arguments known to be valid: ``indices`` the caller
    selected itself (in [-1, K)) or ``ranges`` (the metadata's, made by the visibility rule),
    every tensor made in the documented shapes and dtypes. Only the kernels' limits (shapes) are
    checked, so a model step reads nothing back for it."""
    ks, ke = (None, None) if ranges is None else (ranges.ks, ranges.ke)
    tensors = [t for t in (q, raw_kv, window_start, compressed_kv, indices, ks, ke, sink) if t is not None]
    backend = resolve_backend(backend, *tensors)
    if backend == "torch":
        return attend_window_and_compressed(
            q, raw_kv, window_start, window, compressed_kv, indices=indices, ks=ks, ke=ke, sink=sink, scale=float(scale),
            dropout_p=dropout_p,
        )
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p}: the TileLang attention kernels have no dropout; use backend='torch'")
    _check_kernel_limits(q, indices)
    return SparseWindowAttentionFunction.apply(
        q, raw_kv, window_start, window, compressed_kv, indices, ks, ke, sink, float(scale)
    )
