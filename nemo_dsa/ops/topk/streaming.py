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

Exact selection without sorting the row: each score becomes a unique integer key whose descending
order is "score descending, then key index ascending", and ``torch.topk`` (a radix select, not a
sort) runs on the keys.
- fp32 scores (V4): key = (order-preserving int32 image of the score) << 32 | (2^32 - 1 - j), int64.
- bf16 scores (V4.1): key = (order-preserving int16 image) << 16 | (65535 - j), int32, valid while
  the window holds at most 65536 keys (j is the index inside the window, so K itself may be larger);
  wider windows fall back to the int64 key.
The window's first key is a constant offset, so local order equals global order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nemo_dsa._checks import check_positive_int, check_tensor
from nemo_dsa.ops._dispatch import resolve_backend
from nemo_dsa.ops._visibility import check_ks_ke

# Transient budget per chunk (issue #4): 512 MiB keeps Sc in the hundreds of rows at K = 32768.
DEFAULT_CHUNK_BYTES = 512 * 2**20
# Chunks start on multiples of these so that the scoring kernels' query tiles (<= 64 queries for
# H >= 2) and key tiles (128 keys) line up with those of an unchunked run.
ROW_ALIGN = 64
KEY_ALIGN = 128
# Bytes per (query, window key) element at the peak of each phase (see _selection_keys):
# V4: fp32 logits 4 + int32 image 4 + int64 key 8, plus 2 for the boolean masks.
V4_BYTES_PER_KEY = 18
# V4.1: bf16 scores 2 + int16 image 2 + int32 key 4 (int64: 8) + 2 for the boolean masks.
V41_BYTES_PER_KEY = 10
V41_WIDE_BYTES_PER_KEY = 14
# Candidate blocks (nemo_dsa.ops.topk.naive helpers): scores 2 + dense mask 1 + their 24 per key.
V41_CANDIDATE_BYTES_PER_KEY = 27
MAX_INT32_KEY_WIDTH = 2**16
# Per selected slot: topk's int64 values and indices, the gathered scores, masks and int32 copies.
SELECTED_BYTES = 48

_INT32_MIN = -(2**31)
_INT16_MIN = -(2**15)


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
    row_align: int = ROW_ALIGN,
    key_align: int = KEY_ALIGN,
) -> list[QueryChunk]:
    """Split the queries of ``ks/ke [B, S]`` into consecutive chunks whose transients fit a budget.

    A chunk of n queries with key window width W costs ``n * B * row_bytes(W)`` bytes
    (``row_bytes`` maps an int64 tensor of widths to bytes per query row, non-decreasing). Each
    chunk is the longest run from its start that fits ``chunk_bytes`` (never below one query: a
    single row is the irreducible unit), shortened to a multiple of ``row_align`` when it has at
    least that many rows. The window is the union of the chunk's visible ranges over the batch,
    its start rounded down to a multiple of ``key_align``; a chunk whose queries see nothing gets
    the empty window (0, 0). Reads ks/ke once on the host.
    """
    check_positive_int("chunk_bytes", chunk_bytes)
    ks_host, ke_host = ks.detach().to("cpu", torch.int64), ke.detach().to("cpu", torch.int64)
    batch, queries = ks_host.shape
    if queries == 0:
        return []
    seen = ke_host > ks_host
    none = torch.iinfo(torch.int64).max
    first = torch.where(seen, ks_host, none).amin(0)  # per query, over the batch
    last = torch.where(seen, ke_host, 0).amax(0)
    # Rows a chunk can possibly hold: the per-row cost at width 0 bounds it.
    lookahead = max(1, chunk_bytes // max(1, batch * int(row_bytes(torch.zeros(1, dtype=torch.int64))[0])))
    chunks: list[QueryChunk] = []
    start = 0
    while start < queries:
        stop = min(queries, start + lookahead)
        lo = torch.cummin(first[start:stop], 0).values
        hi = torch.cummax(last[start:stop], 0).values
        sees_any = lo != none
        lo = torch.where(sees_any, lo // key_align * key_align, 0)
        width = torch.where(sees_any, hi - lo, 0)
        rows = torch.arange(1, stop - start + 1, dtype=torch.int64)
        cost = rows * batch * row_bytes(width)
        count = max(1, int((cost <= chunk_bytes).sum()))  # cost is non-decreasing in rows
        if count >= row_align and start + count < queries:
            count -= count % row_align
        chunks.append(QueryChunk(start, start + count, int(lo[count - 1]), int(hi[count - 1]) if bool(sees_any[count - 1]) else 0))
        start += count
    return chunks


def v4_row_bytes(heads: int, dim: int, count: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Transient bytes per query row of :func:`v4_select_topk` for window widths ``width``."""
    # A contiguous copy of the chunk's q and w, and the [rows, T] top-k results and temporaries.
    per_row = heads * dim * 2 + heads * 4 + SELECTED_BYTES * count + 64
    return lambda width: width * V4_BYTES_PER_KEY + per_row


def v41_row_bytes(
    heads: int, dim: int, count: int, candidates: bool = False, block_size: int = 1
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Transient bytes per query row of :func:`v41_select_topk` for window widths ``width``."""
    per_row = heads * dim * 2 + heads * 2 + SELECTED_BYTES * count + 64

    def row_bytes(width: torch.Tensor) -> torch.Tensor:
        per_key = torch.where(width > MAX_INT32_KEY_WIDTH, V41_WIDE_BYTES_PER_KEY, V41_BYTES_PER_KEY)
        if candidates:  # the candidate phase precedes selection; its peak is the larger
            blocks = -(-width // block_size)
            return torch.maximum(per_key * width, V41_CANDIDATE_BYTES_PER_KEY * width + 40 * blocks) + per_row
        return per_key * width + per_row

    return row_bytes


# ----------------------------------------------------------------------------------------------
# Exact selection on a window of keys
# ----------------------------------------------------------------------------------------------


def _orderable_image(scores: torch.Tensor) -> torch.Tensor:
    """Integer image of fp32 (int32) or bf16 (int16) scores whose integer order is the float order.

    IEEE floats order like sign-magnitude integers: flipping the magnitude bits of negative
    values turns that into two's-complement order. -0.0 lands on -1 (the only bit pattern that
    does) and is folded onto +0.0's 0 so the two zeros tie; non-finite scores get the type's
    minimum, which no finite score reaches, so they are never preferred.
    """
    int_dtype, sign_shift, magnitude, minimum = (
        (torch.int32, 31, 0x7FFFFFFF, _INT32_MIN) if scores.dtype == torch.float32 else (torch.int16, 15, 0x7FFF, _INT16_MIN)
    )
    bits = scores.view(int_dtype)
    image = bits >> sign_shift  # -1 for negative scores, 0 otherwise
    image &= magnitude
    image ^= bits
    image.masked_fill_(image == -1, 0)
    image.masked_fill_(~torch.isfinite(scores), minimum)
    return image


def _selection_keys(scores: torch.Tensor) -> torch.Tensor:
    """Unique per-row keys of ``scores [N, W]``: descending key = descending score, then ascending index."""
    width = scores.shape[-1]
    image = _orderable_image(scores)
    if scores.dtype == torch.bfloat16 and width <= MAX_INT32_KEY_WIDTH:
        key, shift, low = image.to(torch.int32), 16, MAX_INT32_KEY_WIDTH - 1
    else:
        key, shift, low = image.to(torch.int64), 32, 2**32 - 1
    del image
    key *= 1 << shift  # no overflow (the image has 16 / 32 bits); avoids shifting negative values
    key |= low - torch.arange(width, device=scores.device, dtype=key.dtype)  # broadcast, no [N, W] copy
    return key


def select_window(
    scores: torch.Tensor, key_start: int, count: int, order: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``count`` of ``scores [N, W]`` (fp32 or bf16) whose column 0 is key ``key_start``.

    Returns (global indices int32 [N, count], gathered scores [N, count] in the scores' dtype),
    -1 / -inf where a row has fewer than ``count`` finite scores. ``order="score"``: descending
    score, ties to the smaller index; ``order="index"``: the same set in ascending index order.
    Equal to ``naive.select_topk`` on the full row (the window must hold every finite score).
    """
    rows, width = scores.shape
    take = min(count, width)
    index = torch.full((rows, count), -1, dtype=torch.int32, device=scores.device)
    values = torch.full((rows, count), float("-inf"), dtype=scores.dtype, device=scores.device)
    if take == 0 or rows == 0:
        return index, values
    chosen = torch.topk(_selection_keys(scores), take, dim=-1, largest=True, sorted=True).indices
    picked = torch.gather(scores, -1, chosen)
    finite = torch.isfinite(picked)  # non-finite keys sort last, so the -1s trail
    if order == "index":
        chosen = torch.where(finite, chosen, width).sort(dim=-1).values
        finite = chosen < width
        picked = torch.gather(scores, -1, torch.where(finite, chosen, 0))
    index[:, :take] = torch.where(finite, chosen + key_start, -1).to(torch.int32)
    values[:, :take] = torch.where(finite, picked, float("-inf"))
    return index, values


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


def _local_ranges(ks, ke, chunk: QueryChunk) -> tuple[torch.Tensor, torch.Tensor]:
    """ks/ke of the chunk's queries relative to its window; queries that see nothing get (0, 0)."""
    start, end = ks[:, chunk.rows], ke[:, chunk.rows]
    seen = end > start
    return torch.where(seen, start - chunk.key_start, 0), torch.where(seen, end - chunk.key_start, 0)


def _window_buffer(chunks, batch, device):
    """One fp32 buffer for the kernels' chunk logits, NaN-poisoned so an unwritten element shows."""
    largest = max((batch * (c.end - c.start) * c.width for c in chunks), default=0)
    return torch.full((largest,), float("nan"), dtype=torch.float32, device=device)


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
        backend: "auto" | "tilelang" | "torch" (scoring only; selection is the same torch code).
        chunk_bytes: budget of the per-chunk selection transients (default 512 MiB).

    Returns:
        index_score fp32 [B, S, T] (the logits at the indices, -inf at -1) and topk_indices int32
        [B, S, T], by descending score with ties to the smaller index, -1 padding. No autograd
        graph: the backward needs only the indices (``v4_backward`` / the TileLang backward).
    """
    batch, queries, heads, dim, num_keys = _check_common(q, k, w, torch.float32, ks, ke, topk, chunk_bytes)
    backend = resolve_backend(backend, q, k, w, ks, ke)
    count = min(topk, num_keys)
    # Poisoned: every chunk overwrites its rows, so a sentinel left over is a bug the tests see.
    indices = torch.full((batch, queries, count), -2, dtype=torch.int32, device=q.device)
    scores = torch.full((batch, queries, count), float("nan"), dtype=torch.float32, device=q.device)
    chunks = plan_query_chunks(ks, ke, v4_row_bytes(heads, dim, count), chunk_bytes)
    buffer = _window_buffer(chunks, batch, q.device) if backend == "tilelang" else None
    for chunk in chunks:
        rows = chunk.end - chunk.start
        if chunk.width == 0:
            indices[:, chunk.rows] = -1
            scores[:, chunk.rows] = float("-inf")
            continue
        local_ks, local_ke = _local_ranges(ks, ke, chunk)
        out = None if buffer is None else buffer[: batch * rows * chunk.width].view(batch, rows, chunk.width)
        logits = _v4_chunk_logits(
            backend, q[:, chunk.rows], k[:, chunk.key_start : chunk.key_end], w[:, chunk.rows],
            local_ks, local_ke, out, chunk_bytes,
        )
        index, value = select_window(logits.reshape(batch * rows, chunk.width), chunk.key_start, count, "score")
        indices[:, chunk.rows] = index.view(batch, rows, count)
        scores[:, chunk.rows] = value.view(batch, rows, count)
        del logits, index, value
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
    row_bytes = v41_row_bytes(heads, dim, count, source or reindex, candidate_block_size or 1)
    for chunk in plan_query_chunks(ks, ke, row_bytes, chunk_bytes):
        rows = chunk.end - chunk.start
        if chunk.width == 0:
            indices[:, chunk.rows] = -1
            if source:
                blocks_out[:, chunk.rows] = -1
            continue
        local_ks, local_ke = _local_ranges(ks, ke, chunk)
        scores = _v41_chunk_scores(
            backend, q[:, chunk.rows], k[:, chunk.key_start : chunk.key_end], w[:, chunk.rows],
            local_ks, local_ke, chunk_bytes,
        )
        # Candidate blocks count from ks, so they are the same relative to the window.
        if source:
            found = find_blocks(scores, local_ks, local_ke, candidate_block_size, candidate_topk_blocks, budget_bytes=chunk_bytes)
            blocks_out[:, chunk.rows] = -1
            blocks_out[:, chunk.rows, : found.shape[-1]] = found  # a narrow window has fewer blocks: pad
        elif reindex:
            # A block past the window's last block holds no key the row sees: drop it (-1).
            kept = candidate_blocks[:, chunk.rows]
            kept = torch.where(kept < -(-chunk.width // candidate_block_size), kept, -1)
            keep = blocks_to_mask(kept, local_ks, local_ke, candidate_block_size, chunk.width, budget_bytes=chunk_bytes)
            scores.masked_fill_(~keep, float("-inf"))
            del keep
        index, _ = select_window(scores.reshape(batch * rows, chunk.width), chunk.key_start, count, "index")
        indices[:, chunk.rows] = index.view(batch, rows, count)
        del scores, index
    return (indices, blocks_out) if source else indices
