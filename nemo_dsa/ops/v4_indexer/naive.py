"""V4 indexer references in plain torch: fp32 logits and the gradients through gathered top-k scores.

docs/semantics.md "Index scoring" (V4): logit(i, j) = sum_h w[i, h] * relu(q[i, h] . k[j]) with bf16 inputs upcast
to fp32 and fp32 products and sums; -inf outside the query's visible range [ks, ke). The backward
("Top-k selection") sends gradient only through the logits gathered at the top-k indices.

Layout is BSHD: q [B, S, H, D], k [B, K, D], w [B, S, H], ks/ke int32 [B, S]. Both references
loop over query chunks sized from a byte budget, so [S, H, K] is never materialised; float64
inputs compute in float64 (used by the gradient checks), everything narrower in fp32.

:func:`v4_logits` and :func:`v4_backward` validate their arguments; the ``*_in_ranges`` forms take
the ranges as :class:`~nemo_dsa.visibility.KeyRanges` and check nothing (their callers' inputs
were validated where they entered, or were made by the callers).
"""

from __future__ import annotations

import torch

from nemo_dsa._checks import check_index_range, check_qkw, check_tensor
from nemo_dsa.ops.chunking import DEFAULT_BUDGET_BYTES, query_chunk_size, query_chunks
from nemo_dsa.precision import ieee_fp32_matmul
from nemo_dsa.visibility import KeyRanges, check_ks_ke, visible_mask

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_inputs(q, k, w, ks, ke) -> KeyRanges:
    batch, queries, _, _, num_keys = check_qkw(q, k, w, dtypes=(FLOAT_DTYPES,) * 3)
    return check_ks_ke(ks, ke, batch=batch, queries=queries, num_keys=num_keys, device=q.device)


def v4_logits_chunk_size(queries: int, heads: int, num_keys: int, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> int:
    """Queries per chunk of :func:`v4_logits`: the fp32 [chunk, H, K] products must fit the budget."""
    return query_chunk_size(queries, heads * num_keys * 4, budget_bytes)


def v4_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """V4 logits ``[B, S, K]`` (fp32; float64 for float64 inputs), -inf outside ``[ks, ke)``."""
    return v4_logits_in_ranges(q, k, w, _check_inputs(q, k, w, ks, ke), budget_bytes=budget_bytes)


def v4_logits_in_ranges(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ranges: KeyRanges, *, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> torch.Tensor:
    """:func:`v4_logits` on ranges known to hold (nothing is checked)."""
    batch, queries, heads, _ = q.shape
    num_keys, ks, ke = k.shape[1], ranges.ks, ranges.ke
    dtype = _compute_dtype(q, k, w)
    logits = torch.full((batch, queries, num_keys), float("-inf"), dtype=dtype, device=q.device)
    chunk = v4_logits_chunk_size(queries, heads, num_keys, budget_bytes)
    with ieee_fp32_matmul():
        for b in range(batch):
            keys = k[b].to(dtype)
            for part in query_chunks(queries, chunk):
                start, end = ks[b, part], ke[b, part]
                if not bool((end > start).any()):
                    continue
                # Only the key columns some query of the chunk can see: [lo, hi).
                lo, hi = int(start.min()), int(end.max())
                products = torch.matmul(q[b, part].to(dtype), keys[lo:hi].T)  # [c, H, hi-lo]
                # In place, so only one [c, H, K] buffer lives.
                chunk_logits = products.relu_().mul_(w[b, part].to(dtype).unsqueeze(-1)).sum(1)
                visible = visible_mask(start, end, hi - lo, first_key=lo)
                logits[b, part, lo:hi] = torch.where(visible, chunk_logits, float("-inf"))
                del products  # free before the next chunk's matmul, or two [c, H, K] buffers coexist
    return logits


def v4_backward_chunk_size(
    queries: int, heads: int, topk: int, dim: int, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> int:
    """Queries per chunk of :func:`v4_backward`: gathered keys [c, T, D] twice plus [c, H, T] thrice."""
    return query_chunk_size(queries, (2 * topk * dim + 3 * heads * topk) * 8, budget_bytes)


def v4_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    topk_indices: torch.Tensor,
    grad_scores: torch.Tensor,
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dw) of ``sum(grad_scores * logits.gather(-1, topk_indices))``.

    An index of -1, or one outside the query's visible range (its gathered score is the constant
    -inf), carries no gradient. With s = q_h . k_j and g the incoming gradient:
    dw_h = sum_t g_t relu(s_ht); dq_h = sum_t g_t w_h [s_ht > 0] k_jt; dk_j += the same terms with
    q_h in place of k_jt. Accumulates in fp32 (float64 for float64 inputs); returns dq in q's
    dtype, dk in k's dtype, dw in w's dtype.
    """
    ranges = _check_inputs(q, k, w, ks, ke)
    batch, queries = q.shape[:2]
    check_tensor("topk_indices", topk_indices, ndim=3, dtypes=(torch.int32, torch.int64), device=q.device)
    count = topk_indices.shape[-1]
    check_tensor("topk_indices", topk_indices, shape=(batch, queries, count))
    check_tensor("grad_scores", grad_scores, dtypes=FLOAT_DTYPES, shape=(batch, queries, count), device=q.device)
    check_index_range("topk_indices", topk_indices, ranges.num_keys)
    return v4_backward_in_ranges(q, k, w, ranges, topk_indices, grad_scores, budget_bytes=budget_bytes)


def v4_backward_in_ranges(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ranges: KeyRanges,
    topk_indices: torch.Tensor,
    grad_scores: torch.Tensor,
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`v4_backward` on ranges known to hold and indices in [-1, K) (nothing is checked:
    the autograd backward's indices were checked or selected in its forward)."""
    batch, queries, heads, dim = q.shape
    ks, ke, count = ranges.ks, ranges.ke, topk_indices.shape[-1]
    dtype = _compute_dtype(q, k, w)
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=q.device)
    dw = torch.zeros(w.shape, dtype=dtype, device=q.device)
    chunk = v4_backward_chunk_size(queries, heads, count, dim, budget_bytes)
    with ieee_fp32_matmul():
        for b in range(batch):
            keys = k[b].to(dtype)
            for part in query_chunks(queries, chunk):
                index = topk_indices[b, part].long()
                live = (index >= ks[b, part, None]) & (index < ke[b, part, None])  # also excludes -1
                safe = torch.where(live, index, 0)
                # Select, never multiply by a zero gradient: a dead slot reads key 0 (which may be
                # NaN/inf), and 0 * NaN would reach this query's dq/dw and key 0's dk. Dead slots
                # get a zero key, zero dots and a zero coefficient, so they add exact zeros.
                grad = torch.where(live, grad_scores[b, part].to(dtype), 0.0)
                gathered = torch.where(live.unsqueeze(-1), keys[safe], 0.0)  # [c, T, D]
                queries_c, weights_c = q[b, part].to(dtype), w[b, part].to(dtype)
                slot_live = live.unsqueeze(1)  # [c, 1, T]
                dots = torch.where(slot_live, torch.matmul(queries_c, gathered.transpose(1, 2)), 0.0)  # [c, H, T]
                dw[b, part] = (grad.unsqueeze(1) * dots.relu()).sum(-1)
                coeff = torch.where(slot_live & (dots > 0), grad.unsqueeze(1) * weights_c.unsqueeze(-1), 0.0)
                dq[b, part] = torch.matmul(coeff, gathered)
                # A non-finite query selects nothing, yet coeff^T q would still be 0 * NaN at key 0.
                per_slot = torch.where(live.unsqueeze(-1), torch.matmul(coeff.transpose(1, 2), queries_c), 0.0)
                # index_put_(accumulate=True) rather than index_add_, which is ~100x slower on CPU here.
                dk[b].index_put_((safe.reshape(-1),), per_slot.reshape(-1, dim), accumulate=True)
                del gathered, dots, coeff, per_slot  # free before the next chunk allocates its own
    return dq.to(q.dtype), dk.to(k.dtype), dw.to(w.dtype)
