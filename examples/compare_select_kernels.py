"""The V4.1 chunk select: the vector select (+ the radix select's skip launch) against the radix select alone.

    python examples/compare_select_kernels.py --ratios 1 2 --first-rows 16384 28672

On one 4,096-row chunk of V4.1 scores (``benchmark_selection._v41_inputs``: 32 index heads of 128,
S = 32,768, causal, top-512 in index order), the chunk the streamed selection hands the select,
each kernel is timed alone with CUDA events around one launch (``--launches``, medians; the
events hold each launch, so a kernel with little work shows mostly its launch): the vector select,
the radix select over the rows it left (``skip_resolved``), and the radix select alone (v30's
path). Prints the share of rows the vector select decided and checks that both paths give the
same indices. docs/performance.md v31 has the numbers this gave on the way to the kept kernel.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

from benchmark_attention import median_ms
from benchmark_selection import TOPK, _v41_inputs
from nemo_dsa.ops._tilelang import compile_cached
from nemo_dsa.ops.topk import kernels as topk_kernels
from nemo_dsa.ops.topk.vector_kernels import vector_select_kernel
from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

CHUNK_ROWS = 4096


def compare_chunk(ratio: int, first_row: int, launches: int) -> None:
    q, _, k, w, _, ks, ke = _v41_inputs(32768, ratio)
    rows = slice(first_row, first_row + CHUNK_ROWS)
    scores = v41_scores_tilelang(q[:, rows], k, w[:, rows], ks[:, rows], ke[:, rows]).reshape(-1, k.shape[1])
    chunk_ks, chunk_ke = ks[0, rows].contiguous(), ke[0, rows].contiguous()
    n = scores.shape[0]
    unused = torch.empty((1, 1), dtype=torch.int32, device="cuda")

    def outputs():
        return torch.empty((n, TOPK), dtype=torch.int32, device="cuda"), torch.empty((n, TOPK), dtype=scores.dtype, device="cuda")

    vector = compile_cached(vector_select_kernel)
    radix_rest = compile_cached(topk_kernels.radix_select_kernel, pass_configs=topk_kernels.SELECT_PASS_CONFIGS,
                                **asdict(topk_kernels.VECTOR_FALLBACK))  # fmt: skip
    config = asdict(topk_kernels.select_config(torch.bfloat16, TOPK, "index"))
    radix = compile_cached(topk_kernels.radix_select_kernel, pass_configs=topk_kernels.SELECT_PASS_CONFIGS, **config)
    (index, picked), resolved = outputs(), torch.empty(n, dtype=torch.int32, device="cuda")
    vector_ms = median_ms(lambda: vector(scores, chunk_ks, chunk_ke, index, picked, 0, resolved, unused), launches)
    rest_ms = median_ms(lambda: radix_rest(scores, chunk_ks, chunk_ke, index, picked, 0, unused, resolved), launches)
    radix_index, radix_picked = outputs()
    radix_ms = median_ms(lambda: radix(scores, chunk_ks, chunk_ke, radix_index, radix_picked, 0, unused, unused.view(1)), launches)
    same = torch.equal(index, radix_index) and torch.equal(picked, radix_picked)
    keys = (chunk_ke - chunk_ks).double()
    print(f"R={ratio} rows {first_row}+{CHUNK_ROWS}: {keys.mean().item():.0f} keys a row "
          f"({keys.sum().item() * 2 / 1e6:.0f} MB); vector select decided {resolved.float().mean().item():.4f} of the rows; "
          f"vector {vector_ms * 1e3:.0f} us + radix rest {rest_ms * 1e3:.0f} us against the radix select alone "
          f"{radix_ms * 1e3:.0f} us; same indices and scores: {same}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--first-rows", type=int, nargs="+", default=[16384, 28672])
    parser.add_argument("--launches", type=int, default=20)
    args = parser.parse_args()
    for ratio in args.ratios:
        for first_row in args.first_rows:
            compare_chunk(ratio, first_row, args.launches)


if __name__ == "__main__":
    main()
