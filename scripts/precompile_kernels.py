"""Compile nemo_dsa's TileLang kernels into TileLang's disk cache, in parallel.

A GPU run then loads each kernel from the cache instead of compiling it on first use (5 to 40
s a kernel). Runs without a GPU too (the nvcc builds are the same), so the cache can be filled on
any machine with the same TileLang and carried along:

    TILELANG_CACHE_DIR=/tmp/tilelang-cache python scripts/precompile_kernels.py --workers 16
    python scripts/precompile_kernels.py --heads 64 --dims 128     # just the benchmark's shapes
    python scripts/precompile_kernels.py --heads 32 --kinds v41 select vector   # the V4.1 selection
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor

KINDS = ("v4_fwd", "v4_bwd", "v41", "select", "vector", "attention")


def _jobs(heads: list[int], dims: list[int], counts: list[int], block_sizes: list[int]) -> list[tuple]:
    import torch

    from nemo_dsa.ops.topk.kernels import selection_builds

    scorers = [(kind, h, d) for kind in ("v4_fwd", "v4_bwd", "v41") for h in heads for d in dims]
    # The selects a caller of each top-k can choose at any sequence length (``selection_builds``,
    # the set ``ops.warm_up`` builds on a first step): the radix select for both dtypes and orders
    # (V4 sorts fp32 by score, sized by the top-k; the other pairs serve the generic select_topk),
    # and for V4.1 (bf16, index order) the vector select and the radix select (which one runs
    # depends on the scores' alignment), plain and masked by candidate blocks (reindex layers).
    builds = set()
    for count in counts:
        for dtype in (torch.float32, torch.bfloat16):
            for order in ("score", "index"):
                masks = [0, *block_sizes] if dtype == torch.bfloat16 and order == "index" else [0]
                builds.update(selection_builds(dtype, count, order, masks))
    selectors = [("vector" if build.factory.__name__ == "vector_select_kernel" else "select", build)
                 for build in sorted(builds, key=lambda b: b.name())]
    # The sparse-attention kernels (forward, backward, delta) of every head dim/mode.
    from nemo_dsa.ops.sparse_attention.kernels import KERNEL_DIMS, dispatched_configs

    attention = [("attention", config) for config in dispatched_configs() + list(KERNEL_DIMS)]
    return scorers + selectors + attention


def _compile(job: tuple) -> str:
    kind = job[0]
    from nemo_dsa.ops._tilelang import compile_cubin

    start = time.perf_counter()
    if kind in ("select", "vector"):
        build = job[1]
        compile_cubin(build.factory(**dict(build.config)), pass_configs=dict(build.pass_configs))
        return f"{build.name()} {time.perf_counter() - start:5.1f} s"
    if kind == "attention":
        from nemo_dsa.ops.sparse_attention import kernels

        kernels.compile_config(job[1])
        return f"attention {job[1]} {time.perf_counter() - start:5.1f} s"
    _, heads, dim = job
    if kind == "v41":
        from nemo_dsa.ops.v41_indexer import kernels

        config = kernels.scorer_config(heads, dim)
        compile_cubin(kernels.v41_scorer_kernel(**config.kernel_kwargs()), pass_configs=config.pass_configs())
    else:
        from nemo_dsa.ops.v4_indexer import kernels

        if kind == "v4_fwd":
            config = kernels.forward_config(heads, dim)
            compile_cubin(kernels.v4_logits_kernel(**config.as_kwargs()), pass_configs=config.pass_configs())
        else:
            compile_cubin(kernels.v4_topk_backward_kernel(**kernels.backward_config(heads, dim).as_kwargs()))
    return f"{kind:7s} heads={heads:<3d} dim={dim:<3d} {time.perf_counter() - start:5.1f} s"


def main(argv: list[str] | None = None) -> None:
    from nemo_dsa.ops.v4_indexer.kernels import SUPPORTED_DIMS, SUPPORTED_HEADS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs="+", default=list(SUPPORTED_HEADS), choices=SUPPORTED_HEADS,
                        help="the indexers' head counts (the attention kernels' shapes need none)")
    parser.add_argument("--dims", type=int, nargs="+", default=list(SUPPORTED_DIMS), choices=SUPPORTED_DIMS,
                        help="the indexers' head dims (the attention kernels' come from their own table)")
    parser.add_argument("--counts", type=int, nargs="+", default=[512], help="top-k sizes the selector serves")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[8],
                        help="V4.1 candidate block sizes (the reindex layers' masked selects)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", default=None, choices=KINDS, help="only these kernel kinds (default: all)")
    args = parser.parse_args(argv)
    jobs = _jobs(args.heads, args.dims, args.counts, args.block_sizes)
    jobs = [job for job in jobs if args.kinds is None or job[0] in args.kinds]
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        for line in pool.map(_compile, jobs):
            print(line, flush=True)
    print(f"{len(jobs)} kernels in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
