"""V4 indexer APIs: fp32 scoring, top-k selection and gradients through the selected scores.

:func:`v4_indexer_bshd` takes the internal BSHD layout (q [B, S, H, D] bf16, k [B, K, D] bf16,
w [B, S, H] fp32); the seed API :func:`v4_lighting_indexer` takes V4's SBHD layout (index_q
[S, B, H, D], index_k [K, B, D], weights [S, B, H]) and transposes to it. Backend dispatch lives in
:func:`_forward` / :func:`_backward` only: the torch path is the reference in ``naive.py``; the
TileLang path imports ``.kernels`` lazily and calls ``kernels.v4_indexer_forward`` /
``kernels.v4_indexer_backward`` with the same signatures as ``_forward_torch`` / ``_backward_torch``.
"""

from __future__ import annotations

import torch

from nemo_dsa._checks import check_positive_int, check_tensor
from nemo_dsa.ops._dispatch import resolve_backend, resolve_fused_topk
from nemo_dsa.ops._visibility import causal_ks_ke, check_ks_ke
from nemo_dsa.ops.topk.naive import select_topk
from nemo_dsa.ops.v4_indexer.naive import v4_backward, v4_logits


def pytorch_extract_topk_scores(logits: torch.Tensor, topk_indices: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Gather ``logits`` at ``topk_indices`` along ``dim``, -inf where the index is -1.

    Indices must lie in [-1, size): anything else is a ValueError rather than being clipped.
    All other dimensions of the two tensors must match.
    """
    check_tensor("logits", logits)
    check_tensor("topk_indices", topk_indices, dtypes=(torch.int32, torch.int64), device=logits.device)
    if topk_indices.ndim != logits.ndim:
        raise ValueError(
            f"topk_indices must have {logits.ndim} dimensions like logits, got shape {tuple(topk_indices.shape)}"
        )
    axis = dim % logits.ndim
    for d in range(logits.ndim):
        if d != axis and topk_indices.shape[d] != logits.shape[d]:
            raise ValueError(
                f"topk_indices must match logits outside dim {dim}: "
                f"got {tuple(topk_indices.shape)} vs {tuple(logits.shape)}"
            )
    size = logits.shape[axis]
    if topk_indices.numel() and bool(((topk_indices < -1) | (topk_indices >= size)).any()):
        raise ValueError(
            f"topk_indices must lie in [-1, {size}) (-1 = no key), got range "
            f"[{int(topk_indices.min())}, {int(topk_indices.max())}]"
        )
    present = topk_indices >= 0
    gathered = torch.gather(logits, axis, torch.where(present, topk_indices, 0).long())
    return torch.where(present, gathered, float("-inf"))


def _forward_torch(q, k, w, ks, ke, topk, topk_indices):
    """Reference forward on BSHD tensors: (index_score fp32 [B,S,T], topk_indices int32 [B,S,T])."""
    logits = v4_logits(q, k, w, ks, ke)
    if topk_indices is None:
        topk_indices = select_topk(logits, topk, order="score")
    return pytorch_extract_topk_scores(logits, topk_indices), topk_indices


def _backward_torch(q, k, w, ks, ke, topk_indices, grad_scores):
    """Reference backward on BSHD tensors: (dq, dk, dw)."""
    return v4_backward(q, k, w, ks, ke, topk_indices, grad_scores)


def _forward(backend, *args):
    if backend == "tilelang":
        from nemo_dsa.ops.v4_indexer import kernels

        return kernels.v4_indexer_forward(*args)
    return _forward_torch(*args)


def _backward(backend, *args):
    if backend == "tilelang":
        from nemo_dsa.ops.v4_indexer import kernels

        return kernels.v4_indexer_backward(*args)
    return _backward_torch(*args)


def _check_layout(index_q, index_k, weights, *, seq_first: bool) -> tuple[int, int, int, int]:
    """Tensor, dtype and shape checks of q/k/w in the caller's layout; returns (B, S, H, D).

    ``seq_first`` is the seed SBHD layout (q [S, B, H, D], k [K, B, D], w [S, B, H]); otherwise
    BSHD (q [B, S, H, D], k [B, K, D], w [B, S, H]). Messages quote the caller's own shapes.
    """
    q_name, k_name, w_name = ("index_q", "index_k", "weights") if seq_first else ("q", "k", "w")
    check_tensor(q_name, index_q, ndim=4, dtypes=(torch.bfloat16,))
    device = index_q.device
    if seq_first:
        queries, batch, heads, dim = index_q.shape
        key_shape, weight_shape = (None, batch, dim), (queries, batch, heads)
    else:
        batch, queries, heads, dim = index_q.shape
        key_shape, weight_shape = (batch, None, dim), (batch, queries, heads)
    check_tensor(k_name, index_k, ndim=3, dtypes=(torch.bfloat16,), shape=key_shape, device=device)
    check_tensor(w_name, weights, ndim=3, dtypes=(torch.float32,), shape=weight_shape, device=device)
    if dim % 16:
        raise ValueError(f"{q_name} must have a head dim divisible by 16, got {dim}")
    return batch, queries, heads, dim


def _validate(q, k, w, compress_ratio, topk, topk_indices, ks, ke):
    """Check every BSHD argument; returns (ks, ke) with the unpacked causal default filled in."""
    batch, queries, _, _ = _check_layout(q, k, w, seq_first=False)
    device = q.device
    check_positive_int("compress_ratio", compress_ratio)
    check_positive_int("topk", topk)
    num_keys = k.shape[1]
    if ks is None and ke is None:
        ks, ke = causal_ks_ke(batch, queries, num_keys, compress_ratio, device)
    else:
        check_ks_ke(ks, ke, batch=batch, queries=queries, num_keys=num_keys, device=device)
    if topk_indices is not None:
        count = min(topk, num_keys)
        check_tensor(
            "topk_indices", topk_indices, ndim=3, dtypes=(torch.int32,), shape=(batch, queries, count), device=device
        )
        if topk_indices.numel() and bool(((topk_indices < -1) | (topk_indices >= num_keys)).any()):
            raise ValueError(f"topk_indices must lie in [-1, {num_keys}) (-1 = no key)")
    return ks, ke


class V4IndexerBSHDFunction(torch.autograd.Function):
    """Autograd function of :func:`v4_indexer_bshd` on BSHD tensors.

    ``apply(q, k, w, compress_ratio, topk, topk_indices, ks, ke, backend, fused_topk)``. The
    backward returns gradients for q, k and w only (in their dtypes); they flow solely through
    the gathered scores, so entries at -1 (queries that see nothing) contribute nothing.
    """

    @staticmethod
    def forward(ctx, q, k, w, compress_ratio, topk, topk_indices=None, ks=None, ke=None, backend="auto", fused_topk=None):
        ks, ke = _validate(q, k, w, compress_ratio, topk, topk_indices, ks, ke)
        backend = resolve_backend(backend, q, k, w)
        if resolve_fused_topk(fused_topk, backend) and topk_indices is None:
            # Selection streamed over query chunks: no [B, S, K] logits are ever held.
            from nemo_dsa.ops.topk.streaming import v4_select_topk_validated

            index_score, topk_indices = v4_select_topk_validated(q, k, w, ks, ke, topk, backend)
        else:
            index_score, topk_indices = _forward(backend, q, k, w, ks, ke, topk, topk_indices)
        ctx.save_for_backward(q, k, w, ks, ke, topk_indices)
        ctx.backend = backend
        ctx.mark_non_differentiable(topk_indices)
        return index_score, topk_indices

    @staticmethod
    def backward(ctx, grad_scores, grad_indices):
        q, k, w, ks, ke, topk_indices = ctx.saved_tensors
        dq, dk, dw = _backward(ctx.backend, q, k, w, ks, ke, topk_indices, grad_scores)
        return dq, dk, dw, None, None, None, None, None, None, None


class V4IndexerFunction(torch.autograd.Function):
    """Autograd function of :func:`v4_lighting_indexer` (same positional arguments, SBHD).

    ``apply(index_q, index_k, weights, compress_ratio, topk, topk_indices, ks, ke, backend, fused_topk)``.
    Runs :class:`V4IndexerBSHDFunction` on the transposed views; the backward returns gradients
    for index_q, index_k and weights only (in their dtypes and SBHD layout).
    """

    @staticmethod
    def forward(ctx, index_q, index_k, weights, compress_ratio, topk, topk_indices=None, ks=None, ke=None,
                backend="auto", fused_topk=None):
        _check_layout(index_q, index_k, weights, seq_first=True)
        q, k, w = index_q.transpose(0, 1), index_k.transpose(0, 1), weights.transpose(0, 1)
        return V4IndexerBSHDFunction.forward(ctx, q, k, w, compress_ratio, topk, topk_indices, ks, ke, backend, fused_topk)

    @staticmethod
    def backward(ctx, grad_scores, grad_indices):
        dq, dk, dw, *rest = V4IndexerBSHDFunction.backward(ctx, grad_scores, grad_indices)
        return (dq.transpose(0, 1), dk.transpose(0, 1), dw.transpose(0, 1), *rest)


def v4_indexer_bshd(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    compress_ratio: int,
    topk: int,
    *,
    topk_indices: torch.Tensor | None = None,
    ks: torch.Tensor | None = None,
    ke: torch.Tensor | None = None,
    backend: str = "auto",
    fused_topk: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 indexer on BSHD tensors: top-k compressed keys per query and their fp32 logits, differentiable.

    Args:
        q: [B, S, H, D] bf16 index queries (D divisible by 16).
        k: [B, K, D] bf16 compressed index keys.
        w: [B, S, H] fp32 per-head weights (scaling already folded in).
        compress_ratio: tokens per compressed group R (>= 1); used for the default visibility.
        topk: keys to select per query (T = min(topk, K)).
        topk_indices: optional int32 [B, S, T] indices in [-1, K) that skip selection.
        ks, ke: optional int32 [B, S] visible ranges; default ks = 0, ke = min((i + 1) // R, K).
        backend: "auto" | "tilelang" | "torch".
        fused_topk: select without holding the [B, S, K] logits (query chunks scored and
            reduced one at a time, ``nemo_dsa.ops.topk.streaming``); both paths select the same
            keys. ``None`` (default): on with the TileLang backend, off with the torch one.

    Returns:
        index_score fp32 [B, S, T] (-inf at -1) and topk_indices int32 [B, S, T], ordered by
        descending score with ties to the smaller index, -1 padding.
    """
    return V4IndexerBSHDFunction.apply(q, k, w, compress_ratio, topk, topk_indices, ks, ke, backend, fused_topk)


def v4_lighting_indexer(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    weights: torch.Tensor,
    compress_ratio: int,
    topk: int,
    topk_indices: torch.Tensor | None = None,
    *,
    ks: torch.Tensor | None = None,
    ke: torch.Tensor | None = None,
    backend: str = "auto",
    fused_topk: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 indexer seed API in V4's SBHD layout: :func:`v4_indexer_bshd` on transposed views.

    Args:
        index_q: [S, B, H, D] bf16 index queries (D divisible by 16).
        index_k: [K, B, D] bf16 compressed index keys.
        weights: [S, B, H] fp32 per-head weights (scaling already folded in).
        compress_ratio, topk, topk_indices, ks, ke, backend, fused_topk: as in
            :func:`v4_indexer_bshd` (ks, ke and topk_indices are [B, S, ...] there and here).

    Returns:
        index_score fp32 [B, S, T] (-inf at -1) and topk_indices int32 [B, S, T], ordered by
        descending score with ties to the smaller index, -1 padding; gradients reach the inputs
        in their SBHD layout.
    """
    # Checked in the caller's layout first, so a bad shape is reported as the caller wrote it.
    _check_layout(index_q, index_k, weights, seq_first=True)
    return v4_indexer_bshd(
        index_q.transpose(0, 1), index_k.transpose(0, 1), weights.transpose(0, 1), compress_ratio, topk,
        topk_indices=topk_indices, ks=ks, ke=ke, backend=backend, fused_topk=fused_topk,
    )
