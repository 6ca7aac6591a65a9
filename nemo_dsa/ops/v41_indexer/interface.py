"""V4.1 indexer seed API: frozen scores with the released BF16 rounding boundaries.

Imports run one way: the reference (``naive``) and the kernels (``kernels``) score; this module
validates and dispatches (in :func:`_scores` only). Importing the kernel module does not import
TileLang (its factories do, when a kernel is built). :func:`indexer_scores` validates every
argument; :func:`indexer_scores_in_ranges` (the indexer layer's entry) takes the metadata's
:class:`~nemo_dsa.visibility.KeyRanges` and tensors the layer made, and checks nothing.
"""

from __future__ import annotations

import torch

from nemo_dsa._checks import check_qkw, check_tensor
from nemo_dsa.ops.dispatch import resolve_backend
from nemo_dsa.ops.v41_indexer.heads import kernel_refusal
from nemo_dsa.ops.v41_indexer.kernels import indexer_scores_tilelang
from nemo_dsa.ops.v41_indexer.naive import v41_scores_in_ranges
from nemo_dsa.visibility import KeyRanges, check_ks_ke

__all__ = ["indexer_scores", "indexer_scores_in_ranges"]


def _scores_torch(queries, keys, weights, allowed, ranges):
    """Reference: exactly one of ``allowed`` (dense bool, honoured elementwise) or ``ranges``."""
    if allowed is None:
        return v41_scores_in_ranges(queries, keys, weights, ranges)
    batch, sequence, num_keys = queries.shape[0], queries.shape[1], keys.shape[1]
    everything = torch.full((batch, sequence), num_keys, dtype=torch.int32, device=queries.device)
    scores = v41_scores_in_ranges(queries, keys, weights, KeyRanges(torch.zeros_like(everything), everything, num_keys))
    return scores.masked_fill_(~allowed, float("-inf"))


def _scores(backend, queries, keys, weights, allowed, ranges):
    if backend == "tilelang":
        ks, ke = (None, None) if ranges is None else (ranges.ks, ranges.ke)
        return indexer_scores_tilelang(queries, keys, weights, allowed, ks, ke)
    return _scores_torch(queries, keys, weights, allowed, ranges)


def _validate(queries, keys, weights, allowed, ks, ke) -> KeyRanges | None:
    batch, sequence, heads, dim, width = check_qkw(
        queries, keys, weights, dtypes=((torch.bfloat16,),) * 3, names=("queries", "keys", "weights")
    )
    device = queries.device
    if allowed is not None:
        if ks is not None or ke is not None:
            raise ValueError("give either allowed or (ks, ke), not both")
        check_tensor("allowed", allowed, ndim=3, dtypes=(torch.bool,), shape=(batch, sequence, None), device=device)
        if allowed.shape[2] < width:  # more columns than keys are allowed (never visible), fewer are not
            raise ValueError(f"allowed must have at least {width} columns (one per key), got shape {list(allowed.shape)}")
        return None
    if ks is None and ke is None:
        raise ValueError("one of allowed or (ks, ke) is required to say which keys each query sees")
    return check_ks_ke(ks, ke, batch=batch, queries=sequence, num_keys=width, device=device)


@torch.no_grad()
def indexer_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    allowed: torch.Tensor | None = None,
    *,
    ks: torch.Tensor | None = None,
    ke: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Frozen V4.1 indexer scores, bf16 ``[B, S, K]``, -inf where a key is not visible; no autograd graph.

    Args:
        queries: [B, S, H, D] bf16, MXFP4 + RoPE applied. The kernels take H a power of two
            <= 128 and D a multiple of 16 up to 256; "auto" runs the reference for other shapes.
        keys: [B, K, D] bf16 compressed index keys (global compressed axis).
        weights: [B, S, H] bf16 per-head weights, released scaling folded in.
        allowed: dense bool [B, S, K] visibility, honoured elementwise; or instead
        ks, ke: int32 [B, S] visible ranges [ks, ke). Exactly one of the two forms.
        backend: "auto" | "tilelang" | "torch".
    """
    ranges = _validate(queries, keys, weights, allowed, ks, ke)
    if allowed is not None:
        allowed = allowed[..., : keys.shape[1]]  # docs/semantics.md: columns past K are never visible
    tensors = (t for t in (queries, keys, weights, allowed, ks, ke) if t is not None)
    backend = resolve_backend(backend, *tensors, kernel_refusal=kernel_refusal(*queries.shape[2:]))
    return _scores(backend, queries, keys, weights, allowed, ranges)


@torch.no_grad()
def indexer_scores_in_ranges(
    queries: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, ranges: KeyRanges, *, backend: str = "auto"
) -> torch.Tensor:
    """:func:`indexer_scores` for arguments known to be valid: ``ranges`` (the metadata's, made
    by the visibility rule) and tensors the caller made in the documented shapes and dtypes.
    Nothing is checked, so a model step reads nothing back for it."""
    backend = resolve_backend(backend, queries, keys, weights, ranges.ks, ranges.ke,
                              kernel_refusal=kernel_refusal(*queries.shape[2:]))
    return _scores(backend, queries, keys, weights, None, ranges)
