"""How fast can blocks gather the forward's key rows into shared memory, with nothing else to do?

    python benchmarks/probe_gathers.py            # on the GPU: prints the table
    python benchmarks/probe_gathers.py --cuda g.cu  # anywhere: writes one build's generated CUDA

The sparse-attention forward's producer (one warpgroup of 128 threads a block, one block an SM)
gathers each 64-key tile as two 32 KiB halves of 512-byte half rows by 16-byte cp.async. This
probe does only that: each block copies ``--tiles`` tiles of 64 random half rows of an L2-resident
table (8,192 rows of 512 bf16: V4's compressed rows at S = 32,768) into a ring of ``stages``
32 KiB buffers, one cp.async group a tile, keeping ``stages`` groups in flight
(``cp.async.wait_group``). It runs one and two blocks an SM, so the table separates the bytes an
SM keeps in flight from the warps that issue them. benchmarks/results/2026-12-06.md has what it showed.
"""

# No `from __future__ import annotations`: TileLang evaluates the prim_func's tensor annotations.
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from attention import median_ms  # noqa: E402

from nemo_dsa.ops._tilelang import compile_cubin, lower_to_cuda_source, tilelang  # noqa: E402
from nemo_dsa.ops.sparse_attention.forward import NO_COPY_WAIT  # noqa: E402  (the forward producer's copies)

ROWS, COLS, TABLE_ROWS = 64, 256, 8192  # a tile: 64 half rows of 256 bf16 (32 KiB)
PASS_CONFIGS = {"tl.disable_warp_specialized": True}
CASES = ((1, 1), (2, 1), (3, 1), (4, 1), (6, 1), (1, 2), (2, 2), (3, 2))  # (stages, blocks an SM)


def gather_kernel(stages: int, blocks: int, tiles: int):
    """One 128-thread block gathers ``tiles`` tiles (rows from ``Idx``, alternate D halves) into a
    ``stages``-deep ring; it writes two staged values a thread so the copies stay live."""
    T = tilelang().language
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32

    @T.prim_func
    def gather_probe(
        Table: T.Tensor([TABLE_ROWS, 2 * COLS], bf16),
        Idx: T.Tensor([blocks, tiles, ROWS], i32),
        Out: T.Tensor([blocks, 128], f32),
    ):
        with T.Kernel(blocks, threads=128) as bx:
            tx = T.get_thread_binding()
            ring = T.alloc_shared([stages, ROWS, COLS], bf16)
            for t in T.serial(tiles):
                for r, d in T.Parallel(ROWS, COLS, prefer_async=True, annotations=NO_COPY_WAIT):
                    ring[t % stages, r, d] = Table[Idx[bx, t, r], (t % 2) * COLS + d]
                T.ptx_commit_group()
                T.ptx_wait_group(stages - 1)
            T.ptx_wait_group(0)
            T.sync_threads()
            Out[bx, tx] = T.cast(ring[0, tx % ROWS, tx], f32) + T.cast(ring[stages - 1, tx % ROWS, COLS - 1 - tx], f32)

    return gather_probe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", type=int, default=1024, help="tiles a block gathers")
    parser.add_argument("--cuda", help="write the generated CUDA of the 4-stage build here and stop")
    args = parser.parse_args(argv)
    if args.cuda:
        with open(args.cuda, "w") as f:
            f.write(lower_to_cuda_source(gather_kernel(4, 132, args.tiles), pass_configs=PASS_CONFIGS))
        return
    if not torch.cuda.is_available():
        raise SystemExit("probe_gathers needs a CUDA GPU (--cuda writes the generated code anywhere)")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = torch.randn(TABLE_ROWS, 2 * COLS, device="cuda", dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name()}, {sms} SMs: {args.tiles} tiles of 64 x 256 bf16 (32 KiB) a block")
    print("| stages | blocks an SM | KiB in flight an SM | ms | TB/s |")
    print("|---|---|---|---|---|")
    for stages, per_sm in CASES:
        blocks = sms * per_sm
        kernel = compile_cubin(gather_kernel(stages, blocks, args.tiles), pass_configs=PASS_CONFIGS)
        idx = torch.randint(0, TABLE_ROWS, (blocks, args.tiles, ROWS), device="cuda", dtype=torch.int32)
        out = torch.empty(blocks, 128, device="cuda")
        ms = median_ms(lambda: kernel(table, idx, out), iters=10)
        nbytes = blocks * args.tiles * ROWS * COLS * 2
        print(f"| {stages} | {per_sm} | {32 * stages * per_sm} | {ms:.3f} | {nbytes / ms / 1e9:.2f} |")


if __name__ == "__main__":
    main()
