"""The sparse-attention backward's schedules against each other: launches interleaved, one result check.

    python benchmarks/compare_backward_schedules.py --schedules transposed-ahead staged --seq 16384 32768

On the benchmark's operands (``attention.make_inputs``: H = 64, D = 512, window 128,
top-512 of ratio-4 compressed rows, B = 1), the forward runs once; then each schedule's backward
(``kernels.sparse_window_backward``, so delta, the dkv buffer's zeros and the conversions are in
every timing alike) runs once to compare its gradients with the first schedule's (dq and delta
should be bitwise equal, dkv differs by the order of its atomics), then ``--launches`` rounds
launch every schedule once each, in turn, so that clocks and the L2's state drift alike for all.
Prints the median of each and its change against the first; ``--json`` writes them.
(benchmarks/results/2026-12-05.md and 2026-12-06.md used this method; on one shape it tells schedules apart by ~1 %,
where separate runs of ``attention.py`` differ by up to 5 %.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from attention import DIM, WINDOW, make_inputs
from nemo_dsa.ops.sparse_attention import kernels


def backward(inputs, out, lse, grad, schedule: str):
    os.environ["NEMO_DSA_ATTN_BWD"] = schedule
    return kernels.sparse_window_backward(inputs, out, lse, grad)


def compare(seq: int, schedules: list[str], launches: int) -> dict:
    q, raw, comp, sink, indices, window_start = make_inputs(seq)
    inputs = kernels.KernelInputs(q, raw, window_start, WINDOW, comp, indices, None, None, sink, DIM**-0.5)
    out, lse = kernels.sparse_window_forward(inputs)
    grad = torch.randn_like(q)
    row = {"seq": seq, "checks": {}, "median_ms": {}}
    first = backward(inputs, out, lse, grad, schedules[0])
    for schedule in schedules[1:]:
        dq, d_raw, d_comp, delta = backward(inputs, out, lse, grad, schedule)
        row["checks"][schedule] = {
            "dq_equal": torch.equal(dq, first[0]),
            "delta_equal": torch.equal(delta, first[3]),
            "d_raw_max_diff": (d_raw.float() - first[1].float()).abs().max().item(),
            "d_comp_max_diff": (d_comp.float() - first[2].float()).abs().max().item(),
        }
    del first
    times = {schedule: [] for schedule in schedules}
    for _ in range(launches):
        for schedule in schedules:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            backward(inputs, out, lse, grad, schedule)
            end.record()
            end.synchronize()
            times[schedule].append(start.elapsed_time(end))
    row["median_ms"] = {schedule: statistics.median(t) for schedule, t in times.items()}
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=list(kernels.BWD_SCHEDULES),
                        help=f"the first is the reference of the checks and percentages; of {kernels.BWD_SCHEDULES}")
    parser.add_argument("--seq", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--launches", type=int, default=25, help="rounds of one launch of each schedule")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    unknown = [s for s in args.schedules if s not in kernels.BWD_SCHEDULES]
    if unknown:
        parser.error(f"--schedules: {unknown} not among {kernels.BWD_SCHEDULES}")
    rows = []
    for seq in args.seq:
        row = compare(seq, args.schedules, args.launches)
        rows.append(row)
        for schedule, check in row["checks"].items():
            print(f"S={seq} {schedule} against {args.schedules[0]}: {check}", flush=True)
        base = row["median_ms"][args.schedules[0]]
        for schedule, ms in row["median_ms"].items():
            print(f"S={seq} {schedule:18s} {ms:8.3f} ms {100 * (ms / base - 1):+6.1f} %", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "launches": args.launches, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
