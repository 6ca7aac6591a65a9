"""Top-k selection at long context on the H200: streaming (no [B, S, K] matrix) vs materialising.

    python benchmarks/selection.py --out selection.json
    python benchmarks/selection.py --sizes 32768 --reps 5 --check
    python benchmarks/selection.py --shapes v41 --sizes 32768 --v41-ratios 1 2 --check
    python benchmarks/selection.py --shapes v41 --sizes 131072 --v41-ratios 1 --builtin-max-seq 65536

Shapes: H=64 index heads, D=128, R=4, T=512, causal, B=1, K = S/4. Rows per S:
- ``nemo_dsa scores only v4`` / ``v41``: the scoring kernel alone (the [S, K] matrix is its
  output), the yardstick of the "scores + top-k within 1.3x of scores only" target;
- ``nemo_dsa stream v4`` / ``v41``: ``v4_select_topk_in_ranges`` / ``v41_select_topk_in_ranges``
  as the indexer layers call them (TileLang scorers, chunked so that the selection transients fit
  ``--chunk-mib``; the ranges made once per S, as the metadata's are once per step);
- ``nemo_dsa materialise v4`` / ``v41``: the full-matrix kernel, then ``select_topk`` (the
  TileLang radix select; ``--check`` also compares with the torch reference selection);
- ``built-in v4`` / ``v41`` (nemo-automodel 0.7.0, imported here only): ``batched_indexer_fwd``
  logits / ``indexer_scores`` with a dense allowed mask, then ``torch.topk`` (no tie rule).
``--shapes v41``: the released DeepSeek-V4.1 indexer, H=32 index heads of D=128 (MXFP4-rounded q
and k), T=512, causal, B=1, each ratio of ``--v41-ratios`` (1: K = S, 2: K = S/2), candidate
blocks of 8, 2048 kept. Rows: the scores alone; streamed (the vector select); streamed reindex
layers masked by candidate blocks (the vector select reads the kept blocks from their list); the
streamed candidate-source layer (S <= 65,536); materialised; built-in ``indexer_scores`` +
torch.topk (S <= ``--builtin-max-seq``).
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
V41_HEADS, V41_BLOCK_SIZE, V41_TOPK_BLOCKS = 32, 8, 2048


def _inputs(seq: int, w_dtype: torch.dtype, seed: int = 0):
    from nemo_dsa.visibility import KeyRanges, causal_ks_ke

    g = torch.Generator(device="cuda").manual_seed(seed)
    num_keys = seq // RATIO
    q = torch.randn(1, seq, HEADS, DIM, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, num_keys, DIM, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1, seq, HEADS, device="cuda", generator=g) * (DIM**-0.5 * HEADS**-0.5)).to(w_dtype)
    return q, k, w, KeyRanges(*causal_ks_ke(1, seq, num_keys, RATIO, q.device), num_keys)


def _v41_inputs(seq: int, ratio: int, seed: int = 0):
    """The V4.1 indexer's operands: MXFP4-rounded q [1, S, 32, 128] and k [1, K, 128], bf16 head
    weights, causal ranges; a second q / w for a reindex layer on the same keys."""
    from nemo_dsa.ops.quant import mxfp4_quant_dequant
    from nemo_dsa.visibility import KeyRanges, causal_ks_ke

    g = torch.Generator(device="cuda").manual_seed(seed)
    num_keys = seq // ratio
    q, q2 = (mxfp4_quant_dequant(torch.randn(1, seq, V41_HEADS, DIM, device="cuda", generator=g).bfloat16()) for _ in range(2))
    k = mxfp4_quant_dequant(torch.randn(1, num_keys, DIM, device="cuda", generator=g).bfloat16())
    w, w2 = ((torch.randn(1, seq, V41_HEADS, device="cuda", generator=g) * (DIM**-0.5 * V41_HEADS**-0.5)).bfloat16() for _ in range(2))
    return q, q2, k, w, w2, KeyRanges(*causal_ks_ke(1, seq, num_keys, ratio, q.device), num_keys)


def _v41_rows(chunk_bytes: int):
    """name -> (fn(inputs, blocks, allowed) -> outputs, needs dense mask, longest S or None)."""
    from nemo_dsa.ops.fused_selection import v41_select_topk_in_ranges
    from nemo_dsa.ops.topk import select_topk
    from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

    def stream(inputs, blocks, allowed, budget=chunk_bytes):
        q, _, k, w, _, ranges = inputs
        return v41_select_topk_in_ranges(q, k, w, ranges, TOPK, "tilelang", budget)

    def reindex(inputs, blocks, allowed):
        _, q2, k, _, w2, ranges = inputs
        return v41_select_topk_in_ranges(q2, k, w2, ranges, TOPK, "tilelang", chunk_bytes, candidate_block_size=V41_BLOCK_SIZE,
                                         candidate_blocks=blocks, blocks_from_source=True)  # fmt: skip

    def source(inputs, blocks, allowed):
        q, _, k, w, _, ranges = inputs
        return v41_select_topk_in_ranges(q, k, w, ranges, TOPK, "tilelang", chunk_bytes, candidate_block_size=V41_BLOCK_SIZE,
                                         candidate_topk_blocks=V41_TOPK_BLOCKS)  # fmt: skip

    def scores(inputs, blocks, allowed):
        q, _, k, w, _, ranges = inputs
        return v41_scores_tilelang(q, k, w, ranges.ks, ranges.ke)

    def full(inputs, blocks, allowed):
        q, _, k, w, _, ranges = inputs
        return select_topk(v41_scores_tilelang(q, k, w, ranges.ks, ranges.ke), TOPK, order="index", ks=ranges.ks, ke=ranges.ke)

    def builtin(inputs, blocks, allowed):
        from nemo_automodel.components.models.deepseek_v41.indexer import indexer_scores

        q, _, k, w, _, _ = inputs
        dense = indexer_scores(q, k, w, allowed)
        return torch.topk(dense, min(TOPK, k.shape[1]), dim=-1).indices.sort(dim=-1).values

    return {
        "nemo_dsa scores only v41": (scores, False, None),
        "nemo_dsa stream v41": (stream, False, None),
        "nemo_dsa stream v41, 1 GiB chunks": (lambda *a: stream(*a, budget=2**30), False, None),
        "nemo_dsa stream v41 reindex": (reindex, False, None),
        "nemo_dsa stream v41 candidate source": (source, False, 65536),
        "nemo_dsa materialise v41": (full, False, 65536),
        "built-in v41 + torch.topk": (builtin, True, None),
    }


def _row_matches(name: str, part: str) -> bool:
    """``--v41-rows`` filter: ``=name`` matches that row only, anything else any row containing it."""
    return name == part[1:] if part.startswith("=") else part in name


def _run_v41(args, results: list) -> None:
    """The V4.1 indexer shapes: every row of ``_v41_rows`` per S and ratio."""
    rows = _v41_rows(args.chunk_mib * 2**20)
    for seq in args.sizes:
        for ratio in args.v41_ratios:
            inputs = _v41_inputs(seq, ratio)
            q, _, k, w, _, ranges = inputs
            ks, ke = ranges.ks, ranges.ke
            blocks = rows["nemo_dsa stream v41 candidate source"][0](inputs, None, None)[1]
            allowed = None
            for name, (fn, dense, longest) in rows.items():
                if args.v41_rows is not None and not any(_row_matches(name, part) for part in args.v41_rows):
                    continue
                entry = {"shape": "v41", "S": seq, "K": seq // ratio, "ratio": ratio, "row": name}
                builtin_limit = args.builtin_max_seq if name.startswith("built-in") else None
                if (longest is not None and seq > longest) or (builtin_limit is not None and seq > builtin_limit):
                    continue
                try:
                    if dense and allowed is None:  # the built-in API's input, not counted as extra
                        keys = torch.arange(k.shape[1], device="cuda")
                        allowed = (keys >= ks[..., None]) & (keys < ke[..., None])
                    entry.update(_measure(lambda *a: fn(inputs, blocks, allowed), (), args.reps))
                except torch.OutOfMemoryError:
                    entry.update({"ms": None, "extra_mib": None, "note": "OOM"})
                torch.cuda.empty_cache()
                results.append(entry)
                print(json.dumps(entry), flush=True)
            del allowed
            if args.check:
                results.append(_v41_check(rows, inputs, blocks, seq, ratio))
                print(json.dumps(results[-1]), flush=True)
            del inputs, q, k, w, ranges, ks, ke, blocks
            torch.cuda.empty_cache()


def _v41_check(rows, inputs, blocks, seq: int, ratio: int) -> dict:
    """Streamed == materialised == the torch reference selection on the kernel's scores; the
    reindex layer's and the candidate-source layer's blocks equal their references too."""
    from nemo_dsa.ops.topk import candidate_blocks_reference, select_topk_reference
    from nemo_dsa.ops.v41_indexer import blocks_to_mask
    from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

    q, q2, k, w, w2, ranges = inputs
    ks, ke = ranges.ks, ranges.ke
    stream = rows["nemo_dsa stream v41"][0](inputs, blocks, None)
    same = {
        "streaming_equals_materialising": torch.equal(stream, rows["nemo_dsa materialise v41"][0](inputs, blocks, None)),
        "kernel_equals_reference": torch.equal(stream, select_topk_reference(v41_scores_tilelang(q, k, w, ks, ke), TOPK, order="index")),
    }  # fmt: skip
    reindex = rows["nemo_dsa stream v41 reindex"][0](inputs, blocks, None)
    keep = blocks_to_mask(blocks, ks, ke, V41_BLOCK_SIZE, k.shape[1])
    masked = v41_scores_tilelang(q2, k, w2, ks, ke).masked_fill(~keep, float("-inf"))
    same["reindex_equals_reference"] = torch.equal(reindex, select_topk_reference(masked, TOPK, order="index"))
    if seq <= 65536:  # the candidate-source row's limit
        _, source_blocks = rows["nemo_dsa stream v41 candidate source"][0](inputs, blocks, None)
        scores = v41_scores_tilelang(q, k, w, ks, ke)
        want = candidate_blocks_reference(scores, ks, ke, V41_BLOCK_SIZE, V41_TOPK_BLOCKS)
        same["candidate_blocks_equal_reference"] = torch.equal(source_blocks, want)
    return {"shape": "v41", "S": seq, "ratio": ratio, "row": "check", **same}


def _rows(chunk_bytes: int):
    """name -> (w dtype, needs dense mask, fn(q, k, w, ranges, allowed) -> outputs)."""
    from nemo_dsa.ops.fused_selection import v4_select_topk_in_ranges, v41_select_topk_in_ranges
    from nemo_dsa.ops.topk import pytorch_extract_topk_scores, select_topk

    def stream_v4(q, k, w, ranges, allowed):
        return v4_select_topk_in_ranges(q, k, w, ranges, TOPK, "tilelang", chunk_bytes)

    def stream_v41(q, k, w, ranges, allowed):
        return v41_select_topk_in_ranges(q, k, w, ranges, TOPK, "tilelang", chunk_bytes)

    def scores_v4(q, k, w, ranges, allowed):
        ks, ke = ranges.ks, ranges.ke
        from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang

        return v4_logits_tilelang(q, k, w, ks, ke)

    def scores_v41(q, k, w, ranges, allowed):
        ks, ke = ranges.ks, ranges.ke
        from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

        return v41_scores_tilelang(q, k, w, ks, ke)

    def full_v4(q, k, w, ranges, allowed):
        ks, ke = ranges.ks, ranges.ke
        from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang

        logits = v4_logits_tilelang(q, k, w, ks, ke)
        index = select_topk(logits, TOPK, ks=ks, ke=ke)
        return pytorch_extract_topk_scores(logits, index), index

    def full_v41(q, k, w, ranges, allowed):
        ks, ke = ranges.ks, ranges.ke
        from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

        return select_topk(v41_scores_tilelang(q, k, w, ks, ke), TOPK, order="index", ks=ks, ke=ke)

    def builtin_v4(q, k, w, ranges, allowed):
        ks, ke = ranges.ks, ranges.ke
        from nemo_automodel.components.models.deepseek_v4.kernels.tilelang_indexer_fwd import batched_indexer_fwd

        logits = batched_indexer_fwd(q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1).contiguous(), ks[0], ke[0])
        return torch.topk(logits, min(TOPK, k.shape[1]), dim=-1)

    def builtin_v41(q, k, w, ranges, allowed):
        ks, ke = ranges.ks, ranges.ke
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
    parser.add_argument("--shapes", nargs="+", choices=("v4", "v41"), default=["v4"],
                        help="v4: H=64, R=4 (both scorings); v41: the released V4.1 indexer (H=32, ratios 1 and 2)")
    parser.add_argument("--v41-ratios", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--builtin-max-seq", type=int, default=1 << 30, help="skip the built-in rows above this S")
    parser.add_argument("--v41-rows", nargs="+", default=None,
                        help="V4.1 rows whose name contains one of these strings, or equals one given as =name (default: every row)")  # fmt: skip
    parser.add_argument("--out", default="selection_benchmark.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("selection.py needs a CUDA GPU (Hopper): it times the TileLang kernels")
    rows = _rows(args.chunk_mib * 2**20)
    results = []
    if "v41" in args.shapes:
        _run_v41(args, results)
    for seq in (args.sizes if "v4" in args.shapes else ()):
        for dtype in (torch.float32, torch.bfloat16):
            q, k, w, ranges = _inputs(seq, dtype)
            ks, ke = ranges.ks, ranges.ke
            allowed = None
            for name, (w_dtype, dense, fn) in rows.items():
                if w_dtype != dtype:
                    continue
                entry = {"S": seq, "K": seq // RATIO, "row": name}
                try:
                    if dense and allowed is None:  # the built-in V4.1 API's input, not counted as extra
                        keys = torch.arange(k.shape[1], device="cuda")
                        allowed = (keys >= ks[..., None]) & (keys < ke[..., None])
                    entry.update(_measure(fn, (q, k, w, ranges, allowed), args.reps))
                except torch.OutOfMemoryError:
                    entry.update({"ms": None, "extra_mib": None, "note": "OOM"})
                torch.cuda.empty_cache()
                results.append(entry)
                print(json.dumps(entry), flush=True)
            if args.check:
                stream = rows[f"nemo_dsa stream {'v4' if dtype == torch.float32 else 'v41'}"][2]
                full = rows[f"nemo_dsa materialise {'v4' if dtype == torch.float32 else 'v41'}"][2]
                a, b = stream(q, k, w, ranges, None), full(q, k, w, ranges, None)
                same = all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else torch.equal(a, b)
                kernel_index = b[1] if isinstance(b, tuple) else b
                del a, b
                reference = _reference_selection(q, k, w, ks, ke, dtype)
                results.append({"S": seq, "row": f"check {dtype}", "streaming_equals_materialising": same,
                                "kernel_equals_reference": torch.equal(kernel_index, reference)})
                print(json.dumps(results[-1]), flush=True)
                del kernel_index, reference
            del q, k, w, ranges, ks, ke, allowed
            torch.cuda.empty_cache()
    with open(args.out, "w") as handle:
        json.dump({"heads": HEADS, "dim": DIM, "ratio": RATIO, "topk": TOPK, "chunk_mib": args.chunk_mib,
                   "device": torch.cuda.get_device_name(), "results": results}, handle, indent=1)
    print("\n| shape | S | K | row | median ms | queued ms | extra MiB |\n|---|---|---|---|---|---|---|")
    for r in results:
        shape = r.get("shape", "v4") + (f" R={r['ratio']}" if "ratio" in r else "")
        if "ms" in r:
            ms = "OOM" if r["ms"] is None else f"{r['ms']:.2f}"
            queued = "-" if r.get("queued_ms") is None else f"{r['queued_ms']:.2f}"
            mib = "-" if r["extra_mib"] is None else f"{r['extra_mib']:.0f}"
            print(f"| {shape} | {r['S']} | {r.get('K', '')} | {r['row']} | {ms} | {queued} | {mib} |")
        else:
            checks = ", ".join(f"{k}: {v}" for k, v in r.items() if isinstance(v, bool))
            print(f"| {shape} | {r['S']} | | {r['row']} | {checks} | | |")
    _print_ratios(results)


def _print_ratios(results: list[dict]) -> None:
    """Streamed scores + top-k against the scores alone and against the built-in path, per shape,
    S and ratio, synchronised and queued."""
    for column in ("ms", "queued_ms"):
        times = {(r.get("shape", "v4"), r["S"], r.get("ratio"), r["row"]): r[column] for r in results if r.get(column)}
        for shape, seq, ratio in sorted({key[:3] for key in times}, key=str):
            for mode in ("v4", "v41"):
                scores = times.get((shape, seq, ratio, f"nemo_dsa scores only {mode}"))
                builtin = times.get((shape, seq, ratio, f"built-in {mode} + torch.topk"))
                for name in [key[3] for key in times if key[:3] == (shape, seq, ratio)]:
                    if not name.startswith(f"nemo_dsa stream {mode}") or (mode == "v4" and "v41" in name):
                        continue
                    stream = times[(shape, seq, ratio, name)]
                    label = f"{shape}{'' if ratio is None else f' R={ratio}'} S={seq}"
                    parts = [f"{column:9s} {label}: {name} {stream:.2f} ms"]
                    if scores:
                        parts.append(f"{stream / scores:.2f}x the scores alone ({scores:.2f} ms)")
                    if builtin:
                        parts.append(f"{builtin / stream:.2f}x faster than built-in + torch.topk ({builtin:.2f} ms)")
                    print("; ".join(parts))


if __name__ == "__main__":
    main()
