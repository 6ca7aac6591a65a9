"""The V4.1 chunk select: the vector select against the radix select, on one chunk of scores.

    python benchmarks/compare_select_kernels.py --ratios 1 2 --first-rows 16384 28672 --reindex

On one 4,096-row chunk of V4.1 scores (``selection._v41_inputs``: 32 index heads of 128,
S = 32,768, causal, top-512 in index order), the chunk the streamed selection hands the select,
each kernel is timed alone with CUDA events around one launch (``--launches``, medians; the
events hold each launch, so a kernel with little work shows mostly its launch): the vector select
(the default) and the radix select. ``--reindex`` adds the reindex layer's chunk: a second layer's
scores masked by the candidate blocks of 8 (2,048 kept) that the first layer's scores give, read
from the list by the vector select (in the candidate source's form) and through the map by the radix
select. Checks that both
kernels give the same indices and scores. benchmarks/results/2026-12-06.md has the numbers.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

from attention import median_ms
from selection import TOPK, V41_BLOCK_SIZE, V41_TOPK_BLOCKS, _v41_inputs
from nemo_dsa.ops._tilelang import compile_cached
from nemo_dsa.ops.v41_indexer import candidate_blocks
from nemo_dsa.ops.topk import kernels as topk_kernels
from nemo_dsa.ops.topk.vector_kernels import vector_select_kernel
from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

CHUNK_ROWS = 4096


def compare_chunk(ratio: int, first_row: int, launches: int, reindex: bool) -> None:
    q, q2, k, w, w2, ks, ke = _v41_inputs(32768, ratio)
    rows = slice(first_row, first_row + CHUNK_ROWS)
    chunk_ks, chunk_ke = ks[:, rows].contiguous(), ke[:, rows].contiguous()
    scores = v41_scores_tilelang(q[:, rows], k, w[:, rows], chunk_ks, chunk_ke)
    block_size, blocks = 0, torch.empty((1, 1), dtype=torch.int32, device="cuda")
    if reindex:  # the first layer's candidate blocks, the second layer's scores
        blocks = candidate_blocks(scores, chunk_ks, chunk_ke, V41_BLOCK_SIZE, V41_TOPK_BLOCKS)[0].contiguous()
        scores = v41_scores_tilelang(q2[:, rows], k, w2[:, rows], chunk_ks, chunk_ke)
        block_size = V41_BLOCK_SIZE
    scores, chunk_ks, chunk_ke = scores.reshape(-1, k.shape[1]), chunk_ks[0], chunk_ke[0]
    n = scores.shape[0]

    def outputs():
        return torch.empty((n, TOPK), dtype=torch.int32, device="cuda"), torch.empty((n, TOPK), dtype=scores.dtype, device="cuda")

    vector = compile_cached(vector_select_kernel, block_size=block_size)
    config = asdict(topk_kernels.select_config(torch.bfloat16, TOPK, "index", block_size))
    radix = compile_cached(topk_kernels.radix_select_kernel, pass_configs=topk_kernels.SELECT_PASS_CONFIGS, **config)
    (index, picked), (radix_index, radix_picked) = outputs(), outputs()
    # The candidate source's lists: in its form (ascending, then -1), as a reindex layer receives them.
    vector_ms = median_ms(lambda: vector(scores, chunk_ks, chunk_ke, index, picked, 0, blocks, int(reindex)), launches)
    radix_ms = median_ms(lambda: radix(scores, chunk_ks, chunk_ke, radix_index, radix_picked, 0, blocks), launches)
    same = torch.equal(index, radix_index) and torch.equal(picked, radix_picked)
    keys = (chunk_ke - chunk_ks).double()
    layer = "reindex" if reindex else "stream"
    print(f"{layer} R={ratio} rows {first_row}+{CHUNK_ROWS}: {keys.mean().item():.0f} keys a row "
          f"({keys.sum().item() * 2 / 1e6:.0f} MB); vector {vector_ms * 1e3:.0f} us against the radix select "
          f"{radix_ms * 1e3:.0f} us ({radix_ms / vector_ms:.2f}x); same indices and scores: {same}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--first-rows", type=int, nargs="+", default=[16384, 28672])
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--reindex", action="store_true", help="also the reindex layer's chunk (candidate blocks)")
    args = parser.parse_args()
    for reindex in (False, True) if args.reindex else (False,):
        for ratio in args.ratios:
            for first_row in args.first_rows:
                compare_chunk(ratio, first_row, args.launches, reindex)


if __name__ == "__main__":
    main()
