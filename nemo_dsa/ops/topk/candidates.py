"""V4.1 candidate blocks: the blocks of compressed keys a candidate-source layer keeps for later layers.

docs/semantics.md "Top-k selection" (candidate blocks). Block numbers count from each query's ``ks`` (they move with the
document start); the block scores are reduced with the exact row selection of
:mod:`nemo_dsa.ops.topk.rows`, so ties go to the smaller block.
"""

from __future__ import annotations

import torch

from nemo_dsa._checks import check_positive_int, check_tensor
from nemo_dsa.ops.chunking import DEFAULT_BUDGET_BYTES, query_chunk_size, query_chunks
from nemo_dsa.ops.topk.rows import SCORE_DTYPES, select_rows_exact
from nemo_dsa.visibility import check_ks_ke, visible_mask


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

    docs/semantics.md, candidate blocks. For query i, block n covers the compressed positions
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
            visible = visible_mask(ks[b, part], ke[b, part], num_keys)
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
                best = select_rows_exact(others, count - 1, "score")
                kept.scatter_(-1, torch.where(best >= 0, best, num_blocks), True)
            kept = kept[:, :num_blocks]
            out[b, part] = select_rows_exact(torch.where(kept, 0.0, float("-inf")), count, "index").int()
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
            start = ks[b, part].long().unsqueeze(-1)
            visible = visible_mask(ks[b, part], ke[b, part], num_keys)
            relative_block = torch.where(visible, (keys - start) // block_size, num_blocks)
            # Slot num_blocks absorbs the -1 padding and the invisible keys; it is never kept.
            kept = torch.zeros((relative_block.shape[0], num_blocks + 1), dtype=torch.bool, device=blocks.device)
            kept.scatter_(-1, torch.where(blocks[b, part] >= 0, blocks[b, part].long(), num_blocks), True)
            kept[:, num_blocks] = False
            mask[b, part] = torch.gather(kept, -1, relative_block)
    return mask
