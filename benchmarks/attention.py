"""Sparse window + compressed attention: nemo_dsa's kernels against nemo-automodel's built-in
``sparse_attn_tilelang`` on the same inputs (H200, V4-Flash shapes: H = 64, D = 512, window 128,
top-512 of ratio-4 compressed rows, B = 1, one document).

The built-in takes one index list into a concatenated [raw; compressed] kv, so it gets the window
as 128 indices per query; nemo_dsa reads the window by position. Both sides: median of CUDA-event
timings, forward and forward + backward, TFLOP/s on the visible work (4 * D per visible (query,
head, key) forward, 14 * D forward + backward), peak memory above the inputs. Prints a table and
writes JSON (``--json``).

    python benchmarks/attention.py --seq 4096 16384 32768 65536 --json out.json

``--parts`` also times the backward's pieces alone (the kernels asked for only some gradients),
to show where its time goes.
"""

import argparse
import json

import torch

from nemo_dsa.ops.sparse_attention import attend

HEADS, DIM, WINDOW, TOPK, RATIO = 64, 512, 128, 512, 4


def make_inputs(seq: int, seed: int = 0, topk: int = TOPK):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    num_comp = seq // RATIO
    q = torch.randn(1, seq, HEADS, DIM, device=dev, generator=gen).bfloat16()
    raw = torch.randn(1, seq, DIM, device=dev, generator=gen).bfloat16()
    comp = torch.randn(1, num_comp, DIM, device=dev, generator=gen).bfloat16()
    sink = torch.randn(HEADS, device=dev, generator=gen)
    # Top-512 of random scores over each query's causally visible compressed rows (j < (i+1)/R).
    indices = torch.full((1, seq, max(topk, 1)), -1, dtype=torch.int32, device=dev)
    for start in range(0, seq, 4096):
        rows = torch.arange(start, min(seq, start + 4096), device=dev)
        visible = torch.arange(num_comp, device=dev)[None] < ((rows + 1) // RATIO)[:, None]
        scores = torch.rand(rows.numel(), num_comp, device=dev, generator=gen).masked_fill(~visible, -1.0)
        k = min(topk, num_comp)
        if k == 0:
            continue
        top = scores.topk(k, dim=-1)
        chosen = torch.where(top.values >= 0, top.indices, -1).to(torch.int32)
        indices[0, rows, :k] = chosen
    window_start = torch.zeros(1, seq, dtype=torch.int32, device=dev)
    return q, raw, comp, sink, indices, window_start


def builtin_indices(seq: int, indices: torch.Tensor) -> torch.Tensor:
    """[1, S, 128 + 512]: the window as raw rows i-127..i (-1 before 0), then seq + compressed."""
    own = torch.arange(seq, device=indices.device)
    window = own[:, None] - WINDOW + 1 + torch.arange(WINDOW, device=indices.device)
    window = torch.where(window >= 0, window, -1).to(torch.int32)[None]
    selected = torch.where(indices >= 0, indices + seq, -1).to(torch.int32)
    return torch.cat((window, selected), dim=-1).contiguous()


def visible_pairs(seq: int, indices: torch.Tensor) -> int:
    window = torch.clamp(torch.arange(seq, device=indices.device) + 1, max=WINDOW).sum()
    return int(window + (indices >= 0).sum())


def median_ms(fn, iters: int) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def backward_parts(q, raw, comp, sink, indices, window_start, grad, iters: int) -> dict:
    """ms of the backward alone (forward saved once), asking the kernels for some gradients."""
    from nemo_dsa.ops.sparse_attention import kernels

    inputs = kernels.KernelInputs(q, raw, window_start, WINDOW, comp, indices, None, None, sink, DIM**-0.5)
    out, lse = kernels.sparse_window_forward(inputs)
    parts = {
        "all": (True, True, True),
        "dq only (no dkv GEMMs, no atomics)": (True, False, False),
        "dq + compressed dkv (window dkv skipped)": (True, False, True),
        "window dkv alone": (False, True, False),
        "delta alone": (False, False, False),
    }
    return {
        name: median_ms(
            lambda: kernels.sparse_window_backward(inputs, out, lse, grad, need_dq=dq, need_d_raw=d_raw, need_d_comp=d_comp),
            iters,
        )
        for name, (dq, d_raw, d_comp) in parts.items()
    }


def run(seq: int, iters: int, ours_only: bool = False, parts: bool = False, topk: int = TOPK) -> dict:
    from nemo_automodel.components.models.deepseek_v4.kernels.sparse_attention import sparse_attn_tilelang

    q, raw, comp, sink, indices, window_start = make_inputs(seq, topk=topk)
    scale = DIM**-0.5
    kv_cat = torch.cat((raw, comp), dim=1).contiguous()
    idx_cat = builtin_indices(seq, indices)
    grad = torch.randn_like(q)
    pairs = visible_pairs(seq, indices) * HEADS
    leaves = [t.clone().requires_grad_(True) for t in (q, raw, comp, sink)]
    kv_leaf, q_leaf, sink_leaf = kv_cat.clone().requires_grad_(True), q.clone().requires_grad_(True), sink.clone().requires_grad_(True)

    # As the attention layer calls the op (``attend``): its own selection needs no range check
    # (the public op reads the indices' range on the host, one sync a call; the built-in checks nothing).
    def ours_fwd():
        with torch.no_grad():
            return attend(q, raw, window_start, WINDOW, comp, indices=indices, sink=sink, scale=scale)

    def ours_fwd_bwd():
        for t in leaves:
            t.grad = None
        out, _ = attend(leaves[0], leaves[1], window_start, WINDOW, leaves[2], indices=indices, sink=leaves[3], scale=scale)
        out.backward(grad)

    def builtin_fwd():
        with torch.no_grad():
            return sparse_attn_tilelang(q, kv_cat, sink, idx_cat, scale)

    def builtin_fwd_bwd():
        for t in (q_leaf, kv_leaf, sink_leaf):
            t.grad = None
        sparse_attn_tilelang(q_leaf, kv_leaf, sink_leaf, idx_cat, scale).backward(grad)

    row = {"seq": seq, "topk": topk, "visible_pairs": pairs}
    if not ours_only:  # same answer on the same inputs (bf16 both sides)
        ours_out = ours_fwd()[0].float()
        theirs_out = builtin_fwd().float()
        row["out_rel_diff_vs_builtin"] = float((ours_out - theirs_out).norm() / theirs_out.norm())
        del ours_out, theirs_out
    cases = [("ours_fwd", ours_fwd, 4 * DIM), ("builtin_fwd", builtin_fwd, 4 * DIM),
             ("ours_fwd_bwd", ours_fwd_bwd, 14 * DIM), ("builtin_fwd_bwd", builtin_fwd_bwd, 14 * DIM)]
    for name, fn, flop_per_pair in cases:
        if ours_only and name.startswith("builtin"):
            continue
        try:
            ms = median_ms(fn, iters)
            row[name + "_ms"] = ms
            row[name + "_tflops"] = pairs * flop_per_pair / ms / 1e9
            row[name + "_peak_mib"] = peak_mib(fn)
        except torch.cuda.OutOfMemoryError:
            row[name + "_ms"] = None
            torch.cuda.empty_cache()
    if parts:
        row["backward_parts_ms"] = backward_parts(q, raw, comp, sink, indices, window_start, grad, iters)
    for kind in ("fwd", "fwd_bwd"):
        if row.get(f"ours_{kind}_ms") and row.get(f"builtin_{kind}_ms"):
            row[f"speedup_{kind}"] = row[f"builtin_{kind}_ms"] / row[f"ours_{kind}_ms"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--ours-only", action="store_true", help="skip the built-in (and its compile)")
    parser.add_argument("--parts", action="store_true", help="also time the backward's pieces")
    parser.add_argument("--topk", type=int, default=TOPK,
                        help="compressed entries a query selects (0: window only): the forward's time against its"
                             " tile count separates the per-query cost from the per-tile cost")
    args = parser.parse_args()
    rows = []
    for seq in args.seq:
        rows.append(run(seq, args.iters, args.ours_only, args.parts, args.topk))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    print("| S | fwd ours | fwd built-in | ratio | TFLOP/s ours / built-in | fwd+bwd ours | fwd+bwd built-in | ratio | TFLOP/s ours / built-in | peak MiB fwd+bwd ours / built-in |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def f(r, key, spec):
        """'-' for a side that was not run (--ours-only), OOM for one that ran out of memory."""
        if key not in r:
            return "-"
        return "OOM" if r[key] is None else format(r[key], spec)

    for r in rows:
        print(
            f"| {r['seq']} | {f(r, 'ours_fwd_ms', '.2f')} ms | {f(r, 'builtin_fwd_ms', '.2f')} ms | "
            f"{f(r, 'speedup_fwd', '.2f')}x | {f(r, 'ours_fwd_tflops', '.0f')} / {f(r, 'builtin_fwd_tflops', '.0f')} | "
            f"{f(r, 'ours_fwd_bwd_ms', '.1f')} ms | {f(r, 'builtin_fwd_bwd_ms', '.1f')} ms | {f(r, 'speedup_fwd_bwd', '.2f')}x | "
            f"{f(r, 'ours_fwd_bwd_tflops', '.0f')} / {f(r, 'builtin_fwd_bwd_tflops', '.0f')} | "
            f"{f(r, 'ours_fwd_bwd_peak_mib', '.0f')} / {f(r, 'builtin_fwd_bwd_peak_mib', '.0f')} |"
        )
    for r in rows:
        if "backward_parts_ms" in r:
            print(f"\nbackward alone, S = {r['seq']} (forward saved once):")
            for name, ms in r["backward_parts_ms"].items():
                print(f"  {name}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
