"""Top-k selection at long context on the H200: streaming (no [B, S, K] matrix) vs materialising.

    python examples/benchmark_selection.py --out selection.json
    python examples/benchmark_selection.py --sizes 32768 --reps 5 --check

Shapes: H=64 index heads, D=128, R=4, T=512, causal, B=1, K = S/4. Rows per S:
- ``nemo_dsa scores only v4`` / ``v41``: the scoring kernel alone (the [S, K] matrix is its
  output), the yardstick of the "scores + top-k within 1.3x of scores only" target;
- ``nemo_dsa stream v4`` / ``v41``: ``v4_select_topk`` / ``v41_select_topk`` (TileLang scorers,
  chunked so that the selection transients fit ``--chunk-mib``);
- ``nemo_dsa materialise v4`` / ``v41``: the full-matrix kernel, then ``select_topk`` (the
  TileLang radix select; ``--check`` also compares with the torch reference selection);
- ``built-in v4`` / ``v41`` (nemo-automodel 0.7.0, imported here only): ``batched_indexer_fwd``
  logits / ``indexer_scores`` with a dense allowed mask, then ``torch.topk`` (no tie rule).
Times are medians of CUDA-event timings after one warm-up call (compiles): "ms" synchronises
before each call (so it holds the host's work before the first kernel), "queued ms" times calls
enqueued back to back (the GPU's time, as inside a training step). "extra" memory is the
peak allocation during the call beyond what was allocated before it (inputs, the built-in's dense
mask) and the call's outputs. Rows that do not fit report OOM. JSON to --out, table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

HEADS, DIM, RATIO, TOPK = 64, 128, 4, 512


def _inputs(seq: int, w_dtype: torch.dtype, seed: int = 0):
    from nemo_dsa.visibility import causal_ks_ke

    g = torch.Generator(device="cuda").manual_seed(seed)
    num_keys = seq // RATIO
    q = torch.randn(1, seq, HEADS, DIM, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, num_keys, DIM, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1, seq, HEADS, device="cuda", generator=g) * (DIM**-0.5 * HEADS**-0.5)).to(w_dtype)
    ks, ke = causal_ks_ke(1, seq, num_keys, RATIO, q.device)
    return q, k, w, ks, ke


def _rows(chunk_bytes: int):
    """name -> (w dtype, needs dense mask, fn(q, k, w, ks, ke, allowed) -> outputs)."""
    from nemo_dsa.ops.fused_selection import v4_select_topk, v41_select_topk
    from nemo_dsa.ops.topk import pytorch_extract_topk_scores, select_topk

    def stream_v4(q, k, w, ks, ke, allowed):
        return v4_select_topk(q, k, w, ks, ke, TOPK, backend="tilelang", chunk_bytes=chunk_bytes)

    def stream_v41(q, k, w, ks, ke, allowed):
        return v41_select_topk(q, k, w, ks, ke, TOPK, backend="tilelang", chunk_bytes=chunk_bytes)

    def scores_v4(q, k, w, ks, ke, allowed):
        from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang

        return v4_logits_tilelang(q, k, w, ks, ke)

    def scores_v41(q, k, w, ks, ke, allowed):
        from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

        return v41_scores_tilelang(q, k, w, ks, ke)

    def full_v4(q, k, w, ks, ke, allowed):
        from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang

        logits = v4_logits_tilelang(q, k, w, ks, ke)
        index = select_topk(logits, TOPK, ks=ks, ke=ke)
        return pytorch_extract_topk_scores(logits, index), index

    def full_v41(q, k, w, ks, ke, allowed):
        from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

        return select_topk(v41_scores_tilelang(q, k, w, ks, ke), TOPK, order="index", ks=ks, ke=ke)

    def builtin_v4(q, k, w, ks, ke, allowed):
        from nemo_automodel.components.models.deepseek_v4.kernels.tilelang_indexer_fwd import batched_indexer_fwd

        logits = batched_indexer_fwd(q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1).contiguous(), ks[0], ke[0])
        return torch.topk(logits, min(TOPK, k.shape[1]), dim=-1)

    def builtin_v41(q, k, w, ks, ke, allowed):
        from nemo_automodel.components.models.deepseek_v41.indexer import indexer_scores

        scores = indexer_scores(q, k, w, allowed)
        return torch.topk(scores, min(TOPK, k.shape[1]), dim=-1).indices.sort(dim=-1).values

    return {
        "nemo_dsa scores only v4": (torch.float32, False, scores_v4),
        "nemo_dsa scores only v41": (torch.bfloat16, False, scores_v41),
        "nemo_dsa stream v4": (torch.float32, False, stream_v4),
        "nemo_dsa stream v41": (torch.bfloat16, False, stream_v41),
        "nemo_dsa materialise v4": (torch.float32, False, full_v4),
        "nemo_dsa materialise v41": (torch.bfloat16, False, full_v41),
        "built-in v4 + torch.topk": (torch.float32, False, builtin_v4),
        "built-in v41 + torch.topk": (torch.bfloat16, True, builtin_v41),
    }


def _reference_selection(q, k, w, ks, ke, dtype):
    """The torch reference selection (select_topk_reference) on the same kernel's full scores."""
    from nemo_dsa.ops.topk import select_topk_reference
    from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang
    from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

    if dtype == torch.float32:
        return select_topk_reference(v4_logits_tilelang(q, k, w, ks, ke), TOPK)
    return select_topk_reference(v41_scores_tilelang(q, k, w, ks, ke), TOPK, order="index")


def _nbytes(result) -> int:
    tensors = result if isinstance(result, tuple) else (result,)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _measure(fn, args, reps: int) -> dict:
    fn(*args)  # warm-up: TileLang compiles on first use
    torch.cuda.synchronize()
    times, extra = [], 0
    for _ in range(reps):
        # The allocator keeps its cached blocks between calls, as in training (the peak counts
        # allocated bytes, not reserved ones, so it does not need them freed).
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        extra = max(extra, torch.cuda.max_memory_allocated() - before - _nbytes(result))
        del result
    # The same calls queued back to back, as in a training step: the host prepares the next call
    # while the GPU runs this one, so the time between a call's events is the GPU's alone (the
    # synchronised time above also holds the host work before a call's first kernel).
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps + 1)]
    for start, end in events:
        start.record()
        fn(*args)
        end.record()
    torch.cuda.synchronize()
    queued = [start.elapsed_time(end) for start, end in events[1:]]  # the first starts on an idle GPU
    return {"ms": statistics.median(times), "queued_ms": statistics.median(queued), "extra_mib": extra / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-mib", type=int, default=512)
    parser.add_argument("--check", action="store_true", help="streaming indices == materialising indices")
    parser.add_argument("--out", default="selection_benchmark.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_selection.py needs a CUDA GPU (Hopper): it times the TileLang kernels")
    rows = _rows(args.chunk_mib * 2**20)
    results = []
    for seq in args.sizes:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, w, ks, ke = _inputs(seq, dtype)
            allowed = None
            for name, (w_dtype, dense, fn) in rows.items():
                if w_dtype != dtype:
                    continue
                entry = {"S": seq, "K": seq // RATIO, "row": name}
                try:
                    if dense and allowed is None:  # the built-in V4.1 API's input, not counted as extra
                        keys = torch.arange(k.shape[1], device="cuda")
                        allowed = (keys >= ks[..., None]) & (keys < ke[..., None])
                    entry.update(_measure(fn, (q, k, w, ks, ke, allowed), args.reps))
                except torch.OutOfMemoryError:
                    entry.update({"ms": None, "extra_mib": None, "note": "OOM"})
                torch.cuda.empty_cache()
                results.append(entry)
                print(json.dumps(entry), flush=True)
            if args.check:
                stream = rows[f"nemo_dsa stream {'v4' if dtype == torch.float32 else 'v41'}"][2]
                full = rows[f"nemo_dsa materialise {'v4' if dtype == torch.float32 else 'v41'}"][2]
                a, b = stream(q, k, w, ks, ke, None), full(q, k, w, ks, ke, None)
                same = all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else torch.equal(a, b)
                kernel_index = b[1] if isinstance(b, tuple) else b
                del a, b
                reference = _reference_selection(q, k, w, ks, ke, dtype)
                results.append({"S": seq, "row": f"check {dtype}", "streaming_equals_materialising": same,
                                "kernel_equals_reference": torch.equal(kernel_index, reference)})
                print(json.dumps(results[-1]), flush=True)
                del kernel_index, reference
            del q, k, w, ks, ke, allowed
            torch.cuda.empty_cache()
    with open(args.out, "w") as handle:
        json.dump({"heads": HEADS, "dim": DIM, "ratio": RATIO, "topk": TOPK, "chunk_mib": args.chunk_mib,
                   "device": torch.cuda.get_device_name(), "results": results}, handle, indent=1)
    print(f"\n| S | K | row | median ms | queued ms | extra MiB |\n|---|---|---|---|---|---|")
    for r in results:
        if "ms" in r:
            ms = "OOM" if r["ms"] is None else f"{r['ms']:.2f}"
            queued = "-" if r.get("queued_ms") is None else f"{r['queued_ms']:.2f}"
            mib = "-" if r["extra_mib"] is None else f"{r['extra_mib']:.0f}"
            print(f"| {r['S']} | {r['K']} | {r['row']} | {ms} | {queued} | {mib} |")
        else:
            print(f"| {r['S']} | | {r['row']} | streamed == materialised: {r['streaming_equals_materialising']}, "
                  f"kernel == reference: {r['kernel_equals_reference']} | | |")
    _print_ratios(results)


def _print_ratios(results: list[dict]) -> None:
    """Streamed scores + top-k against the scores alone and against the built-in path, per S,
    synchronised and queued."""
    for column in ("ms", "queued_ms"):
        times = {(r["S"], r["row"]): r[column] for r in results if r.get(column)}
        for seq in sorted({r["S"] for r in results}):
            for mode in ("v4", "v41"):
                stream = times.get((seq, f"nemo_dsa stream {mode}"))
                scores = times.get((seq, f"nemo_dsa scores only {mode}"))
                builtin = times.get((seq, f"built-in {mode} + torch.topk"))
                if stream is None:
                    continue
                parts = [f"{column:9s} S={seq} {mode}: streamed scores + top-{TOPK} {stream:.2f} ms"]
                if scores:
                    parts.append(f"{stream / scores:.2f}x the scores alone ({scores:.2f} ms)")
                if builtin:
                    parts.append(f"{builtin / stream:.2f}x faster than built-in + torch.topk ({builtin:.2f} ms)")
                print("; ".join(parts))


if __name__ == "__main__":
    main()
