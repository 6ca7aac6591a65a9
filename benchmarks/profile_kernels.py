"""Workloads for Nsight Compute: one kernel's launches at the benchmarks' shapes, nothing timed.

    ncu --clock-control none -k regex:vector_select --launch-skip 3 --launch-count 1 --set full \
        -o select -f python benchmarks/profile_kernels.py select
    ncu --clock-control none -k regex:sparse_window_bwd --launch-skip 2 --launch-count 1 --set full \
        -o attention_bwd -f python benchmarks/profile_kernels.py attention

``--clock-control none`` leaves the card's clocks as they are (ncu's default locks them to base).
``select``: the selection of one 4,096-row chunk of V4.1 scores (32 index heads of 128, R=1 or
``--ratio 2``, S=32,768, top-512 in index order, rows from ``--first-row``), the chunk the streamed
selection hands it: the vector select (``--radix``: the radix select, ``-k regex:radix_select``, on
a copy of the chunk 2 bytes off 16-byte alignment, the matrices it serves); it prints the chunk's
key statistics. ``attention``: the sparse attention forward and backward at
V4-Flash shapes (64 heads of 512, window 128 + top-512, S=32,768); ``-k regex:sparse_window_fwd``
takes the forward. benchmarks/results/ (2026-12-01, 2026-12-03, 2026-12-06) has what these showed.
"""

from __future__ import annotations

import argparse

import torch


def select_workload(launches: int, ratio: int = 1, radix: bool = False, first_row: int = 16384) -> None:
    from selection import TOPK, _v41_inputs

    from nemo_dsa.ops.topk import kernels
    from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

    q, _, k, w, _, ranges = _v41_inputs(32768, ratio)
    ks, ke = ranges.ks, ranges.ke
    rows = slice(first_row, first_row + 4096)
    scores = v41_scores_tilelang(q[:, rows], k, w[:, rows], ks[:, rows], ke[:, rows]).reshape(-1, k.shape[1])
    chunk_ks, chunk_ke = ks[0, rows].contiguous(), ke[0, rows].contiguous()
    finite = torch.isfinite(scores)
    values = torch.where(finite, scores.float(), float("-inf"))
    top, cut = values.amax(-1), values.topk(TOPK, -1).values[:, -1]
    print(f"finite keys a row: {finite.sum(-1).float().mean().item():.0f}; "
          f"512th score / maximum: {(cut / top).median().item():.3f} (median)")  # fmt: skip
    if radix:  # a matrix the vector select cannot read in 16-byte vectors goes to the radix select
        shifted = torch.empty(scores.numel() + 1, dtype=scores.dtype, device=scores.device)[1:]
        scores = shifted.view(scores.shape).copy_(scores)
    assert kernels.uses_vector_select(scores, "index") != radix
    for _ in range(launches):
        kernels.select_rows_tilelang(scores, TOPK, "index", chunk_ks, chunk_ke)
    torch.cuda.synchronize()


def attention_workload(launches: int) -> None:
    from attention import DIM, WINDOW, make_inputs

    from nemo_dsa.ops.sparse_attention import sparse_window_attention

    q, raw, comp, sink, indices, window_start = make_inputs(32768)
    leaves = [t.clone().requires_grad_(True) for t in (q, raw, comp, sink)]
    grad = torch.randn_like(q)
    for _ in range(launches):
        out, _ = sparse_window_attention(leaves[0], leaves[1], window_start, WINDOW, leaves[2], indices=indices,
                                         sink=leaves[3], scale=DIM**-0.5)  # fmt: skip
        out.backward(grad)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["select", "attention"])
    parser.add_argument("--launches", type=int, default=5, help="launches of each kernel (ncu picks one)")
    parser.add_argument("--ratio", type=int, default=1, choices=[1, 2], help="select: the V4.1 compression ratio")
    parser.add_argument("--radix", action="store_true", help="select: the radix select instead of the vector select")
    parser.add_argument("--first-row", type=int, default=16384, help="select: the chunk's first query row")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_kernels.py needs a CUDA GPU (Hopper): it runs the TileLang kernels")
    if args.kernel == "select":
        select_workload(args.launches, args.ratio, args.radix, args.first_row)
    else:
        attention_workload(args.launches)


if __name__ == "__main__":
    main()
