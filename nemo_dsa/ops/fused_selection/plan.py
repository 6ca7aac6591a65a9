"""Chunk plans of the fused selection: which queries are scored together, on which key window.

A chunk is a run of queries and the key window holding everything they see; its transients (the
window's scores and the selection's temporaries, ``v4_row_bytes`` / ``v41_row_bytes``) must fit
the byte budget. Chunks start on the scoring kernels' tile boundaries, so a streamed run scores
every key exactly as an unchunked one. The plan needs ks/ke on the host once; it is kept with
the :class:`~nemo_dsa.visibility.KeyRanges` it was made for (``planned_chunks``), so the layers
of a step that share their metadata sync once, not each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nemo_dsa._checks import check_positive_int
from nemo_dsa.ops.topk.rows import TIE_MARGIN
from nemo_dsa.visibility import KeyRanges

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
# Candidate blocks (nemo_dsa.ops.v41_indexer.candidates.CANDIDATE_TRANSIENTS): per key the bf16 scores 2
# and the torch table's three copies (none with the TileLang block maxima); per block 40 / 12.
V41_CANDIDATE_BYTES = {"kernel": (2, 12), "torch": (8, 40)}
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
    the empty window (0, 0). The last two chunks then split their rows where the larger of their
    two costs is least (:func:`_balance_last_two`). Copies two [S] vectors to the host once.
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
    chunks: list[QueryChunk] = []
    start = 0
    while start < queries:
        # Rows the chunk can possibly hold: its window never narrows as rows join, so the per-row cost
        # at its first row's width bounds it (width 0 when that row sees nothing). A bound at width 0
        # for every chunk read ~25x more rows than fit at S = 131,072 (27 ms a plan).
        lo, hi = _windows(first[start : start + 1], last[start : start + 1], key_align, none)
        per_row = max(1, batch * int(row_bytes(hi - lo)[0]))
        stop = min(queries, start + max(row_align, chunk_bytes // per_row + 1))
        lo, hi = _windows(np.minimum.accumulate(first[start:stop]), np.maximum.accumulate(last[start:stop]), key_align, none)
        cost = np.arange(1, stop - start + 1, dtype=np.int64) * batch * row_bytes(hi - lo)
        # cost is non-decreasing in rows; a chunk that does not reach the end is whole tiles
        count = max(min(row_align, stop - start), int((cost <= chunk_bytes).sum()))
        if start + count < queries:
            count -= count % row_align
        chunks.append(QueryChunk(start, start + count, int(lo[count - 1]), int(hi[count - 1])))
        start += count
    if len(chunks) > 1:
        chunks[-2:] = _balance_last_two(chunks[-2], chunks[-1], first, last, batch, row_bytes, chunk_bytes,
                                        row_align, key_align, none)  # fmt: skip
    return chunks


def _windows(lo: np.ndarray, hi: np.ndarray, key_align: int, none: int) -> tuple[np.ndarray, np.ndarray]:
    """Key windows from the visible ranges' running union ``[lo, hi)`` (``lo == none``: no query
    sees anything yet, the empty window (0, 0)): the start rounded down to a multiple of ``key_align``."""
    sees_any = lo != none
    return np.where(sees_any, lo // key_align * key_align, 0), np.where(sees_any, hi, 0)


def _balance_last_two(a, b, first, last, batch, row_bytes, chunk_bytes, row_align, key_align, none):
    """Chunks ``a`` and ``b`` (the last) split again at the query tile where the larger of their costs
    is least, both within the budget. Filled greedily, the last chunk holds whatever rows remain, often
    a sliver: a scorer launch of a few query tiles keeps most SMs idle (V4.1, S = 32,768, R = 2: 512
    rows, 64 blocks of 8 queries over 132 SMs)."""
    rows = slice(a.start, b.end)
    # Windows of [a.start, m) (running from the front) and [m, b.end) (running from the back), each m.
    head_lo, head_hi = np.minimum.accumulate(first[rows]), np.maximum.accumulate(last[rows])
    tail_lo = np.minimum.accumulate(first[rows][::-1])[::-1]
    tail_hi = np.maximum.accumulate(last[rows][::-1])[::-1]
    splits = np.arange(a.start + row_align, b.end, row_align)  # a holds whole tiles, b at least one row
    if splits.size == 0:
        return [a, b]
    head = _windows(head_lo[splits - a.start - 1], head_hi[splits - a.start - 1], key_align, none)
    tail = _windows(tail_lo[splits - a.start], tail_hi[splits - a.start], key_align, none)
    head_cost = (splits - a.start) * batch * row_bytes(head[1] - head[0])
    tail_cost = (b.end - splits) * batch * row_bytes(tail[1] - tail[0])
    worst = np.maximum(head_cost, tail_cost)
    worst[(head_cost > chunk_bytes) | (tail_cost > chunk_bytes)] = np.iinfo(np.int64).max
    best = int(np.argmin(worst))
    if worst[best] == np.iinfo(np.int64).max:
        return [a, b]
    m = int(splits[best])
    return [
        QueryChunk(a.start, m, int(head[0][best]), int(head[1][best])),
        QueryChunk(m, b.end, int(tail[0][best]), int(tail[1][best])),
    ]


def _selection_path(on_gpu: bool) -> str:
    return "kernel" if on_gpu else "torch"


@dataclass(frozen=True)
class ChunkPlan:
    """The chunks of one call and every query's visible range relative to its chunk's window."""

    chunks: tuple[QueryChunk, ...]
    local_ks: torch.Tensor  # [B, S] int32; (0, 0) for queries that see nothing
    local_ke: torch.Tensor

    def ranges(self, chunk: QueryChunk) -> KeyRanges:
        """The chunk's queries' ranges relative to its key window (within it by construction)."""
        return KeyRanges(self.local_ks[:, chunk.rows], self.local_ke[:, chunk.rows], chunk.width)


def planned_chunks(ranges: KeyRanges, row_key: tuple, row_bytes, chunk_bytes: int) -> ChunkPlan:
    """:func:`plan_query_chunks` and the window-local ranges, kept with ``ranges`` (its
    ``facts``): the plan's device-to-host copy would otherwise drain the GPU queue in every
    indexer layer of a step. ``row_key`` names the ``row_bytes`` function (its arguments)."""
    key = ("query_chunks", row_key, chunk_bytes)
    plan = ranges.facts.get(key)
    if plan is None:
        ks, ke = ranges.ks, ranges.ke
        chunks = tuple(plan_query_chunks(ks, ke, row_bytes, chunk_bytes))
        starts = np.repeat([c.key_start for c in chunks], [c.end - c.start for c in chunks]).astype(np.int32)
        offset = torch.from_numpy(starts).to(ks.device)
        seen = ke > ks
        plan = ChunkPlan(chunks, torch.where(seen, ks - offset, 0), torch.where(seen, ke - offset, 0))
        ranges.facts[key] = plan
    return plan


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
    kept_width: int = 0,
    maxima_kernel: bool = False,
) -> Callable[[np.ndarray], np.ndarray]:
    """Transient bytes per query row of :func:`v41_select_topk` for window widths ``width``
    (``kept_width``: kept blocks per row the select reads itself, copied when ``batched``;
    ``maxima_kernel``: candidate-block maxima by the TileLang kernel, else the torch table)."""
    path = _selection_path(on_gpu)
    margin = 0 if on_gpu else TIE_MARGIN
    per_row = _query_copy_bytes(heads, dim, batched) + heads * 2 + SELECTED_BYTES[path] * (count + margin) + 64
    per_row += 4 * kept_width if batched else 0
    per_key = V41_BYTES_PER_KEY[path]
    candidate_per_key, candidate_per_block = V41_CANDIDATE_BYTES["kernel" if maxima_kernel else "torch"]

    def row_bytes(width: np.ndarray) -> np.ndarray:
        if candidates:  # the candidate phase precedes selection; its peak is the larger
            blocks = -(-width // block_size)
            return np.maximum(per_key * width, candidate_per_key * width + candidate_per_block * blocks) + per_row
        return per_key * width + per_row

    return row_bytes
