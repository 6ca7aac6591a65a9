"""Exact, deterministic top-k selection with the spec's tie rule, and V4.1 candidate blocks.

DSA-SPEC "Top-k selection": keep the best T = min(topk, K) *finite* scores, ties going to the
smaller key index, -1 padding when a query has fewer than T finite scores. torch.topk leaves ties
unspecified: rows where that matters (the T-th best score shared beyond the free slots, or NaN/+inf
present) are redone with a unique int64 key per score

    key = (order-preserving int32 image of the fp32 score) << 32  |  (2^32 - 1 - index)

whose descending order is "score descending, then index ascending". torch.topk over unique keys
is exact and deterministic on every device. The work is chunked over queries so that the int64
keys never exceed the byte budget.
"""

from __future__ import annotations

import math

import torch

from nemo_dsa._checks import check_positive_int, check_tensor
from nemo_dsa.ops._chunking import DEFAULT_BUDGET_BYTES, query_chunk_size, query_chunks
from nemo_dsa.ops._visibility import check_ks_ke

SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ORDERS = ("score", "index")
_INT32_MIN = -(2**31)


def orderable_int32(scores: torch.Tensor) -> torch.Tensor:
    """Map float scores to int32 so that integer order equals float order (as int64 tensor).

    IEEE floats order like sign-magnitude integers: non-negative floats already compare correctly
    as int32 bit patterns; for negative ones the magnitude bits are flipped to reverse their
    order. -0.0 is first folded into +0.0 (x + 0.0) so the two zeros tie as the spec's scores do.
    Non-finite scores get the smallest key so that they are never preferred over finite ones.
    """
    values = scores.float() + 0.0  # exact upcast; -0.0 + 0.0 == +0.0
    bits = values.view(torch.int32)
    image = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return torch.where(torch.isfinite(values), image, torch.full_like(image, _INT32_MIN))


def _select_rows(scores: torch.Tensor, count: int, order: str) -> torch.Tensor:
    """select_topk on a [N, K] block of rows: torch.topk on the scores, exact keys where needed.

    torch.topk on the raw scores picks the right *set* whenever the T-th best value is not
    shared by more keys than the slots left for it, and whenever no NaN/+inf is in the row (they
    sort above every number and are not selectable). Both conditions are checked on the [N, T]
    result plus one compare pass; only rows that fail them take the int64-key path. On real
    scores that is almost never, and the plain topk avoids building 8-byte keys for all S*K
    scores (the dominant cost of selection at S=32K).
    """
    num_keys = scores.shape[-1]
    values, chosen = torch.topk(scores, count, dim=-1, largest=True, sorted=True)
    threshold = values[:, -1:]
    finite_threshold = torch.isfinite(threshold).squeeze(-1)
    unselectable = (torch.isnan(values) | (values == float("inf"))).any(-1)
    slots_left = count - (values > threshold).sum(-1)
    tied = (scores == threshold).sum(-1)
    redo = unselectable | (finite_threshold & (tied != slots_left))
    present = values > float("-inf")
    chosen = torch.where(present, chosen, num_keys)  # -inf picks become padding, sorted last
    # Order: ascending index first, then a stable sort by descending score keeps index order
    # inside equal scores (the spec's tie rule), padding last in both orders.
    chosen = chosen.sort(dim=-1).values
    if order == "score":
        picked = torch.gather(scores, -1, chosen.clamp_max(num_keys - 1))
        picked = torch.where(chosen < num_keys, picked, float("-inf"))
        chosen = torch.gather(chosen, -1, picked.sort(dim=-1, descending=True, stable=True).indices)
    chosen = torch.where(chosen == num_keys, -1, chosen)
    if bool(redo.any()):
        chosen[redo] = _select_rows_by_keys(scores[redo], count, order)
    return chosen.to(torch.int32)


def _select_rows_by_keys(scores: torch.Tensor, count: int, order: str) -> torch.Tensor:
    """Exact selection through unique int64 keys (score image, then reversed index)."""
    num_keys = scores.shape[-1]
    index = torch.arange(num_keys, device=scores.device, dtype=torch.int64)
    keys = (orderable_int32(scores) << 32) | ((2**32 - 1) - index)
    chosen = torch.topk(keys, count, dim=-1, largest=True, sorted=True).indices
    finite = torch.isfinite(torch.gather(scores, -1, chosen))
    chosen = torch.where(finite, chosen, -1)  # non-finite keys sort last, so -1s trail
    if order == "index":
        # Ascending index among the selected; -1 (mapped to num_keys) stays at the end.
        chosen = torch.where(finite, chosen, num_keys).sort(dim=-1).values
        chosen = torch.where(chosen == num_keys, -1, chosen)
    return chosen


def select_topk(
    scores: torch.Tensor, topk: int, order: str = "score", *, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> torch.Tensor:
    """Top-k key indices of ``scores [..., S, K]`` as int32 ``[..., S, min(topk, K)]``.

    Only finite scores are selectable; ties go to the smaller key index; rows with fewer than T
    finite scores are padded with -1 at the end. ``order="score"``: descending score (ties by
    ascending index); ``order="index"``: the selected set in ascending index order.
    """
    check_tensor("scores", scores, dtypes=SCORE_DTYPES)
    if scores.ndim < 1:
        raise ValueError("scores must have at least 1 dimension (the key axis)")
    check_positive_int("topk", topk)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    num_keys = scores.shape[-1]
    count = min(topk, num_keys)
    rows = scores.reshape(math.prod(scores.shape[:-1]), num_keys)
    out = torch.full((rows.shape[0], count), -1, dtype=torch.int32, device=scores.device)
    if count and rows.shape[0]:
        # Per row: int64 keys + int64 arange broadcast + the topk scratch, ~ 3 int64 per key.
        chunk = query_chunk_size(rows.shape[0], 24 * num_keys, budget_bytes)
        for part in query_chunks(rows.shape[0], chunk):
            out[part] = _select_rows(rows[part], count, order)
    return out.reshape(*scores.shape[:-1], count)


def candidate_blocks(
    scores: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    block_size: int,
    topk_blocks: int,
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """V4.1 candidate blocks, compact form: kept block numbers, int32 ``[B, S, min(topk_blocks, NB)]``.

    DSA-SPEC "V4.1 candidate blocks". For query i, block n covers the compressed positions
    ``[ks_i + n*C, ks_i + (n+1)*C)`` clipped to its visible range ``[ks_i, ke_i)`` (blocks are
    counted from the document's first group, so they move with ks). A block's score is the max of
    its finite visible scores. The block holding the last visible group ``ke_i - 1`` is always
    kept and counts toward the budget (as in the released hierarchical selection); the remaining
    ``topk_blocks - 1`` slots go to the best other blocks with a finite score, ties to the smaller
    block. Output is in ascending block order, -1 padded; NB = ceil(K / C) is the most blocks any
    query can have. Scores outside ``[ks, ke)`` are ignored.
    """
    check_tensor("scores", scores, ndim=3, dtypes=SCORE_DTYPES)
    batch, queries, num_keys = scores.shape
    check_ks_ke(ks, ke, batch=batch, queries=queries, num_keys=num_keys, device=scores.device)
    check_positive_int("block_size", block_size)
    check_positive_int("topk_blocks", topk_blocks)
    num_blocks = -(-num_keys // block_size)
    count = min(topk_blocks, num_blocks)
    out = torch.full((batch, queries, count), -1, dtype=torch.int32, device=scores.device)
    if count == 0 or queries == 0:
        return out
    chunk = query_chunk_size(queries, 24 * num_keys + 40 * num_blocks, budget_bytes)
    keys = torch.arange(num_keys, device=scores.device)
    for b in range(batch):
        for part in query_chunks(queries, chunk):
            start, end = ks[b, part].long().unsqueeze(-1), ke[b, part].long().unsqueeze(-1)
            visible = (keys >= start) & (keys < end)
            # Invisible keys go to a dump block (index num_blocks) that is dropped afterwards.
            block = torch.where(visible, (keys - start) // block_size, num_blocks)
            values = torch.where(visible, scores[b, part].float(), float("-inf"))
            values = torch.where(torch.isfinite(values), values, float("-inf"))
            block_scores = torch.full((values.shape[0], num_blocks + 1), float("-inf"), device=scores.device)
            block_scores = block_scores.scatter_reduce(-1, block, values, reduce="amax")[:, :num_blocks]
            sees_any = end > start
            last = torch.where(sees_any, (end - 1 - start) // block_size, 0)
            # Column num_blocks is a dump slot for the -1s of `best`, so they cannot clear a real block.
            kept = torch.zeros((values.shape[0], num_blocks + 1), dtype=torch.bool, device=scores.device)
            kept.scatter_(-1, last, sees_any)
            if count > 1:
                others = block_scores.scatter(-1, last, float("-inf"))
                best = _select_rows(others, count - 1, "score").long()
                kept.scatter_(-1, torch.where(best >= 0, best, num_blocks), True)
            kept = kept[:, :num_blocks]
            out[b, part] = _select_rows(torch.where(kept, 0.0, float("-inf")), count, "index")
    return out


def candidate_block_mask(
    scores: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    block_size: int,
    topk_blocks: int,
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """Dense form of :func:`candidate_blocks`: bool ``[B, S, K]``, True on visible keys of kept blocks.

    A reindex layer masks its scores with ``scores.masked_fill(~mask, -inf)`` before top-k.
    """
    blocks = candidate_blocks(scores, ks, ke, block_size, topk_blocks, budget_bytes=budget_bytes)
    return blocks_to_mask(blocks, ks, ke, block_size, scores.shape[-1], budget_bytes=budget_bytes)


def blocks_to_mask(
    blocks: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    block_size: int,
    num_keys: int,
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """Expand kept block numbers ``[B, S, NBk]`` (relative to ks, -1 padded) to bool ``[B, S, K]``."""
    batch, queries = blocks.shape[:2]
    num_blocks = -(-num_keys // block_size)
    keys = torch.arange(num_keys, device=blocks.device)
    mask = torch.zeros((batch, queries, num_keys), dtype=torch.bool, device=blocks.device)
    chunk = query_chunk_size(queries, 24 * num_keys + num_blocks, budget_bytes)
    for b in range(batch):
        for part in query_chunks(queries, chunk):
            start, end = ks[b, part].long().unsqueeze(-1), ke[b, part].long().unsqueeze(-1)
            visible = (keys >= start) & (keys < end)
            relative_block = torch.where(visible, (keys - start) // block_size, num_blocks)
            # Slot num_blocks absorbs the -1 padding and the invisible keys; it is never kept.
            kept = torch.zeros((relative_block.shape[0], num_blocks + 1), dtype=torch.bool, device=blocks.device)
            kept.scatter_(-1, torch.where(blocks[b, part] >= 0, blocks[b, part].long(), num_blocks), True)
            kept[:, num_blocks] = False
            mask[b, part] = torch.gather(kept, -1, relative_block)
    return mask
