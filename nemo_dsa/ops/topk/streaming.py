"""Streaming top-k selection: the indexer's [B, S, K] score matrix is never held at once.

At S = 131072, R = 4 the full V4 logit matrix is 16 GiB of fp32 per indexer layer. Here queries
are processed in chunks of Sc rows; each chunk is scored with the ordinary scoring path (TileLang
kernels on CUDA, the torch references otherwise) on the *key window* its queries can see, then
selected exactly with the spec's rule (DSA-SPEC "Top-k selection": best finite scores, ties to the
smaller key index, -1 padding). Only [B, Sc, W] transients live at a time (W <= K the window
width), with Sc chosen so that they fit ``chunk_bytes``. Selection is independent of the
chunking (every query's selection is a function of its own row only), so the result equals
select_topk on the full matrix whenever the scorer's per-element arithmetic does not depend on the
chunk: true of the TileLang kernels (chunks start on their tile boundaries); CPU BLAS picks kernels
by matrix shape, so the torch references agree only to the last ulp on continuous inputs (exactly on
exactly representable ones, as in the tests).

Selection inside a window: on the GPU the TileLang radix select (``kernels.select_rows_tilelang``)
decides every row exactly, reading only the row's [ks, ke); elsewhere ``naive.select_rows`` takes
T + TIE_MARGIN candidates per query with torch.topk and orders them by unique keys (score, then
index j inside the window, whose first key is a constant offset, so local order equals global
order), and rows the candidates cannot decide are redone after the loop, with a single host sync
for the whole call. The chunk plan needs ks/ke on the host: it is remembered per (ks, ke) pair
(``ops._memo``), so the layers of a step that share their metadata sync once, not each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nemo_dsa._checks import check_positive_int, check_tensor
from nemo_dsa.ops._dispatch import resolve_backend
from nemo_dsa.ops._memo import memo_on_tensors
from nemo_dsa.ops._visibility import check_ks_ke
from nemo_dsa.ops.topk.kernels import MAX_COUNT, select_rows_tilelang  # TileLang itself is imported lazily
from nemo_dsa.ops.topk.naive import TIE_MARGIN, redo_rows, select_rows

# Transient budget per chunk (issue #4): 512 MiB keeps Sc in the hundreds of rows at K = 32768.
DEFAULT_CHUNK_BYTES = 512 * 2**20
# Chunks start on multiples of these so that the scoring kernels' query tiles (block_q <= 256
# queries: 256 // H) and key tiles (64 or 128 keys) line up with those of an unchunked run.
# Measured on the H200: a query's fp32 head sum depends on its position inside the kernel's tile
# (in the last bit), so a chunk starting mid-tile would score some keys one ulp differently.
ROW_ALIGN = 256
KEY_ALIGN = 128
# Bytes per (query, window key) element at the peak of a chunk. With the TileLang selector: the
# scores alone (it reads them in place). With select_rows: the scores (torch.topk reads them in
# place; its scratch and the candidates are per row), plus the redo of flagged rows, run in
# groups of at most a quarter of the chunk at the key path's ~16 bytes per score.
V4_BYTES_PER_KEY = {"kernel": 4, "torch": 4 + 4}  # fp32 logits
V41_BYTES_PER_KEY = {"kernel": 2, "torch": 2 + 4}  # bf16 scores
# Candidate blocks (nemo_dsa.ops.topk.naive helpers): scores 2 + dense mask 1 + their 24 per key.
V41_CANDIDATE_BYTES_PER_KEY = 27
# Per selected slot: the kernel's indices and scores, and their padded copies; select_rows'
# candidates (TIE_MARGIN more per row) as values, int64 indices, keys and their sort, the
# gathered results and int32 copies.
SELECTED_BYTES = {"kernel": 16, "torch": 48}


# ----------------------------------------------------------------------------------------------
# Chunk planning
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueryChunk:
    """Queries [start, end) and the key window [key_start, key_end) that holds all they see."""

    start: int
    end: int
    key_start: int
    key_end: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.end)

    @property
    def width(self) -> int:
        return self.key_end - self.key_start


def plan_query_chunks(
    ks: torch.Tensor,
    ke: torch.Tensor,
    row_bytes: Callable[[torch.Tensor], torch.Tensor],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    row_align: int | None = None,
    key_align: int = KEY_ALIGN,
) -> list[QueryChunk]:
    """Split the queries of ``ks/ke [B, S]`` into consecutive chunks whose transients fit a budget.

    A chunk of n queries with key window width W costs ``n * B * row_bytes(W)`` bytes
    (``row_bytes`` maps an int64 array of widths to bytes per query row, non-decreasing). Each
    chunk is the longest run from its start that fits ``chunk_bytes``, rounded down to a multiple
    of ``row_align`` (default ``ROW_ALIGN``) and never shorter than that unless it is the last:
    one query tile of every kernel is the irreducible unit, so a tiny budget is exceeded rather
    than the tiles shifted. The window is the union of the chunk's visible ranges over the batch,
    its start rounded down to a multiple of ``key_align``; a chunk whose queries see nothing gets
    the empty window (0, 0). Copies two [S] vectors to the host once.
    """
    check_positive_int("chunk_bytes", chunk_bytes)
    row_align = ROW_ALIGN if row_align is None else check_positive_int("row_align", row_align)
    batch, queries = ks.shape
    if queries == 0:
        return []
    # Per-query union over the batch on the tensors' device, then one copy: the host loop below
    # runs on NumPy, since small torch CPU ops cost ~1 ms each on a many-core GPU host.
    none = int(np.iinfo(np.int64).max)
    seen = ke > ks
    first, last = torch.stack(
        (torch.where(seen, ks.long(), none).amin(0), torch.where(seen, ke.long(), 0).amax(0))
    ).cpu().numpy()
    # Rows a chunk can possibly hold: the per-row cost at width 0 bounds it.
    lookahead = max(row_align, chunk_bytes // max(1, batch * int(row_bytes(np.zeros(1, dtype=np.int64))[0])))
    chunks: list[QueryChunk] = []
    start = 0
    while start < queries:
        stop = min(queries, start + lookahead)
        lo = np.minimum.accumulate(first[start:stop])
        hi = np.maximum.accumulate(last[start:stop])
        sees_any = lo != none
        lo = np.where(sees_any, lo // key_align * key_align, 0)
        width = np.where(sees_any, hi - lo, 0)
        cost = np.arange(1, stop - start + 1, dtype=np.int64) * batch * row_bytes(width)
        # cost is non-decreasing in rows; a chunk that does not reach the end is whole tiles
        count = max(min(row_align, stop - start), int((cost <= chunk_bytes).sum()))
        if start + count < queries:
            count -= count % row_align
        chunks.append(QueryChunk(start, start + count, int(lo[count - 1]), int(hi[count - 1]) if sees_any[count - 1] else 0))
        start += count
    return chunks


def _selection_path(on_gpu: bool) -> str:
    return "kernel" if on_gpu else "torch"


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks of one call and every query's visible range relative to its chunk's window."""

    chunks: tuple[QueryChunk, ...]
    local_ks: torch.Tensor  # [B, S] int32; (0, 0) for queries that see nothing
    local_ke: torch.Tensor

    def ranges(self, chunk: QueryChunk) -> tuple[torch.Tensor, torch.Tensor]:
        return self.local_ks[:, chunk.rows], self.local_ke[:, chunk.rows]


def _planned_chunks(ks, ke, row_key: tuple, row_bytes, chunk_bytes: int) -> ChunkPlan:
    """:func:`plan_query_chunks` and the window-local ranges, remembered for this (ks, ke) pair
    while it is unchanged: the plan's device-to-host copy would otherwise drain the GPU queue in
    every indexer layer of a step. ``row_key`` names the ``row_bytes`` function (its arguments)."""

    def plan() -> ChunkPlan:
        chunks = tuple(plan_query_chunks(ks, ke, row_bytes, chunk_bytes))
        starts = np.repeat([c.key_start for c in chunks], [c.end - c.start for c in chunks]).astype(np.int32)
        offset = torch.from_numpy(starts).to(ks.device)
        seen = ke > ks
        return ChunkPlan(chunks, torch.where(seen, ks - offset, 0), torch.where(seen, ke - offset, 0))

    return memo_on_tensors((ks, ke), ("query_chunks", row_key, chunk_bytes), plan)


def _query_copy_bytes(heads: int, dim: int, batched: bool) -> int:
    """A chunk's queries q[:, rows] are a contiguous view for one sequence; with several the
    scorer copies them (bf16 [B, rows, H, D])."""
    return heads * dim * 2 if batched else 0


def v4_row_bytes(
    heads: int, dim: int, count: int, on_gpu: bool = False, batched: bool = True
) -> Callable[[np.ndarray], np.ndarray]:
    """Transient bytes per query row of :func:`v4_select_topk` for window widths ``width``
    (``on_gpu``: selected by the TileLang kernel, else by select_rows; ``batched``: B > 1)."""
    path = _selection_path(on_gpu)
    margin = 0 if on_gpu else TIE_MARGIN
    # The chunk's q (copied when B > 1) and w, and the [rows, T] top-k results and temporaries.
    per_row = _query_copy_bytes(heads, dim, batched) + heads * 4 + SELECTED_BYTES[path] * (count + margin) + 64
    return lambda width: width * V4_BYTES_PER_KEY[path] + per_row


def v41_row_bytes(
    heads: int,
    dim: int,
    count: int,
    candidates: bool = False,
    block_size: int = 1,
    on_gpu: bool = False,
    batched: bool = True,
) -> Callable[[np.ndarray], np.ndarray]:
    """Transient bytes per query row of :func:`v41_select_topk` for window widths ``width``."""
    path = _selection_path(on_gpu)
    margin = 0 if on_gpu else TIE_MARGIN
    per_row = _query_copy_bytes(heads, dim, batched) + heads * 2 + SELECTED_BYTES[path] * (count + margin) + 64
    per_key = V41_BYTES_PER_KEY[path]

    def row_bytes(width: np.ndarray) -> np.ndarray:
        if candidates:  # the candidate phase precedes selection; its peak is the larger
            blocks = -(-width // block_size)
            return np.maximum(per_key * width, V41_CANDIDATE_BYTES_PER_KEY * width + 40 * blocks) + per_row
        return per_key * width + per_row

    return row_bytes


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
    Equal to ``naive.select_topk`` on the full row (the window must hold every finite score).
    """
    chosen, redo = _select(scores, count, order)
    redo_rows(scores, chosen, redo, chosen.shape[-1], order)
    return _globalise(scores, chosen, key_start, count)


def _select(scores: torch.Tensor, count: int, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """naive.select_rows on a window (at most ``width`` picks), without a host sync."""
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


def _select_chunks(
    chunks, score_chunk, emit, count: int, order: str, chunk_bytes: int, on_gpu: bool, targets=None
) -> None:
    """Score and select every chunk, ``emit(chunk, index, values)`` its global results.

    ``targets(chunk)``, where given (one sequence: a chunk's rows of the outputs are contiguous),
    returns [rows, count] (index, values) tensors the TileLang select writes into directly,
    saving the copy through ``emit``.

    ``score_chunk(chunk, first_pass)`` returns the chunk's scores [B, rows, W] and its queries'
    window-local ks/ke [B, rows]. On the GPU (``on_gpu``) the TileLang radix select decides
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
        scores, local_ks, local_ke = score_chunk(chunk, True)
        scores = scores.reshape(-1, chunk.width)
        if on_gpu:
            take = min(count, chunk.width)
            out = targets(chunk) if targets is not None and take == count else None
            index, values = select_rows_tilelang(
                scores, take, order, local_ks.reshape(-1), local_ke.reshape(-1), offset=chunk.key_start, out=out
            )
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


# ----------------------------------------------------------------------------------------------
# Scoring one chunk (the only backend-specific code)
# ----------------------------------------------------------------------------------------------


def _v4_chunk_logits(backend, q, k, w, ks, ke, buffer, chunk_bytes):
    if backend == "tilelang":
        from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang

        return v4_logits_tilelang(q, k, w, ks, ke, out=buffer)
    from nemo_dsa.ops.v4_indexer.naive import v4_logits

    return v4_logits(q, k, w, ks, ke, budget_bytes=chunk_bytes)


def _v41_chunk_scores(backend, q, k, w, ks, ke, chunk_bytes):
    if backend == "tilelang":
        from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

        return v41_scores_tilelang(q, k, w, ks, ke)
    from nemo_dsa.ops.v41_indexer.naive import v41_scores

    return v41_scores(q, k, w, ks, ke, budget_bytes=chunk_bytes)


def _selects_on_gpu(backend: str, count: int) -> bool:
    """Whether chunks are selected by the TileLang radix select (it sorts at most MAX_COUNT)."""
    return backend == "tilelang" and count <= MAX_COUNT


def _window_buffer(chunks, batch, device):
    """One fp32 buffer for the kernels' chunk logits. Not poisoned: the kernel writes every
    element of its window (-inf outside [ks, ke)), which its own GPU tests check on poisoned
    outputs; a fill here would cost a pass over up to chunk_bytes per call."""
    largest = max((batch * (c.end - c.start) * c.width for c in chunks), default=0)
    return torch.empty((largest,), dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def _check_common(q, k, w, w_dtype, ks, ke, topk, chunk_bytes):
    check_tensor("q", q, ndim=4, dtypes=(torch.bfloat16,))
    batch, queries, heads, dim = q.shape
    check_tensor("k", k, ndim=3, dtypes=(torch.bfloat16,), shape=(batch, None, dim), device=q.device)
    check_tensor("w", w, ndim=3, dtypes=(w_dtype,), shape=(batch, queries, heads), device=q.device)
    check_ks_ke(ks, ke, batch=batch, queries=queries, num_keys=k.shape[1], device=q.device)
    check_positive_int("topk", topk)
    check_positive_int("chunk_bytes", chunk_bytes)
    return batch, queries, heads, dim, k.shape[1]


@torch.no_grad()
def v4_select_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    topk: int,
    *,
    backend: str = "auto",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V4 top-k without the [B, S, K] logit matrix: equal to ``select_topk(v4_logits(...))``.

    Args:
        q: [B, S, H, D] bf16 index queries (a CP-local slice is fine).
        k: [B, K, D] bf16 index keys on the global compressed axis.
        w: [B, S, H] fp32 head weights (scaling folded in).
        ks, ke: int32 [B, S] visible ranges on the global compressed axis.
        topk: keys per query; T = min(topk, K).
        backend: "auto" | "tilelang" | "torch": the TileLang scorer and radix select, or the
            torch reference scoring and selection.
        chunk_bytes: budget of the per-chunk selection transients (default 512 MiB).

    Returns:
        index_score fp32 [B, S, T] (the logits at the indices, -inf at -1) and topk_indices int32
        [B, S, T], by descending score with ties to the smaller index, -1 padding. No autograd
        graph: the backward needs only the indices (``v4_backward`` / the TileLang backward).
    """
    _check_common(q, k, w, torch.float32, ks, ke, topk, chunk_bytes)
    return v4_select_topk_validated(q, k, w, ks, ke, topk, resolve_backend(backend, q, k, w, ks, ke), chunk_bytes)


@torch.no_grad()
def v4_select_topk_validated(q, k, w, ks, ke, topk: int, backend: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """:func:`v4_select_topk` for callers that validated the arguments already (the seed API):
    it skips the ks/ke value checks and their host sync. ``backend`` is a resolved one."""
    batch, queries, heads, dim = q.shape
    count = min(topk, k.shape[1])
    # Poisoned: every chunk overwrites its rows, so a sentinel left over is a bug the tests see.
    indices = torch.full((batch, queries, count), -2, dtype=torch.int32, device=q.device)
    scores = torch.full((batch, queries, count), float("nan"), dtype=torch.float32, device=q.device)
    on_gpu = _selects_on_gpu(backend, count)
    row_key = ("v4", heads, dim, count, on_gpu, batch > 1)
    plan = _planned_chunks(ks, ke, row_key, v4_row_bytes(*row_key[1:]), chunk_bytes)
    chunks = plan.chunks
    buffer = _window_buffer(chunks, batch, q.device) if backend == "tilelang" else None

    def score_chunk(chunk, first_pass):
        rows = chunk.end - chunk.start
        local_ks, local_ke = plan.ranges(chunk)
        out = None if buffer is None else buffer[: batch * rows * chunk.width].view(batch, rows, chunk.width)
        logits = _v4_chunk_logits(
            backend, q[:, chunk.rows], k[:, chunk.key_start : chunk.key_end], w[:, chunk.rows],
            local_ks, local_ke, out, chunk_bytes,
        )
        return logits, local_ks, local_ke

    def emit(chunk, index, value):
        if index is None:
            indices[:, chunk.rows] = -1
            scores[:, chunk.rows] = float("-inf")
        else:
            indices[:, chunk.rows] = index.view(batch, -1, count)
            scores[:, chunk.rows] = value.view(batch, -1, count)

    targets = (lambda chunk: (indices[0, chunk.rows], scores[0, chunk.rows])) if batch == 1 else None
    _select_chunks(chunks, score_chunk, emit, count, "score", chunk_bytes, on_gpu, targets)
    return scores, indices


def _check_candidates(candidate_block_size, candidate_topk_blocks, candidate_blocks, batch, queries, num_keys, device):
    if candidate_topk_blocks is not None and candidate_blocks is not None:
        raise ValueError("give candidate_topk_blocks (candidate-source layer) or candidate_blocks (reindex layer), not both")
    if candidate_topk_blocks is None and candidate_blocks is None:
        return
    if candidate_block_size is None:
        raise ValueError("candidate_block_size is required with candidate_topk_blocks or candidate_blocks")
    check_positive_int("candidate_block_size", candidate_block_size)
    if candidate_topk_blocks is not None:
        check_positive_int("candidate_topk_blocks", candidate_topk_blocks)
        return
    check_tensor("candidate_blocks", candidate_blocks, ndim=3, dtypes=(torch.int32,), shape=(batch, queries, None), device=device)
    num_blocks = -(-num_keys // candidate_block_size)
    if candidate_blocks.numel() and bool(((candidate_blocks < -1) | (candidate_blocks >= num_blocks)).any()):
        raise ValueError(f"candidate_blocks must lie in [-1, {num_blocks}) (block numbers relative to ks, -1 = none)")


@torch.no_grad()
def v41_select_topk(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    topk: int,
    *,
    candidate_block_size: int | None = None,
    candidate_topk_blocks: int | None = None,
    candidate_blocks: torch.Tensor | None = None,
    backend: str = "auto",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """V4.1 top-k without the [B, S, K] score matrix: equal to ``select_topk(v41_scores(...), order="index")``.

    Args:
        q, k, w: [B, S, H, D], [B, K, D], [B, S, H], all bf16 (MXFP4/RoPE already applied to q, k).
        ks, ke: int32 [B, S] visible ranges on the global compressed axis.
        topk: keys per query; T = min(topk, K).
        candidate_block_size: C, compressed positions per candidate block (DSA-SPEC "V4.1
            candidate blocks"); needed with either of the next two.
        candidate_topk_blocks: candidate-source layer: also compute the kept blocks from this
            layer's scores (its own selection is not masked, as in the released model).
        candidate_blocks: reindex layer: int32 [B, S, NBk] kept block numbers (relative to ks,
            -1 padded) from the source layer; scores outside them are -inf before top-k.
        backend: "auto" | "tilelang" | "torch".
        chunk_bytes: budget of the per-chunk transients (default 512 MiB).

    Returns:
        topk_indices int32 [B, S, T] in ascending index order, -1 padding; with
        ``candidate_topk_blocks`` the pair (topk_indices, candidate_blocks int32
        [B, S, min(candidate_topk_blocks, ceil(K / C))]) as ``naive.candidate_blocks`` returns it.
    """
    from nemo_dsa.ops.topk.naive import blocks_to_mask, candidate_blocks as find_blocks

    batch, queries, heads, dim, num_keys = _check_common(q, k, w, torch.bfloat16, ks, ke, topk, chunk_bytes)
    _check_candidates(candidate_block_size, candidate_topk_blocks, candidate_blocks, batch, queries, num_keys, q.device)
    backend = resolve_backend(backend, q, k, w, ks, ke)
    source = candidate_topk_blocks is not None
    reindex = candidate_blocks is not None
    count = min(topk, num_keys)
    indices = torch.full((batch, queries, count), -2, dtype=torch.int32, device=q.device)
    blocks_out = None
    if source:
        num_blocks = min(candidate_topk_blocks, -(-num_keys // candidate_block_size))
        blocks_out = torch.full((batch, queries, num_blocks), -2, dtype=torch.int32, device=q.device)
    on_gpu = _selects_on_gpu(backend, count)
    row_key = ("v41", heads, dim, count, source or reindex, candidate_block_size or 1, on_gpu, batch > 1)
    row_bytes = v41_row_bytes(*row_key[1:])

    def score_chunk(chunk, first_pass):
        local_ks, local_ke = plan.ranges(chunk)
        scores = _v41_chunk_scores(
            backend, q[:, chunk.rows], k[:, chunk.key_start : chunk.key_end], w[:, chunk.rows],
            local_ks, local_ke, chunk_bytes,
        )
        # Candidate blocks count from ks, so they are the same relative to the window.
        if source and first_pass:
            found = find_blocks(scores, local_ks, local_ke, candidate_block_size, candidate_topk_blocks, budget_bytes=chunk_bytes)
            blocks_out[:, chunk.rows] = -1
            blocks_out[:, chunk.rows, : found.shape[-1]] = found  # a narrow window has fewer blocks: pad
        elif reindex:
            # A block past the window's last block holds no key the row sees: drop it (-1).
            kept = candidate_blocks[:, chunk.rows]
            kept = torch.where(kept < -(-chunk.width // candidate_block_size), kept, -1)
            keep = blocks_to_mask(kept, local_ks, local_ke, candidate_block_size, chunk.width, budget_bytes=chunk_bytes)
            scores.masked_fill_(~keep, float("-inf"))
        return scores, local_ks, local_ke

    def emit(chunk, index, value):
        if index is None:
            indices[:, chunk.rows] = -1
            if source:
                blocks_out[:, chunk.rows] = -1
        else:
            indices[:, chunk.rows] = index.view(batch, -1, count)

    def targets(chunk):  # the selected scores are not returned: a transient receives them
        picked = torch.empty((chunk.end - chunk.start, count), dtype=torch.bfloat16, device=q.device)
        return indices[0, chunk.rows], picked

    plan = _planned_chunks(ks, ke, row_key, row_bytes, chunk_bytes)
    _select_chunks(plan.chunks, score_chunk, emit, count, "index", chunk_bytes, on_gpu, targets if batch == 1 else None)
    return (indices, blocks_out) if source else indices
