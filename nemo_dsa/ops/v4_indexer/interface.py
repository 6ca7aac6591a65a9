"""V4 indexer APIs: fp32 scoring, top-k selection and gradients through the selected scores.

:func:`v4_indexer_bshd` takes the internal BSHD layout (q [B, S, H, D] bf16, k [B, K, D] bf16,
w [B, S, H] fp32); the seed API :func:`v4_lighting_indexer` takes V4's SBHD layout (index_q
[S, B, H, D], index_k [K, B, D], weights [S, B, H]) and transposes to it.

Imports run one way: the reference (``naive``) and the kernels (``kernels``) score; this module
validates, dispatches (in :func:`_forward` / :func:`_backward` only), selects (``topk``, or the
streamed ``fused_selection``) and holds the autograd functions. Importing the kernel module does
not import TileLang (its factories do, when a kernel is built).

The seed APIs and :func:`v4_indexer_bshd` validate every argument; :func:`v4_indexer_in_ranges`
(the indexer layer's entry) takes the metadata's :class:`~nemo_dsa.visibility.KeyRanges` and
tensors the layer made, and checks nothing.
"""

from __future__ import annotations

import torch

from nemo_dsa._checks import INT32_MAX, check_index_range, check_positive_int, check_qkw, check_tensor
from nemo_dsa.ops.dispatch import resolve_backend, resolve_fused_topk
from nemo_dsa.ops.fused_selection import interface as fused_selection
from nemo_dsa.ops.topk.gather import gather_at_indices, pytorch_extract_topk_scores
from nemo_dsa.ops.topk.interface import select_topk_in_ranges
from nemo_dsa.ops.v4_indexer.kernels import kernel_refusal, v4_logits_tilelang, v4_topk_backward_tilelang
from nemo_dsa.ops.v4_indexer.naive import v4_backward_in_ranges, v4_logits_in_ranges
from nemo_dsa.visibility import KeyRanges, causal_ks_ke, check_ks_ke

# pytorch_extract_topk_scores lives in topk.gather; it stays importable from here, the seed
# API's module.
__all__ = [
    "V4IndexerBSHDFunction",
    "V4IndexerFunction",
    "pytorch_extract_topk_scores",
    "v4_indexer_bshd",
    "v4_indexer_in_ranges",
    "v4_lighting_indexer",
    "v4_lightning_indexer",
]


def _forward(backend, q, k, w, ranges: KeyRanges, topk, topk_indices):
    """(index_score fp32 [B, S, T], topk_indices int32 [B, S, T]) on BSHD tensors: the logits
    from the kernel or the reference, then selection (unless indices are given) and the gather."""
    ks, ke = ranges.ks, ranges.ke
    logits = v4_logits_tilelang(q, k, w, ks, ke) if backend == "tilelang" else v4_logits_in_ranges(q, k, w, ranges)
    if topk_indices is None:
        # Every finite logit lies in [ks, ke): the kernel selector reads only those keys (the
        # reference would mask a copy of the logits with the range, which changes nothing here).
        read_only = dict(ks=ks, ke=ke) if backend == "tilelang" else {}
        topk_indices = select_topk_in_ranges(logits, topk, order="score", backend=backend, **read_only)
    # Given indices were range-checked in _validate; selected ones are in range by construction.
    return gather_at_indices(logits, topk_indices), topk_indices


def _backward(backend, q, k, w, ranges: KeyRanges, topk_indices, grad_scores):
    """(dq, dk, dw) through the gathered scores. The indices were checked (given) or produced
    (selected) in the forward, so neither path reads them on the host again."""
    if backend == "tilelang":
        return v4_topk_backward_tilelang(q, k, w, topk_indices, grad_scores.float(), ranges.ks, ranges.ke)
    return v4_backward_in_ranges(q, k, w, ranges, topk_indices, grad_scores)


def _check_layout(index_q, index_k, weights, *, seq_first: bool) -> tuple[int, int, int, int, int]:
    """q/k/w checks in the caller's layout (SBHD for the seed API); returns (B, S, H, D, K).

    Messages name the caller's arguments and quote the caller's own shapes.
    """
    names = ("index_q", "index_k", "weights") if seq_first else ("q", "k", "w")
    sizes = check_qkw(
        index_q, index_k, weights, dtypes=((torch.bfloat16,), (torch.bfloat16,), (torch.float32,)),
        names=names, seq_first=seq_first,
    )
    return sizes


def _validate(q, k, w, compress_ratio, topk, topk_indices, ks, ke) -> KeyRanges:
    """Check every BSHD argument; returns the ranges, the unpacked causal default filled in."""
    batch, queries, _, _, num_keys = _check_layout(q, k, w, seq_first=False)
    device = q.device
    check_positive_int("compress_ratio", compress_ratio, maximum=INT32_MAX)
    check_positive_int("topk", topk)
    if ks is None and ke is None:
        ranges = KeyRanges(*causal_ks_ke(batch, queries, num_keys, compress_ratio, device), num_keys)
    else:
        ranges = check_ks_ke(ks, ke, batch=batch, queries=queries, num_keys=num_keys, device=device)
    if topk_indices is not None:
        count = min(topk, num_keys)
        check_tensor(
            "topk_indices", topk_indices, ndim=3, dtypes=(torch.int32,), shape=(batch, queries, count), device=device
        )
        check_index_range("topk_indices", topk_indices, num_keys)
    return ranges


class _V4IndexerInRanges(torch.autograd.Function):
    """The indexer on checked (or made) arguments: ``apply(q, k, w, ranges, topk, topk_indices,
    backend, fused_topk)`` with a resolved backend. Gradients for q, k and w only."""

    @staticmethod
    def forward(ctx, q, k, w, ranges, topk, topk_indices, backend, fused_topk):
        if resolve_fused_topk(fused_topk, backend) and topk_indices is None:
            # Selection streamed over query chunks: no [B, S, K] logits are ever held.
            index_score, topk_indices = fused_selection.v4_select_topk_in_ranges(q, k, w, ranges, topk, backend)
        else:
            index_score, topk_indices = _forward(backend, q, k, w, ranges, topk, topk_indices)
        ctx.save_for_backward(q, k, w, ranges.ks, ranges.ke, topk_indices)
        ctx.backend, ctx.num_keys = backend, ranges.num_keys
        ctx.mark_non_differentiable(topk_indices)
        return index_score, topk_indices

    @staticmethod
    def backward(ctx, grad_scores, grad_indices):
        q, k, w, ks, ke, topk_indices = ctx.saved_tensors
        dq, dk, dw = _backward(ctx.backend, q, k, w, KeyRanges(ks, ke, ctx.num_keys), topk_indices, grad_scores)
        return dq, dk, dw, None, None, None, None, None


class V4IndexerBSHDFunction(torch.autograd.Function):
    """Autograd function of :func:`v4_indexer_bshd` on BSHD tensors.

    ``apply(q, k, w, compress_ratio, topk, topk_indices, ks, ke, backend, fused_topk)``. The
    backward returns gradients for q, k and w only (in their dtypes); they flow solely through
    the gathered scores, so entries at -1 (queries that see nothing) contribute nothing.
    """

    @staticmethod
    def forward(ctx, q, k, w, compress_ratio, topk, topk_indices=None, ks=None, ke=None, backend="auto", fused_topk=None):
        ranges = _validate(q, k, w, compress_ratio, topk, topk_indices, ks, ke)
        backend = resolve_backend(backend, q, k, w, kernel_refusal=kernel_refusal(*q.shape[2:]))
        return _V4IndexerInRanges.forward(ctx, q, k, w, ranges, topk, topk_indices, backend, fused_topk)

    @staticmethod
    def backward(ctx, grad_scores, grad_indices):
        dq, dk, dw, *_ = _V4IndexerInRanges.backward(ctx, grad_scores, grad_indices)
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
            reduced one at a time, ``nemo_dsa.ops.fused_selection``); both paths select the same
            keys. ``None`` (default): on with the TileLang backend, off with the torch one.

    Returns:
        index_score fp32 [B, S, T] (-inf at -1) and topk_indices int32 [B, S, T], ordered by
        descending score with ties to the smaller index, -1 padding.
    """
    return V4IndexerBSHDFunction.apply(q, k, w, compress_ratio, topk, topk_indices, ks, ke, backend, fused_topk)


def v4_indexer_in_ranges(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ranges: KeyRanges,
    topk: int,
    *,
    backend: str = "auto",
    fused_topk: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`v4_indexer_bshd` for arguments known to be valid: ``ranges`` (the metadata's, made
    by the visibility rule) and q/k/w the caller made in the documented shapes and dtypes.
    Nothing is checked, so a model step reads nothing back for it."""
    backend = resolve_backend(backend, q, k, w, kernel_refusal=kernel_refusal(*q.shape[2:]))
    return _V4IndexerInRanges.apply(q, k, w, ranges, topk, None, backend, fused_topk)


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


# The seed API's name keeps its historical spelling; this is the correctly spelt alias (one function).
v4_lightning_indexer = v4_lighting_indexer
