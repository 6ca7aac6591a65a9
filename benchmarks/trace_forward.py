"""Where a block of the sparse-attention forward spends its time: clock64 stamps.

    python benchmarks/trace_forward.py --seq 32768        # on the GPU: prints the table
    python benchmarks/trace_forward.py --cuda stamped.cu  # anywhere: writes the stamped CUDA

The forward (per-query indices, D = 512) is built with stamps
written into its generated CUDA by TileLang's post-processing hook: the first thread of each
consumer warpgroup reads ``clock64`` at fixed points (the index row's barrier, Q in shared
memory, each round's S and end, consumer 1's own P V, O staged for its TMA store) and
``globaltimer`` at the block's start and end, keeps them in 256 bytes of static shared memory
and writes them over the first 64 columns of head 0 in each consumer's O staging tile, so that
O's TMA store takes them to the output. So the outputs are not valid,
the kernel runs ~3 % slower, and each stamp reads to within a few hundred clocks (the compiler
schedules it among its neighbours). The anchors are statements of the generated CUDA; if the
kernel changes, the rewrite stops with the anchor it could not find.

Prints medians over the blocks of queries >= 4,096 (five rounds each at top-512), the clock
rate, and the gap between consecutive blocks on an SM. benchmarks/results/2026-12-05.md has what it showed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))

from attention import DIM, WINDOW, make_inputs  # noqa: E402

from nemo_dsa.ops._tilelang import compile_cubin  # noqa: E402
from nemo_dsa.ops.sparse_attention import kernels  # noqa: E402
from nemo_dsa.ops.sparse_attention.configs import forward_config  # noqa: E402

STAMPS = 16  # 64-bit stamps a consumer
ROUNDS = 5  # rounds stamped (the first five)
GLOBALTIMER = 'asm volatile("mov.u64 %0, %%globaltimer;" : "=l"({}));'
CONSUMER0, CONSUMER1 = 128, 256  # the first thread of each consumer warpgroup
# Consumer 0's slots: 0 globaltimer at the start, 1 clock64 at the start (SM id in the top byte),
# 2 index row's barrier, 3 Q in shared memory, 4-8 S of rounds 0-4, 9-13 end of rounds 0-4,
# 14 O staged for its TMA store, 15 globaltimer then. Consumer 1's (16 + slot): 0 Q, 1-5 S, 6-10 own P V, 11-15 end.
C0_POINTS = {2: "index row (block barrier)", 3: "Q in shared memory"}
C0_POINTS.update({4 + r: f"round {r}: S(A) done" for r in range(ROUNDS)})
C0_POINTS.update({9 + r: f"round {r}: end" for r in range(ROUNDS)})
C0_POINTS[14] = "O staged, its TMA store next"
C1_POINTS = {0: "Q in shared memory"}
C1_POINTS.update({1 + r: f"round {r}: S(B) done" for r in range(ROUNDS)})
C1_POINTS.update({6 + r: f"round {r}: own P V done" for r in range(ROUNDS)})
C1_POINTS.update({11 + r: f"round {r}: end" for r in range(ROUNDS)})


def _replace(code: str, anchor: str, new: str, occurrence: int = 0) -> str:
    """``code`` with the ``occurrence``-th ``anchor`` replaced by ``new``."""
    at = -1
    for _ in range(occurrence + 1):
        at = code.find(anchor, at + 1)
        if at < 0:
            raise RuntimeError(f"trace_forward: anchor not in the generated CUDA (occurrence {occurrence}): {anchor!r}")
    return code[:at] + new + code[at + len(anchor):]


def _stamp(thread: int, slot: str, guard: str = "") -> str:
    return f"if (threadIdx.x == {thread}{guard}) trace_s[{slot}] = clock64();"


def stamped(code: str) -> str:
    """The forward's CUDA (after the role-barrier renumbering) with the stamps written in."""
    head = "int n_slots, int seq_len) {"
    at = code.find(head, code.find("__launch_bounds__"))
    if at < 0:
        raise RuntimeError("trace_forward: kernel signature not found")
    at += len(head)
    start = ("\n  __shared__ unsigned long long trace_s[32]; unsigned long long tr_gt0; "
             + GLOBALTIMER.format("tr_gt0") + " unsigned long long tr_c0 = clock64();\n")
    code = code[:at] + start + code[at:]
    plan = (f"  if (threadIdx.x == {CONSUMER0}) {{ unsigned smid; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));"
            " trace_s[0] = tr_gt0; trace_s[1] = tr_c0 | ((unsigned long long)smid << 56); trace_s[2] = clock64(); }\n")
    code = _replace(code, "  __syncthreads();\n", "  __syncthreads();\n" + plan, occurrence=1)  # after the index row
    q_landed = "q_bar[0].wait(0);"  # each consumer's wait for Q's TMA load (consumer 0's first)
    code = _replace(code, q_landed, q_landed + " " + _stamp(CONSUMER0, "3"), occurrence=0)
    code = _replace(code, q_landed, q_landed + " " + _stamp(CONSUMER1, "16"), occurrence=1)
    guard0, guard1 = f" && r_1 < {ROUNDS}", f" && r_2 < {ROUNDS}"
    anchor = "*(float2*)(m_new0 + 0) = *(float2*)(m_i0 + 0);"  # consumer 0, right after S and its mask
    code = _replace(code, anchor, _stamp(CONSUMER0, "4 + r_1", guard0) + " " + anchor)
    code = _replace(code, "free_l[1].arrive();", "free_l[1].arrive(); " + _stamp(CONSUMER0, "9 + r_1", guard0))
    anchor = "max_a[0].wait((r_2 & 1));"  # consumer 1, right after S and its mask
    code = _replace(code, anchor, _stamp(CONSUMER1, "17 + r_2", guard1) + " " + anchor)
    code = _replace(code, "free_r[1].arrive();", "free_r[1].arrive(); " + _stamp(CONSUMER1, "22 + r_2", guard1))
    code = _replace(code, "free_r[0].arrive();", "free_r[0].arrive(); " + _stamp(CONSUMER1, "27 + r_2", guard1))
    # Each consumer's stamps go into the first 128 bytes of its O staging tile (head 0's first 64
    # columns of its half: row 0 is not swizzled) just before one thread issues O's TMA store.
    o_store = "      if (tl::tl_shuffle_elect<128>()) {\n        tl::fence_proxy_async();"
    flush0 = (f"      if (threadIdx.x == {CONSUMER0}) {{ unsigned long long gt; " + GLOBALTIMER.format("gt")
              + " trace_s[14] = clock64(); trace_s[15] = gt; unsigned long long* dst = (unsigned long long*)q_l;"
              f" for (int k = 0; k < {STAMPS}; ++k) dst[k] = trace_s[k]; }}\n"
              f"      tl::__sync_thread_partial({kernels.ROLE_BARRIER_IDS[1]}, 128);\n")
    code = _replace(code, o_store, flush0 + o_store, occurrence=0)
    flush1 = (f"      if (threadIdx.x == {CONSUMER1}) {{ unsigned long long* dst = (unsigned long long*)q_r;"
              f" for (int k = 0; k < {STAMPS}; ++k) dst[k] = trace_s[{STAMPS} + k]; }}\n"
              f"      tl::__sync_thread_partial({kernels.ROLE_BARRIER_IDS[2]}, 128);\n")
    return _replace(code, o_store, flush1 + o_store, occurrence=1)


def build():
    """The stamped default forward (indices mode, D = 512), compiled."""
    from tilelang.engine.callback import register_cuda_postproc_callback

    from nemo_dsa.ops.sparse_attention import forward as forward_module

    def postproc(code, _target):
        code = kernels.separate_role_barriers(code)
        return stamped(code) if "sparse_window_fwd" in code else code

    register_cuda_postproc_callback(postproc)
    forward_module._postproc_registered = True  # keep this hook: it renumbers the barriers too
    config = forward_config(512, "indices")
    kernel = compile_cubin(kernels.sparse_window_fwd_kernel(**config.kernel_kwargs()), pass_configs=config.pass_configs())
    if "trace_s" not in kernel.get_kernel_source():
        raise RuntimeError("trace_forward: the compiled forward carries no stamps (a cached unstamped build?)")
    return kernel


def report(out: torch.Tensor, seq: int) -> None:
    import numpy as np

    rows = out.view(seq, -1)
    c0 = rows[:, :64].contiguous().view(torch.int64).cpu().numpy()
    c1 = rows[:, 256:320].contiguous().view(torch.int64).cpu().numpy()
    smid = c0[:, 1] >> 56
    start = c0[:, 1] & ((1 << 56) - 1)
    chosen = np.arange(seq) >= min(4096, seq // 2)  # five rounds each at top-512 (from 4,096 on)

    def row(name, values):
        v = values[chosen]
        print(f"  {name:28s} {np.median(v):9.0f} {np.percentile(v, 10):9.0f} {np.percentile(v, 90):9.0f}")

    print("clocks from the block's start: median, p10, p90")
    print(" consumer 0")
    for slot, name in C0_POINTS.items():
        row(name, c0[:, slot] - start)
    print(" consumer 1")
    for slot, name in C1_POINTS.items():
        row(name, c1[:, slot] - start)
    nanoseconds = c0[:, 15] - c0[:, 0]
    clocks = c0[:, 14] - start
    print(f"block: {np.median(nanoseconds[chosen]):.0f} ns, {np.median(clocks[chosen]) / np.median(nanoseconds[chosen]):.3f} GHz")
    gaps, blocks = [], []
    for sm in np.unique(smid):
        on_sm = np.where(smid == sm)[0]
        order = on_sm[np.argsort(c0[on_sm, 0])]
        blocks.append(len(order))
        gaps.extend(c0[order[1:], 0] - c0[order[:-1], 15])
    span = (c0[:, 15].max() - c0[:, 0].min()) / 1e6
    print(f"{len(blocks)} SMs, {min(blocks)}-{max(blocks)} blocks each; between blocks on an SM: "
          f"{np.median(gaps):.0f} ns median; span {span:.3f} ms, each SM busy {nanoseconds.sum() / len(blocks) / 1e6:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--cuda", help="also write the stamped CUDA to this file")
    args = parser.parse_args()
    # TileLang's kernel cache is keyed by the PrimFunc, not by the CUDA the hook writes: a private
    # cache keeps an unstamped build of the same kernel from being loaded instead.
    os.environ["TILELANG_CACHE_DIR"] = tempfile.mkdtemp(prefix="trace_forward_")
    kernel = build()
    if args.cuda:
        with open(args.cuda, "w") as f:
            f.write(kernel.get_kernel_source())
    if not torch.cuda.is_available():
        return
    q, raw, comp, sink, indices, window_start = make_inputs(args.seq)
    inputs = kernels.KernelInputs(q, raw, window_start, WINDOW, comp, indices, None, None, sink, DIM**-0.5)
    out = torch.empty_like(inputs.q)
    lse = torch.empty(inputs.q.shape[:3], dtype=torch.float32, device=q.device)
    operands = (inputs.q, inputs.raw, inputs.comp, inputs.window_start, inputs.selector, inputs.end, inputs.sink,
                inputs.params, inputs.window, out, lse)  # fmt: skip
    times = []
    for _ in range(12):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        kernel(*operands)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    print(f"stamped forward at S={args.seq}: {sorted(times)[len(times) // 2]:.3f} ms (median of {len(times)})")
    report(out, args.seq)


if __name__ == "__main__":
    main()
