"""V4.1 candidate blocks: the blocks of compressed keys a candidate-source layer keeps for later layers.

docs/semantics.md "Top-k selection" (candidate blocks). Block numbers count from each query's ``ks`` (they move with the
document start). :func:`candidate_blocks` is the fast path on every device: block maxima from a
TileLang kernel on CUDA (one read of the scores) or a doubling table of running maxima elsewhere
(a few contiguous passes over the scores, no per-key index tensors), then the ordinary exact
selection (:func:`nemo_dsa.ops.topk.select_topk`: the TileLang radix select on CUDA) over the
blocks, so ties go to the smaller block.
``nemo_dsa.ops.topk.naive.candidate_blocks_reference`` is the readable reference it is tested against.
"""

from __future__ import annotations

import torch

from nemo_dsa.ops.chunking import DEFAULT_BUDGET_BYTES, query_chunk_size, query_chunks
from nemo_dsa.ops.topk.block_kernels import SCORE_DTYPES as KERNEL_SCORE_DTYPES
from nemo_dsa.ops.topk.block_kernels import block_maxima_tilelang
from nemo_dsa.ops.topk.interface import select_topk_in_ranges
from nemo_dsa.ops.topk.naive import check_candidate_arguments
from nemo_dsa.visibility import KeyRanges, visible_mask

_NEG_INF = float("-inf")
# Transients of one row: (score-sized copies per key, bytes per block). The torch table holds the
# cleared copy and two tables of running maxima, the kernel reads the scores in place; per block,
# the table's int64 starts and gathers or the kernel's maxima, and the block selection's outputs.
CANDIDATE_TRANSIENTS = {"kernel": (0, 12), "torch": (3, 40)}


def uses_maxima_kernel(dtype: torch.dtype, device: torch.device, backend: str) -> bool:
    """Whether :func:`candidate_blocks` takes the block maxima of scores of this dtype and
    device from the TileLang kernel (ops/topk/block_kernels.py: one read of the scores) rather
    than from the torch table."""
    return device.type == "cuda" and dtype in KERNEL_SCORE_DTYPES and backend != "torch"


def _block_maxima(scores: torch.Tensor, ks: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """Max of the finite scores of blocks ``[ks + n*C, ks + (n+1)*C)``, n < NB, for rows ``[N, K]``.

    Exact for every block that ends at or before K; other entries are unspecified (they may
    mix in the next row's scores). A row's blocks before its last visible one always end before
    its ``ke`` <= K, and the last one is kept whatever its maximum, so only those are read.
    The running maxima are taken over the flattened rows, so every pass is one contiguous
    elementwise kernel (no strided row views).
    """
    rows, num_keys = scores.shape
    table = torch.nan_to_num(scores, nan=_NEG_INF, posinf=_NEG_INF, neginf=_NEG_INF).contiguous().view(-1)
    # Each doubling drops `width` entries off the end, C - 1 at most in all: the -inf tail keeps
    # all rows * K starts in the table however short the rows are (one key for a 1-token query).
    table = torch.nn.functional.pad(table, (0, block_size - 1), value=_NEG_INF)
    # table[p] = max(scores[p : p + width]) over the flat rows; widths double up to the largest
    # power of two <= C.
    width = 1
    while 2 * width <= block_size:
        table = torch.maximum(table[:-width], table[width:])
        width *= 2
    starts = ks.long().unsqueeze(-1) + block_size * torch.arange(num_blocks, device=scores.device)
    starts += num_keys * torch.arange(rows, device=scores.device).unsqueeze(-1)
    last_entry = table.shape[0] - 1
    maxima = table[starts.clamp(max=last_entry)]
    if width < block_size:  # two overlapping windows of `width` cover the C keys
        maxima = torch.maximum(maxima, table[(starts + (block_size - width)).clamp_(max=last_entry)])
    return maxima


def candidate_blocks(
    scores: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    block_size: int,
    topk_blocks: int,
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    backend: str = "auto",
) -> torch.Tensor:
    """V4.1 candidate blocks, compact form: kept block numbers, int32 ``[B, S, min(topk_blocks, NB)]``.

    docs/semantics.md, candidate blocks. For query i, block n covers the compressed positions
    ``[ks_i + n*C, ks_i + (n+1)*C)`` clipped to its visible range ``[ks_i, ke_i)`` (blocks are
    counted from the document's first group, so they move with ks). A block's score is the max of
    its finite visible scores. The block holding the last visible group ``ke_i - 1`` is always
    kept and counts toward the budget (as in the released hierarchical selection); the remaining
    ``topk_blocks - 1`` slots go to the best other blocks with a finite score, ties to the smaller
    block. Output is in ascending block order, -1 padded; NB = ceil(K / C) is the most blocks any
    query can have. Scores outside ``[ks, ke)`` are ignored. ``backend`` selects the block
    selection (:func:`nemo_dsa.ops.topk.select_topk`) and the block maxima (the TileLang kernel
    for CUDA fp32/bf16 scores unless "torch", the torch table otherwise).
    """
    num_keys = check_candidate_arguments(scores, ks, ke, block_size, topk_blocks)[2]
    ranges = KeyRanges(ks, ke, num_keys)  # checked just now
    return candidate_blocks_in_ranges(scores, ranges, block_size, topk_blocks, budget_bytes=budget_bytes, backend=backend)


def candidate_blocks_in_ranges(
    scores: torch.Tensor,
    ranges: KeyRanges,
    block_size: int,
    topk_blocks: int,
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`candidate_blocks` on arguments known to be valid (the metadata's ranges, or a fused
    selection chunk's): nothing is checked, so no host sync drains the GPU queue."""
    batch, queries, num_keys = scores.shape
    ks, ke = ranges.ks, ranges.ke
    num_blocks = -(-num_keys // block_size)
    count = min(topk_blocks, num_blocks)
    out = torch.full((batch * queries, count), -1, dtype=torch.int32, device=scores.device)
    if count == 0 or queries == 0:
        return out.view(batch, queries, count)
    flat, flat_ks, flat_ke = scores.reshape(-1, num_keys), ks.reshape(-1), ke.reshape(-1)
    use_kernel = uses_maxima_kernel(scores.dtype, scores.device, backend)
    copies, per_block = CANDIDATE_TRANSIENTS["kernel" if use_kernel else "torch"]
    row_bytes = copies * scores.element_size() * num_keys + per_block * num_blocks
    for part in query_chunks(flat.shape[0], query_chunk_size(flat.shape[0], row_bytes, budget_bytes)):
        start, end = flat_ks[part].long(), flat_ke[part].long()
        if use_kernel:
            maxima = block_maxima_tilelang(flat[part], flat_ks[part], flat_ke[part], block_size, num_blocks)
        else:
            maxima = _block_maxima(flat[part], start, block_size, num_blocks)
        sees_any = end > start
        last = torch.where(sees_any, (end - 1 - start) // block_size, 0)
        rows = out[part]
        if count > 1:
            # The best count - 1 of the blocks before the last (whose keys all lie in [ks, ke)),
            # in block order; the last block, always kept, goes after them.
            before_last = torch.zeros_like(last, dtype=torch.int32)
            rows[:, : count - 1] = select_topk_in_ranges(maxima, count - 1, "index", ks=before_last, ke=last.int(), backend=backend)
        slot = (rows >= 0).sum(-1, keepdim=True)
        rows.scatter_(1, slot, torch.where(sees_any, last, -1).int().unsqueeze(-1))
    return out.view(batch, queries, count)


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
