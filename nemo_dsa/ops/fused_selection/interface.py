"""Fused score + select: the indexer's [B, S, K] score matrix is never held at once.

At S = 131072, R = 4 the full V4 logit matrix is 16 GiB of fp32 per indexer layer. Here queries
are processed in chunks of Sc rows (``plan``); each chunk is scored with the ordinary scoring path
(TileLang kernels on CUDA, the torch references otherwise) on the *key window* its queries can
see, then selected exactly with the documented rule (``window``; docs/semantics.md "Top-k selection": best
finite scores, ties to the smaller key index, -1 padding). Only [B, Sc, W] transients live at a
time (W <= K the window width), with Sc chosen so that they fit ``chunk_bytes``. Selection is
independent of the chunking (every query's selection is a function of its own row only), so the
result equals select_topk on the full matrix whenever the scorer's per-element arithmetic does
not depend on the chunk: true of the TileLang kernels (chunks start on their tile boundaries);
CPU BLAS picks kernels by matrix shape, so the torch references agree only to the last ulp on
continuous inputs (exactly on exactly representable ones, as in the tests).

The scorers are this module's only backend-specific code (:func:`v4_chunk_logits`,
:func:`v41_chunk_scores`). :func:`v4_select_topk` and :func:`v41_select_topk` validate every
argument; the ``*_in_ranges`` forms (the indexers' entries) take
:class:`~nemo_dsa.visibility.KeyRanges` and tensors their callers made, and check nothing.
"""

from __future__ import annotations

import torch

from nemo_dsa._checks import check_index_range, check_positive_int, check_qkw, check_tensor
from nemo_dsa.ops.dispatch import resolve_backend
from nemo_dsa.ops.fused_selection.plan import DEFAULT_CHUNK_BYTES, planned_chunks, v4_row_bytes, v41_row_bytes
from nemo_dsa.ops.fused_selection.window import select_chunks
from nemo_dsa.ops.topk.kernels import MAX_COUNT, fits_block_mask
from nemo_dsa.ops.v4_indexer.kernels import kernel_refusal as v4_kernel_refusal
from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang
from nemo_dsa.ops.v4_indexer.naive import v4_logits_in_ranges
from nemo_dsa.ops.v41_indexer.candidates import blocks_to_mask, candidate_blocks_in_ranges, uses_maxima_kernel
from nemo_dsa.ops.v41_indexer.heads import kernel_refusal as v41_kernel_refusal
from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang
from nemo_dsa.ops.v41_indexer.naive import v41_scores_in_ranges
from nemo_dsa.visibility import KeyRanges, check_ks_ke


def v4_chunk_logits(backend, q, k, w, ranges: KeyRanges, buffer, chunk_bytes):
    """The scorer seam: V4 logits of one chunk's queries on its key window."""
    if backend == "tilelang":
        return v4_logits_tilelang(q, k, w, ranges.ks, ranges.ke, out=buffer)
    return v4_logits_in_ranges(q, k, w, ranges, budget_bytes=chunk_bytes)


def v41_chunk_scores(backend, q, k, w, ranges: KeyRanges, chunk_bytes):
    """The scorer seam: V4.1 scores of one chunk's queries on its key window."""
    if backend == "tilelang":
        return v41_scores_tilelang(q, k, w, ranges.ks, ranges.ke)
    return v41_scores_in_ranges(q, k, w, ranges, budget_bytes=chunk_bytes)


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


def _check_common(q, k, w, w_dtype, ks, ke, topk, chunk_bytes) -> KeyRanges:
    batch, queries, _, _, num_keys = check_qkw(q, k, w, dtypes=((torch.bfloat16,), (torch.bfloat16,), (w_dtype,)))
    ranges = check_ks_ke(ks, ke, batch=batch, queries=queries, num_keys=num_keys, device=q.device)
    check_positive_int("topk", topk)
    check_positive_int("chunk_bytes", chunk_bytes)
    return ranges


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
    ranges = _check_common(q, k, w, torch.float32, ks, ke, topk, chunk_bytes)
    backend = resolve_backend(backend, q, k, w, ks, ke, kernel_refusal=v4_kernel_refusal(*q.shape[2:]))
    return v4_select_topk_in_ranges(q, k, w, ranges, topk, backend, chunk_bytes)


@torch.no_grad()
def v4_select_topk_in_ranges(
    q, k, w, ranges: KeyRanges, topk: int, backend: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`v4_select_topk` on arguments known to be valid (the V4 indexer's, validated where
    they entered or made by the metadata builder); nothing is checked. ``backend`` is a
    resolved one."""
    batch, queries, heads, dim = q.shape
    count = min(topk, k.shape[1])
    if batch == 0 or queries == 0:  # no rows to plan chunks over: the empty result select_topk gives
        return (torch.empty((batch, queries, count), dtype=torch.float32, device=q.device),
                torch.empty((batch, queries, count), dtype=torch.int32, device=q.device))
    # Poisoned: every chunk overwrites its rows, so a sentinel left over is a bug the tests see.
    indices = torch.full((batch, queries, count), -2, dtype=torch.int32, device=q.device)
    scores = torch.full((batch, queries, count), float("nan"), dtype=torch.float32, device=q.device)
    on_gpu = _selects_on_gpu(backend, count)
    row_key = ("v4", heads, dim, count, on_gpu, batch > 1)
    plan = planned_chunks(ranges, row_key, v4_row_bytes(*row_key[1:]), chunk_bytes)
    chunks = plan.chunks
    buffer = _window_buffer(chunks, batch, q.device) if backend == "tilelang" else None

    def score_chunk(chunk, first_pass):
        rows = chunk.end - chunk.start
        local = plan.ranges(chunk)
        out = None if buffer is None else buffer[: batch * rows * chunk.width].view(batch, rows, chunk.width)
        logits = v4_chunk_logits(
            backend, q[:, chunk.rows], k[:, chunk.key_start : chunk.key_end], w[:, chunk.rows], local, out, chunk_bytes,
        )
        return logits, local.ks, local.ke, None

    def emit(chunk, index, value):
        if index is None:
            indices[:, chunk.rows] = -1
            scores[:, chunk.rows] = float("-inf")
        else:
            indices[:, chunk.rows] = index.view(batch, -1, count)
            scores[:, chunk.rows] = value.view(batch, -1, count)

    targets = (lambda chunk: (indices[0, chunk.rows], scores[0, chunk.rows])) if batch == 1 else None
    select_chunks(chunks, score_chunk, emit, count, "score", chunk_bytes, on_gpu, targets, capacity=topk)
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
    check_index_range("candidate_blocks", candidate_blocks, num_blocks, meaning="block numbers relative to ks, -1 = none")


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
        candidate_block_size: C, compressed positions per candidate block (docs/semantics.md,
            candidate blocks); needed with either of the next two.
        candidate_topk_blocks: candidate-source layer: also compute the kept blocks from this
            layer's scores (its own selection is not masked, as in the released model).
        candidate_blocks: reindex layer: int32 [B, S, NBk] kept block numbers (relative to ks,
            -1 padded) from the source layer; scores outside them are -inf before top-k.
        backend: "auto" | "tilelang" | "torch".
        chunk_bytes: budget of the per-chunk transients (default 512 MiB).

    Returns:
        topk_indices int32 [B, S, T] in ascending index order, -1 padding; with
        ``candidate_topk_blocks`` the pair (topk_indices, candidate_blocks int32
        [B, S, min(candidate_topk_blocks, ceil(K / C))]) as ``topk.candidate_blocks`` returns it.
    """
    ranges = _check_common(q, k, w, torch.bfloat16, ks, ke, topk, chunk_bytes)
    batch, queries, num_keys = q.shape[0], q.shape[1], k.shape[1]
    _check_candidates(candidate_block_size, candidate_topk_blocks, candidate_blocks, batch, queries, num_keys, q.device)
    return v41_select_topk_in_ranges(
        q, k, w, ranges, topk, resolve_backend(backend, q, k, w, ks, ke, kernel_refusal=v41_kernel_refusal(*q.shape[2:])),
        chunk_bytes,
        candidate_block_size=candidate_block_size, candidate_topk_blocks=candidate_topk_blocks,
        candidate_blocks=candidate_blocks,
    )  # fmt: skip


@torch.no_grad()
def v41_select_topk_in_ranges(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    ranges: KeyRanges,
    topk: int,
    backend: str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    candidate_block_size: int | None = None,
    candidate_topk_blocks: int | None = None,
    candidate_blocks: torch.Tensor | None = None,
    blocks_from_source: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`v41_select_topk` on arguments known to be valid (the V4.1 indexer's: ranges made by
    the metadata builder, candidate blocks from a candidate-source call); nothing is checked.
    ``backend`` is a resolved one. ``blocks_from_source``: ``candidate_blocks`` are as a
    candidate-source call returned them (ascending, then -1), which lets the vector select read
    each kept block straight from the list; other lists go through a map of the row's blocks."""
    batch, queries, heads, dim = q.shape
    num_keys = k.shape[1]
    source = candidate_topk_blocks is not None
    reindex = candidate_blocks is not None
    count = min(topk, num_keys)
    indices = torch.full((batch, queries, count), -2, dtype=torch.int32, device=q.device)
    blocks_out = None
    if source:
        num_blocks = min(candidate_topk_blocks, -(-num_keys // candidate_block_size))
        blocks_out = torch.full((batch, queries, num_blocks), -2, dtype=torch.int32, device=q.device)
    if batch == 0 or queries == 0:  # no rows to plan chunks over: the empty results, as unfused
        return indices if blocks_out is None else (indices, blocks_out)
    on_gpu = _selects_on_gpu(backend, count)
    # Reindex on the GPU: the TileLang select applies the kept blocks itself, so a chunk holds
    # only its scores (and, with B > 1, a copy of its rows' block lists), not a [rows, W] mask
    # over them; rows of more blocks than its block map holds take the torch mask.
    mask_in_select = reindex and on_gpu and fits_block_mask(num_keys, candidate_block_size)
    kept_width = candidate_blocks.shape[-1] if mask_in_select else 0
    block_backend = "torch" if backend == "torch" else "auto"
    maxima_kernel = source and uses_maxima_kernel(torch.bfloat16, q.device, block_backend)
    row_key = ("v41", heads, dim, count, source or (reindex and not mask_in_select), candidate_block_size or 1,
               on_gpu, batch > 1, kept_width, maxima_kernel)  # fmt: skip
    row_bytes = v41_row_bytes(*row_key[1:])

    def score_chunk(chunk, first_pass):
        local = plan.ranges(chunk)
        scores = v41_chunk_scores(
            backend, q[:, chunk.rows], k[:, chunk.key_start : chunk.key_end], w[:, chunk.rows], local, chunk_bytes,
        )
        # Candidate blocks count from ks, so they are the same relative to the window.
        if source and first_pass:
            found = candidate_blocks_in_ranges(scores, local, candidate_block_size, candidate_topk_blocks,
                                               budget_bytes=chunk_bytes, backend=block_backend)  # fmt: skip
            blocks_out[:, chunk.rows] = -1
            blocks_out[:, chunk.rows, : found.shape[-1]] = found  # a narrow window has fewer blocks: pad
        elif reindex:
            kept = candidate_blocks[:, chunk.rows]
            if mask_in_select:
                # The select reads the kept blocks itself: keys of other blocks are -inf to it,
                # so no [rows, W] mask is built and the scores are not rewritten.
                return scores, local.ks, local.ke, kept
            # A block past the window's last block holds no key the row sees: drop it (-1).
            kept = torch.where(kept < -(-chunk.width // candidate_block_size), kept, -1)
            keep = blocks_to_mask(kept, local.ks, local.ke, candidate_block_size, chunk.width, budget_bytes=chunk_bytes)
            scores.masked_fill_(~keep, float("-inf"))
        return scores, local.ks, local.ke, None

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

    plan = planned_chunks(ranges, row_key, row_bytes, chunk_bytes)
    select_chunks(
        plan.chunks, score_chunk, emit, count, "index", chunk_bytes, on_gpu, targets if batch == 1 else None,
        block_size=candidate_block_size or 0, blocks_in_source_form=reindex and blocks_from_source,
    )  # fmt: skip
    if source:
        return indices, blocks_out
    return indices
