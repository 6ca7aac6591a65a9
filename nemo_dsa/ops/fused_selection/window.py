"""Exact selection on a window of keys, and the chunk loop that scores and selects each window.

On the GPU the TileLang select (``topk.kernels.select_rows_tilelang``: for bf16 the vector select,
else the radix select) decides every row exactly, reading only the row's
[ks, ke); elsewhere ``topk.rows.select_rows`` takes T +
TIE_MARGIN candidates per query with torch.topk and orders them by unique keys (score, then index
j inside the window, whose first key is a constant offset, so local order equals global order),
and rows the candidates cannot decide are redone after the loop, with a single host sync for the
whole call.
"""

from __future__ import annotations

import torch

from nemo_dsa.ops.topk.kernels import select_rows_tilelang
from nemo_dsa.ops.topk.rows import redo_rows, select_rows

# ----------------------------------------------------------------------------------------------
# Exact selection on a window of keys
# ----------------------------------------------------------------------------------------------


def select_window(
    scores: torch.Tensor, key_start: int, count: int, order: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``count`` of ``scores [N, W]`` (fp32 or bf16) whose column 0 is key ``key_start``.

    Returns (global indices int32 [N, count], gathered scores [N, count] in the scores' dtype),
    -1 / -inf where a row has fewer than ``count`` finite scores. ``order="score"``: descending
    score, ties to the smaller index; ``order="index"``: the same set in ascending index order.
    Equal to ``select_topk_reference`` on the full row (the window must hold every finite score).
    """
    chosen, redo = _select(scores, count, order)
    redo_rows(scores, chosen, redo, chosen.shape[-1], order)
    return _globalise(scores, chosen, key_start, count)


def _select(scores: torch.Tensor, count: int, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_rows`` on a window (at most ``width`` picks), without a host sync."""
    take = min(count, scores.shape[-1])
    if take == 0 or scores.shape[0] == 0:
        empty = torch.empty((scores.shape[0], 0), dtype=torch.int64, device=scores.device)
        return empty, torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)
    return select_rows(scores, take, order)


def _globalise(scores, chosen, key_start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window-local picks -> (global int32 indices, gathered scores), padded to ``count`` columns."""
    rows, take = chosen.shape
    index = torch.full((rows, count), -1, dtype=torch.int32, device=scores.device)
    values = torch.full((rows, count), float("-inf"), dtype=scores.dtype, device=scores.device)
    found = chosen >= 0
    index[:, :take] = torch.where(found, chosen + key_start, -1)
    values[:, :take] = torch.where(found, torch.gather(scores, -1, chosen.clamp_min(0)), float("-inf"))
    return index, values


def select_chunks(
    chunks, score_chunk, emit, count: int, order: str, chunk_bytes: int, on_gpu: bool, targets=None,
    *, block_size: int = 0, blocks_in_source_form: bool = False, capacity: int | None = None,
) -> None:
    """Score and select every chunk, ``emit(chunk, index, values)`` its global results.

    ``targets(chunk)``, where given (one sequence: a chunk's rows of the outputs are contiguous),
    returns [rows, count] (index, values) tensors the TileLang select writes into directly,
    saving the copy through ``emit``.

    ``score_chunk(chunk, first_pass)`` returns the chunk's scores [B, rows, W], its queries'
    window-local ks/ke [B, rows] and, on the GPU only, None or kept candidate blocks [B, rows, NBk]
    of ``block_size`` keys that the select applies itself (keys outside them count as -inf;
    ``blocks_in_source_form``: as a candidate-source call returned them, see ``select_rows_tilelang``).
    ``capacity``: the caller's top-k, which sizes the TileLang select's build (a window narrower
    than ``count`` reuses it; ``select_rows_tilelang``). On the GPU (``on_gpu``) the TileLang select decides
    every row exactly, reading only [ks, ke). Otherwise the loop runs select_rows and never waits
    for the device: rows it flags (ties beyond its candidates, NaN/+inf) are collected, and after
    the loop (one host sync) only the chunks holding any are scored again (same tiles, so the
    same scores) and those rows redone with full-row keys.
    """
    pending = []
    for chunk in chunks:
        if chunk.width == 0:
            emit(chunk, None, None)
            continue
        scores, local_ks, local_ke, blocks = score_chunk(chunk, True)
        scores = scores.reshape(-1, chunk.width)
        if on_gpu:
            take = min(count, chunk.width)
            out = targets(chunk) if targets is not None and take == count else None
            masking = {} if blocks is None else {
                "blocks": blocks.reshape(scores.shape[0], -1), "block_size": block_size,
                "blocks_in_source_form": blocks_in_source_form,
            }  # fmt: skip
            index, values = select_rows_tilelang(
                scores, take, order, local_ks.reshape(-1), local_ke.reshape(-1), offset=chunk.key_start, out=out,
                capacity=capacity, **masking,
            )  # fmt: skip
            if out is None:
                emit(chunk, *_pad_columns(index, values, count))
            continue
        chosen, redo = _select(scores, count, order)
        emit(chunk, *_globalise(scores, chosen, chunk.key_start, count))
        pending.append((chunk, redo))
        del scores, chosen
    if not pending:
        return
    flagged = torch.stack([redo.any() for _, redo in pending]).tolist()
    for (chunk, redo), again in zip(pending, flagged):
        if again:
            scores = score_chunk(chunk, False)[0].reshape(-1, chunk.width)
            chosen, _ = _select(scores, count, order)
            redo_rows(scores, chosen, redo, chosen.shape[-1], order, chunk_bytes // 4)
            emit(chunk, *_globalise(scores, chosen, chunk.key_start, count))


def _pad_columns(index: torch.Tensor, values: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Widen [N, take] results of a window narrower than ``count`` keys with -1 / -inf columns."""
    if index.shape[-1] == count:
        return index, values
    wide_index = torch.full((index.shape[0], count), -1, dtype=index.dtype, device=index.device)
    wide_values = torch.full((index.shape[0], count), float("-inf"), dtype=values.dtype, device=values.device)
    wide_index[:, : index.shape[-1]] = index
    wide_values[:, : index.shape[-1]] = values
    return wide_index, wide_values
