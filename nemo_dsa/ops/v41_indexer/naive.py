"""V4.1 indexer reference in plain torch: scores with the released BF16 rounding boundaries.

docs/semantics.md "Index scoring" (V4.1): the score is exactly
``einsum('bshd,btd->bsht', q, k).relu().mul(w[..., None]).sum(2)`` evaluated on bf16 tensors
(one bf16 rounding after the fp32-accumulated dot product, one after the weight multiply, an fp32
head sum rounded once), -inf where the key is invisible. The loop runs over query chunks only:
every key column and the head reduction see the same shapes as the unchunked formula, so the
result is bitwise the formula while [S, H, K] is never materialised.
"""

from __future__ import annotations

import torch

from nemo_dsa._checks import check_qkw
from nemo_dsa.ops.chunking import DEFAULT_BUDGET_BYTES, query_chunk_size, query_chunks
from nemo_dsa.visibility import KeyRanges, check_ks_ke, visible_mask


def v41_scores_chunk_size(
    batch: int, queries: int, heads: int, num_keys: int, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> int:
    """Queries per chunk of :func:`v41_scores`: the bf16 [B, chunk, H, K] products (and their
    relu / weighted copies, 3 live at once) must fit the budget."""
    return query_chunk_size(queries, 3 * batch * heads * num_keys * 2, budget_bytes)


def _formula(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("bshd,btd->bsht", q, k).relu().mul(w[..., None]).sum(2)


@torch.no_grad()
def v41_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """V4.1 scores bf16 ``[B, S, K]`` from q [B,S,H,D], k [B,K,D], w [B,S,H] (all bf16), -inf outside [ks, ke)."""
    batch, queries, heads, _, num_keys = check_qkw(q, k, w, dtypes=((torch.bfloat16,),) * 3)
    ranges = check_ks_ke(ks, ke, batch=batch, queries=queries, num_keys=num_keys, device=q.device)
    return v41_scores_in_ranges(q, k, w, ranges, budget_bytes=budget_bytes)


@torch.no_grad()
def v41_scores_in_ranges(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, ranges: KeyRanges, *, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> torch.Tensor:
    """:func:`v41_scores` on ranges known to hold (nothing is checked)."""
    batch, queries, heads, _ = q.shape
    num_keys, ks, ke = k.shape[1], ranges.ks, ranges.ke
    scores = torch.full((batch, queries, num_keys), float("-inf"), dtype=torch.bfloat16, device=q.device)
    chunk = v41_scores_chunk_size(batch, queries, heads, num_keys, budget_bytes)
    for part in query_chunks(queries, chunk):
        visible = visible_mask(ks[:, part], ke[:, part], num_keys)
        scores[:, part] = _formula(q[:, part], k, w[:, part]).masked_fill(~visible, float("-inf"))
    return scores
