"""Top-k selection reference: exact, deterministic, the documented tie rule, plain torch.

docs/semantics.md "Top-k selection": keep the best T = min(topk, K) *finite* scores of each row, ties to
the smaller key index, -1 padding. Rows are selected by :mod:`nemo_dsa.ops.topk.rows` (T +
TIE_MARGIN candidates ordered by unique keys, undecided rows redone with a key per score); this
module only validates, chunks and reassembles. The TileLang radix select (``kernels``) must give
the same indices bit for bit; :func:`nemo_dsa.ops.topk.select_topk` chooses between the two.
"""

from __future__ import annotations

import math

import torch

from nemo_dsa._checks import check_positive_int, check_tensor
from nemo_dsa.ops.chunking import DEFAULT_BUDGET_BYTES, query_chunk_size, query_chunks
from nemo_dsa.ops.topk.rows import ORDERS, SCORE_DTYPES, redo_rows, select_rows


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
