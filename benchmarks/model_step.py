"""Whole training steps of a small DeepSeek-V4 or V4.1 model: nemo_dsa's plugin against the built-in.

``--family v4`` (default): both sides are nemo-automodel 0.7.0's ``DeepseekV4ForCausalLM`` built
from one config (V4-Flash attention shapes: 64 heads of 512, 64 rotary dims, q rank 1024, 8 output
groups of rank 1024, window 128, top-512 of 64 index heads; a small MoE; hyper-connections hc_mult
4; 3 layers, ratios 0 / 4 / 128), the built-in with ``backend.attn: tilelang`` and
``NemoDsaDeepseekV4ForCausalLM`` (every attention layer computed by nemo_dsa).

``--family v41``: nemo-automodel's ``DeepseekV41ForCausalLM`` (``backend.attn: tilelang``)
against ``NemoDsaDeepseekV41ForCausalLM``, one text config with the released V4.1-Flash attention
(hidden 5120, 64 heads of 512, 64 rotary dims, q rank 1280, 8 output groups of rank 1024, window
128, YaRN x16 over 65,536 positions, 32 index heads of 128, top-512, candidate blocks: 2048 of 8)
and hc_mult 4, no vision tower. Five layers, ratios 0 / 2 / 2 / 1 / 1, roles as
``v41_layer_roles`` derives them: 0 window-only, 1 the ratio-2 kv + index source, 2 reuses its
KV and selection, 3 the ratio-1 source and candidate source, 4 re-indexes the ratio-1 KV inside
3's candidate blocks. That is the fewest layers with a window-only layer, both compressed ratios
and all three roles: each ratio needs its own source, reuse and reindex one layer each; the
order (window, ratio 2, ratio 1) and reindexing on ratio 1 only are the release's. With
2048 x 8 candidate keys a ratio-1 reindex query keeps every key up to S = 16,384 and prunes only
beyond (the release's rule). Engram is off (it needs the release's tokenizer and is no part of
the attention); MTP is off (V4.1's DSpark is a separate model the backbone does not build); the
MoE is small (``--experts`` routed of 2304 + 1 shared, 2 per token).

A step is forward, the next-token loss, backward and a fused AdamW update, on one packed-free row
of S tokens; both sides hold the same weights (the first side's, loaded into the second).
``--ratios`` gives the layers' compression ratios (one layer each; defaults V4 0 4 128, V4.1
0 2 2 1 1): V4 any of 0 / 4 / 128, V4.1 each of 0 / 1 / 2 with ratio 2 before 1 (V4.1 roles
follow from them, see ``v41_layer_roles``). Reports the median step time over CUDA
events, tokens/s, peak memory and the ratio, as a table and as JSON (``--out``). Needs a CUDA GPU,
TileLang and nemo-automodel. S: a multiple of 128 (V4's ratio 128 and the kernels' tiles).

    python benchmarks/model_step.py --seq 4096 16384 65536 --out step.json
    python benchmarks/model_step.py --family v41 --seq 4096 16384 --out step_v41.json

``--activation-checkpointing full | selective`` wraps both sides' decoder blocks with nemo-automodel's
``apply_ac`` (what a recipe's ``distributed.activation_checkpointing: true | selective`` does); long
sequences need it (tests/integrations/test_activation_checkpointing.py checks the plugins' gradients under it).
``--recompute hyper_connections,norms[,attention]`` turns on the plugin's own lighter recompute
instead (or as well): those parts' activations are recomputed, not kept
(``nemo_dsa.integrations.common.recompute``).

``--profile`` runs torch.profiler over a few more steps of each side after the timed ones and
writes the ops' self CUDA time (key_averages, grouped by op name) as a table to
``<out>.profile.txt`` (and prints it); the forward of every decoder-layer part is also marked
with a range (``fwd L<i> <part>``) so its CUDA time can be read beside the ops.

Both sides come from ``nemo_dsa.integrations.side_by_side``, which the tests build on CPU (fp32,
tiny dimensions) to check that two steps give the same losses on both sides.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch

from nemo_dsa.integrations.side_by_side import (
    DEFAULT_RATIOS,
    FAMILIES,
    build,
    copy_weights,
    family_of,
    model_config,
    training_step,
)


def time_steps(model, seq: int, vocab: int, steps: int, warmup: int) -> dict:
    step, optimizer = training_step(model, seq, vocab, seed=0)
    losses = [step() for _ in range(warmup)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        losses.append(step())
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    del optimizer
    return {
        "ms": ms, "tokens_per_s": seq / (ms / 1000), "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "first_loss": float(losses[0]), "last_loss": float(losses[-1]),
    }  # fmt: skip


# A decoder layer's parts, in forward order: V4's names, V4.1's (its block's own attribute names).
PROFILED_PARTS = {
    "v4": ("input_layernorm", "attn_hc", "self_attn", "post_attention_layernorm", "ffn_hc", "mlp"),
    "v41": ("attn_norm", "attn_hc", "attn", "ffn_norm", "ffn_hc", "ffn"),
}
ATTENTION_PARTS = ("self_attn", "attn")


def mark_layer_parts(model) -> list:
    """Forward hooks that open a profiler range around each decoder layer's parts (and the
    attention's children); returns the hook handles."""
    from torch.autograd.profiler import record_function

    handles = []

    def wrap(module, name):
        def pre(_module, _args):
            _module._nemo_dsa_range = record_function(name)
            _module._nemo_dsa_range.__enter__()

        def post(_module, _args, _out):
            _module._nemo_dsa_range.__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    for index, layer in model.model.layers.items():
        for part in PROFILED_PARTS[family_of(model.config)]:
            child = getattr(layer, part, None)
            if child is None:
                continue
            wrap(child, f"fwd L{index} {part}")
            if part in ATTENTION_PARTS:
                for sub_name, sub in child.named_children():
                    wrap(sub, f"fwd L{index} {part}.{sub_name}")
    return handles


def profile_steps(model, seq: int, vocab: int, steps: int, rows: int = 45) -> str:
    """torch.profiler over ``steps`` steps (after one unprofiled step): the ops by self CUDA
    time, and the layer-part ranges by total CUDA time, as text tables."""
    from torch.profiler import ProfilerActivity, profile

    step, optimizer = training_step(model, seq, vocab, seed=1)
    handles = mark_layer_parts(model)
    try:
        step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
        del optimizer
    events = prof.key_averages()
    ops = events.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=90)
    ranges = [e for e in events if e.key.startswith("fwd L")]
    lines = [f"{'range':<48} {'count':>6} {'cuda total ms':>14} {'cpu total ms':>13}"]
    for e in sorted(ranges, key=lambda e: e.key):
        cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        lines.append(f"{e.key:<48} {e.count:>6} {cuda_us / 1000:>14.2f} {e.cpu_time_total / 1000:>13.2f}")
    return f"{steps} steps at S={seq}\n\nops by self CUDA time:\n{ops}\nlayer-part forward ranges:\n" + "\n".join(lines)


def free():
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="v4", choices=FAMILIES, help="DeepSeek-V4 or V4.1 (see above)")
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--ratios", type=int, nargs="+", default=None,
                        help="per-layer compression ratios; default v4: 0 4 128, v41: 0 2 2 1 1")  # fmt: skip
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sides", nargs="+", default=["plugin", "builtin"], choices=["plugin", "builtin"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="profile a few more steps per side (see above)")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--activation-checkpointing", choices=["off", "full", "selective"], default="off",
                        help="both sides' decoder blocks through nemo-automodel's apply_ac, as a recipe's "
                             "distributed.activation_checkpointing: true | selective does")  # fmt: skip
    parser.add_argument("--recompute", default=None,
                        help="the plugin's recompute parts, comma-separated (hyper_connections,norms,attention; "
                             "nemo_dsa.integrations.common.recompute); the built-in side is unchanged")  # fmt: skip
    parser.add_argument("--hc-backend", default=None, choices=["auto", "triton", "torch"],
                        help="the plugin's hyper_connection_backend (default: the plugin's default)")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("model_step needs a CUDA GPU")
    ratios = DEFAULT_RATIOS[args.family] if args.ratios is None else args.ratios
    config = model_config(args.family, ratios, args.vocab, args.experts)
    if args.recompute:
        config.recompute = args.recompute  # read by the plugin's constructor, ignored by the built-in
    if args.hc_backend:
        config.hyper_connection_backend = args.hc_backend  # likewise
    torch.manual_seed(0)
    rows = []
    profiles = []
    for seq in args.seq:
        row = {"family": args.family, "S": seq, "activation_checkpointing": args.activation_checkpointing, "recompute": args.recompute}
        weights = None
        for side in args.sides:
            model = build(side, config, weights)
            if weights is None:  # the second side gets the first side's weights
                weights = copy_weights(model)
            if args.activation_checkpointing != "off":
                from nemo_automodel.components.moe.parallelizer import apply_ac

                apply_ac(model, selective=args.activation_checkpointing == "selective")
            try:
                row[side] = time_steps(model, seq, args.vocab, args.steps, args.warmup)
            except torch.OutOfMemoryError:
                row[side] = {"oom": True}
            print(f"{args.family} S={seq} {side}: {row[side]}", flush=True)
            if args.profile and not row[side].get("oom"):
                free()
                try:
                    text = profile_steps(model, seq, args.vocab, args.profile_steps)
                except torch.OutOfMemoryError:
                    text = f"{args.profile_steps} steps at S={seq}: out of memory under the profiler"
                profiles.append(f"=== {args.family} {side} ===\n{text}")
                print(profiles[-1], flush=True)
            del model
            free()
        del weights
        free()
        rows.append(row)

    sides = " | ".join(f"{s} ms / tokens/s / peak GiB" for s in args.sides)
    print(f"\n| family | S | {sides} | plugin / built-in tokens/s |")
    print("|---|---|" + "---|" * (len(args.sides) + 1))
    for row in rows:
        cells = []
        for side in args.sides:
            r = row[side]
            cells.append("OOM" if r.get("oom") else f"{r['ms']:.1f} / {r['tokens_per_s']:,.0f} / {r['peak_gib']:.1f}")
        both = all(s in row and not row[s].get("oom") for s in ("plugin", "builtin"))
        ratio = f"{row['plugin']['tokens_per_s'] / row['builtin']['tokens_per_s']:.2f}x" if both else "-"
        print(f"| {row['family']} | {row['S']:,} | {' | '.join(cells)} | {ratio} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"family": args.family, "config": config.to_dict(), "rows": rows}, f, indent=1, default=str)
        if profiles:
            with open(f"{args.out}.profile.txt", "w") as f:
                f.write("\n\n".join(profiles) + "\n")


if __name__ == "__main__":
    main()
