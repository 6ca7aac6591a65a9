"""Top-k selection reference: exact, deterministic, the documented tie rule, plain torch.

docs/semantics.md "Top-k selection": keep the best T = min(topk, K) *finite* scores of each row, ties to
the smaller key index, -1 padding. Rows are selected by :mod:`nemo_dsa.ops.topk.rows` (T +
TIE_MARGIN candidates ordered by unique keys, undecided rows redone with a key per score); this
module only validates, chunks and reassembles. The TileLang radix select (``kernels``) must give
the same indices bit for bit; :func:`nemo_dsa.ops.topk.select_topk` chooses between the two.
:func:`candidate_blocks_reference` is the readable form of the V4.1 candidate blocks
(``nemo_dsa.ops.v41_indexer.candidates`` holds the fast path).
"""

from __future__ import annotations

import math

import torch

from nemo_dsa._checks import check_positive_int, check_tensor
from nemo_dsa.ops.chunking import DEFAULT_BUDGET_BYTES, query_chunk_size, query_chunks
from nemo_dsa.ops.topk.rows import ORDERS, SCORE_DTYPES, redo_rows, select_rows, select_rows_exact
from nemo_dsa.visibility import check_ks_ke, visible_mask


def select_topk_reference(
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
        # torch.topk reads the scores in place; its per-row scratch and the candidates are small,
        # so chunks only bound the launch size. Flagged rows are redone once at the end, so the
        # loop never waits for the GPU.
        chunk = query_chunk_size(rows.shape[0], 4 * num_keys, budget_bytes)
        redo = torch.zeros(rows.shape[0], dtype=torch.bool, device=scores.device)
        for part in query_chunks(rows.shape[0], chunk):
            out[part], redo[part] = select_rows(rows[part], count, order)
        redo_rows(rows, out, redo, count, order, budget_bytes)
    return out.reshape(*scores.shape[:-1], count)


def check_candidate_arguments(scores, ks, ke, block_size: int, topk_blocks: int) -> tuple[int, int, int, int, int]:
    """Validate candidate-block arguments; returns (B, S, K, NB = ceil(K / C), kept count)."""
    check_tensor("scores", scores, ndim=3, dtypes=SCORE_DTYPES)
    batch, queries, num_keys = scores.shape
    check_ks_ke(ks, ke, batch=batch, queries=queries, num_keys=num_keys, device=scores.device)
    check_positive_int("block_size", block_size)
    check_positive_int("topk_blocks", topk_blocks)
    num_blocks = -(-num_keys // block_size)
    return batch, queries, num_keys, num_blocks, min(topk_blocks, num_blocks)


def candidate_blocks_reference(
    scores: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    block_size: int,
    topk_blocks: int,
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """Candidate blocks (docs/semantics.md, candidate blocks), the readable way: block maxima by
    a scatter-reduce over every key, then two exact row selections. Same contract and output as
    :func:`nemo_dsa.ops.v41_indexer.candidate_blocks`, the fast path it is tested against."""
    batch, queries, num_keys, num_blocks, count = check_candidate_arguments(scores, ks, ke, block_size, topk_blocks)
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
