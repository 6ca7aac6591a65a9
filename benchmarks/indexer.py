"""Indexer benchmark on one Hopper GPU: nemo_dsa's TileLang kernels vs nemo-automodel's built-in ones.

Ops, all at H index heads, index dim D, compression ratio R, causal (plus B = 2 and a packed row):
- ``v4_fwd``:   V4 fp32 logits [B, S, K] (built-in ``batched_indexer_fwd`` with its causal ks/ke
                vs ``nemo_dsa.ops.v4_indexer.kernels.v4_logits_tilelang``);
- ``v4_train``: V4 forward + top-k + backward (built-in ``v4_lighting_indexer`` vs
                ``nemo_dsa.v4_lighting_indexer``, streamed selection (the CUDA default) and
                ``full``: the materialised [B, S, K] logits), gradients of the gathered scores;
- ``v41``:      V4.1 frozen bf16 scores (built-in ``indexer_scores`` with its dense mask vs
                ``nemo_dsa.indexer_scores`` with ks/ke and with the same dense mask).

Reports the median of CUDA-event timings after warm-up, TFLOP/s on the visible (causal) work,
the peak extra memory (torch.cuda.max_memory_allocated delta) and the speed-up over the built-in.
The built-in code is imported only here. Run on the GPU machine, e.g.

    python benchmarks/indexer.py --quick --out results.json
"""

import argparse
import json
import statistics
import sys
import time

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384, 32768, 65536], help="query lengths S (B = 1, causal)")
    p.add_argument("--quick", action="store_true", help="S in {4096, 16384}, fewer repetitions")
    p.add_argument("--ops", nargs="+", default=["v4_fwd", "v4_train", "v41"], choices=["v4_fwd", "v4_train", "v41"])
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--ratio", type=int, default=4)
    p.add_argument("--topk", type=int, default=512)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--extra-seqlen", type=int, default=16384, help="S of the B = 2 and packed rows (0 = skip them)")
    p.add_argument("--out", default="indexer.json", help="JSON results file")
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens, args.reps, args.extra_seqlen = [4096, 16384], 8, 4096
    return args


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------


def measure(fn, reps: int, warmup: int) -> dict:
    """Median milliseconds of ``fn`` over ``reps`` CUDA-event timings, and its peak extra memory."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"ms": statistics.median(times), "peak_mib": (torch.cuda.max_memory_allocated() - base) / 2**20}


# ----------------------------------------------------------------------------------------------
# Problems
# ----------------------------------------------------------------------------------------------


def make_case(seq_len: int, batch: int, layout: str, args, seed: int = 0) -> dict:
    """Inputs in nemo_dsa's BSHD layout plus the visibility (ks, ke) of ``layout``."""
    from nemo_dsa.metadata import build_attention_metadata
    from nemo_dsa.visibility import causal_ks_ke

    H, D, R = args.heads, args.dim, args.ratio
    num_keys = seq_len // R
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seq_len, H, D, device="cuda", generator=g).bfloat16()
    k = torch.randn(batch, num_keys, D, device="cuda", generator=g).bfloat16()
    w = torch.randn(batch, seq_len, H, device="cuda", generator=g) * (H * D) ** -0.5
    if layout == "causal":
        ks, ke = causal_ks_ke(batch, seq_len, num_keys, R, torch.device("cuda"))
    else:  # packed: documents of unaligned lengths, the last one filling the row
        lengths, left = [], seq_len
        rng = torch.Generator().manual_seed(seed)
        while left > 0:
            n = min(left, int(torch.randint(seq_len // 16, seq_len // 3, (1,), generator=rng)) | 1)
            lengths.append(n)
            left -= n
        meta = build_attention_metadata(compress_ratio=R, seq_lens=torch.tensor([lengths] * batch))
        ks, ke = meta.ks.cuda(), meta.ke.cuda()
    return {"q": q, "k": k, "w": w, "ks": ks, "ke": ke, "S": seq_len, "B": batch, "K": num_keys, "layout": layout}


def visible_pairs(case) -> float:
    return float((case["ke"] - case["ks"]).clamp_min(0).sum())


def flops(op: str, case, args) -> float:
    """FLOPs of the visible work: 2*H*D per visible (query, key); backward 3 products per top-k key."""
    per_pair = 2 * args.heads * args.dim
    fwd = per_pair * visible_pairs(case)
    if op != "v4_train":
        return fwd
    selected = float((case["ke"] - case["ks"]).clamp(0, args.topk).sum())
    return fwd + 3 * per_pair * selected


# ----------------------------------------------------------------------------------------------
# Implementations: each returns a zero-argument callable for one case
# ----------------------------------------------------------------------------------------------


def builtin_v4_fwd(case, args):
    from nemo_automodel.components.models.deepseek_v4.kernels.tilelang_indexer_fwd import (
        _make_causal_cu_seqlens,
        batched_indexer_fwd,
    )

    if case["layout"] != "causal":
        raise NotImplementedError("the built-in API takes one causal ks/ke for the whole batch")
    q, k, w = case["q"].transpose(0, 1).contiguous(), case["k"].transpose(0, 1).contiguous(), case["w"].transpose(0, 1).contiguous()
    cu_ks, cu_ke = _make_causal_cu_seqlens(case["S"], case["K"], args.ratio, q.device)
    return lambda: batched_indexer_fwd(q, k, w, cu_ks, cu_ke)


def ours_v4_fwd(case, args):
    from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang

    q, k, w, ks, ke = case["q"], case["k"], case["w"], case["ks"], case["ke"]
    return lambda: v4_logits_tilelang(q, k, w, ks, ke)


def _train_step(indexer, case, args, **kwargs):
    q = case["q"].transpose(0, 1).contiguous().requires_grad_()
    k = case["k"].transpose(0, 1).contiguous().requires_grad_()
    w = case["w"].transpose(0, 1).contiguous().requires_grad_()

    def step():
        score, _ = indexer(q, k, w, args.ratio, args.topk, **kwargs)
        # -inf scores (queries seeing fewer than top-k keys) get no gradient in both versions.
        torch.autograd.backward(score, torch.ones_like(score))
        q.grad = k.grad = w.grad = None

    return step


def builtin_v4_train(case, args):
    from nemo_automodel.components.models.deepseek_v4.kernels.tilelang_indexer import v4_lighting_indexer

    if case["layout"] != "causal":
        raise NotImplementedError("the built-in API derives causal visibility itself")
    return _train_step(v4_lighting_indexer, case, args)


def ours_v4_train(case, args, fused_topk=True):
    import nemo_dsa

    return _train_step(nemo_dsa.v4_lighting_indexer, case, args, ks=case["ks"], ke=case["ke"], fused_topk=fused_topk)


def ours_v4_train_materialised(case, args):
    return ours_v4_train(case, args, fused_topk=False)


def _dense_mask(case):
    from nemo_dsa.visibility import visible_mask

    if "allowed" not in case:
        case["allowed"] = visible_mask(case["ks"], case["ke"], case["K"])
    return case["allowed"]


def builtin_v41(case, args):
    from nemo_automodel.components.models.deepseek_v41.indexer import indexer_scores

    q, k, w, allowed = case["q"], case["k"], case["w"].bfloat16(), _dense_mask(case)
    return lambda: indexer_scores(q, k, w, allowed)


def ours_v41_ranges(case, args):
    import nemo_dsa

    q, k, w, ks, ke = case["q"], case["k"], case["w"].bfloat16(), case["ks"], case["ke"]
    return lambda: nemo_dsa.indexer_scores(q, k, w, ks=ks, ke=ke, backend="tilelang")


def ours_v41_mask(case, args):
    import nemo_dsa

    q, k, w, allowed = case["q"], case["k"], case["w"].bfloat16(), _dense_mask(case)
    return lambda: nemo_dsa.indexer_scores(q, k, w, allowed, backend="tilelang")


# op -> [(implementation name, factory)], the built-in first (the speed-up reference)
IMPLEMENTATIONS = {
    "v4_fwd": [("built-in", builtin_v4_fwd), ("nemo_dsa", ours_v4_fwd)],
    "v4_train": [("built-in", builtin_v4_train), ("nemo_dsa", ours_v4_train), ("nemo_dsa full", ours_v4_train_materialised)],
    "v41": [("built-in", builtin_v41), ("nemo_dsa ks/ke", ours_v41_ranges), ("nemo_dsa mask", ours_v41_mask)],
}


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def run_case(op: str, case, args) -> list[dict]:
    rows, reference_ms = [], None
    for name, factory in IMPLEMENTATIONS[op]:
        row = {"op": op, "impl": name, "S": case["S"], "B": case["B"], "K": case["K"], "layout": case["layout"],
               "H": args.heads, "D": args.dim}
        try:
            fn = factory(case, args)
            started = time.time()
            fn()  # first call compiles (not timed)
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.time() - started, 2)
            row.update(measure(fn, args.reps, args.warmup))
            row["tflops"] = flops(op, case, args) / row["ms"] / 1e9
            if name == "built-in":
                reference_ms = row["ms"]
            elif reference_ms is not None:
                row["speedup"] = reference_ms / row["ms"]
        except torch.cuda.OutOfMemoryError:
            row["skipped"] = "out of memory"
        except Exception as error:  # a baseline that fails is reported, not fatal
            row["skipped"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
        torch.cuda.empty_cache()
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    head = f"{row['op']:<9}{row['impl']:<16}S={row['S']:<6}B={row['B']} {row['layout']:<7}"
    if "skipped" in row:
        return f"{head} skipped ({row['skipped']})"
    speed = f"{row['speedup']:5.2f}x" if "speedup" in row else "   -  "
    return f"{head}{row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s {row['peak_mib']:9.0f} MiB {speed}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    cases = [(s, 1, "causal") for s in args.seqlens]
    if args.extra_seqlen:
        cases += [(args.extra_seqlen, 2, "causal"), (args.extra_seqlen, 1, "packed")]
    print(f"{torch.cuda.get_device_name()}  H={args.heads} D={args.dim} R={args.ratio} topk={args.topk} reps={args.reps}")
    results = []
    for seq_len, batch, layout in cases:
        try:
            case = make_case(seq_len, batch, layout, args)
        except torch.cuda.OutOfMemoryError:
            print(f"S={seq_len} B={batch} {layout}: inputs do not fit, skipped")
            continue
        for op in args.ops:
            results += run_case(op, case, args)
        del case
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "results": results}, f, indent=1)
    print(f"\n{'op':<9}{'impl':<16}{'case':<23}{'median':>12} {'visible':>15} {'peak':>13} {'vs built-in':>6}")
    for row in results:
        print(format_row(row))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
