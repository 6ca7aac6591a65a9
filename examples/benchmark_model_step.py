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

    python examples/benchmark_model_step.py --seq 4096 16384 65536 --out step.json
    python examples/benchmark_model_step.py --family v41 --seq 4096 16384 --out step_v41.json

``--activation-checkpointing full | selective`` wraps both sides' decoder blocks with nemo-automodel's
``apply_ac`` (what a recipe's ``distributed.activation_checkpointing: true | selective`` does); long
sequences need it (tests/integrations/test_activation_checkpointing.py checks the plugins' gradients under it).
``--recompute hyper_connections,norms[,attention]`` turns on the plugin's own lighter recompute
instead (or as well): those parts' activations are recomputed, not kept
(``nemo_dsa.integrations.recompute``).

``--profile`` runs torch.profiler over a few more steps of each side after the timed ones and
writes the ops' self CUDA time (key_averages, grouped by op name) as a table to
``<out>.profile.txt`` (and prints it); the forward of every decoder-layer part is also marked
with a range (``fwd L<i> <part>``) so its CUDA time can be read beside the ops.

``model_config`` and ``build`` also build both sides on CPU (fp32, tiny dimensions as overrides):
tests/integrations/test_benchmark_model_step_cpu.py runs two steps of each there and checks the losses agree.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch

FAMILIES = ("v4", "v41")
DEFAULT_RATIOS = {"v4": [0, 4, 128], "v41": [0, 2, 2, 1, 1]}
V41_RATIOS = (0, 1, 2)


def model_config(family: str, ratios: list[int], vocab: int, experts: int, dtype: str = "bfloat16", **overrides):
    """One config both sides are built from; ``overrides`` replace single (text) config fields."""
    if family == "v4":
        return v4_config(ratios, vocab, experts, dtype, **overrides)
    if family == "v41":
        return v41_config(ratios, vocab, experts, dtype, **overrides)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def v4_config(ratios: list[int], vocab: int, experts: int, dtype: str = "bfloat16", **overrides):
    from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config

    fields = dict(
        vocab_size=vocab, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=len(ratios),
        num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_lora_rank=1024,
        o_groups=8, n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=2,
        compress_ratios=list(ratios), sliding_window=128, num_hash_layers=0, hc_mult=4,
        index_n_heads=64, index_head_dim=128, index_topk=512, num_nextn_predict_layers=0,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1 << 20, torch_dtype=dtype,
    )  # fmt: skip
    fields.update(overrides)
    return DeepseekV4Config(**fields)


def v41_layer_roles(ratios: list[int]) -> dict:
    """The V4.1 schedule of ``ratios``: the first layer of each run of one compressed ratio is its
    kv + index source; the ratio-1 layer right after its source re-indexes (an index source
    without KV); every other compressed layer reuses its source's KV and selection; the first
    ratio-1 source is the candidate source (the release: layer 20, its only ratio-1 source).
    Ratio-2 layers come before ratio-1 layers, as in the release: the candidate blocks mask every
    later indexer, which must therefore index ratio-1 keys."""
    if not ratios or any(r not in V41_RATIOS for r in ratios):
        raise ValueError(f"ratios (--ratios) of a V4.1 model must be {V41_RATIOS}, got {ratios}")
    if 1 in ratios and 2 in ratios[ratios.index(1) :]:
        raise ValueError(f"ratios (--ratios) of a V4.1 model: every 2 must precede every 1 (as released), got {ratios}")
    kv_sources, index_sources, owner, source = [], [], None, None
    for layer, ratio in enumerate(ratios):
        if ratio == 0:
            continue
        if ratio != owner:
            owner, source = ratio, layer
            kv_sources.append(layer)
            index_sources.append(layer)
        elif ratio == 1 and layer == source + 1:
            index_sources.append(layer)
    candidate = next((layer for layer in kv_sources if ratios[layer] == 1), -1)
    return {"kv_source_layer_ids": kv_sources, "index_source_layer_ids": index_sources,
            "candidate_source_layer_id": candidate}  # fmt: skip


def v41_config(ratios: list[int], vocab: int, experts: int, dtype: str = "bfloat16", **overrides):
    """The released V4.1-Flash attention (the config's defaults, spelled out) in a small model."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    text = dict(
        vocab_size=vocab, hidden_size=5120, moe_intermediate_size=2304, num_hidden_layers=len(ratios),
        num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024,
        o_groups=8, n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=2,
        compress_ratios=list(ratios), **v41_layer_roles(ratios), sliding_window=128, index_n_heads=32,
        index_head_dim=128, index_topk=512, candidate_topk_blocks=2048, candidate_block_size=8, hc_mult=4,
        rope_scaling={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1 << 20, engram_layer_ids=[], num_nextn_predict_layers=0, dtype=dtype,
        dspark_noise_token_id=vocab - 1,  # (DSpark is not built) a token id inside the small vocabulary
    )  # fmt: skip
    text.update(overrides)
    return DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}, dtype=text["dtype"])


def family_of(config) -> str:
    return {"deepseek_v4": "v4", "deepseek_v41": "v41"}[config.model_type]


def build(kind: str, config, state_dict=None, *, device="cuda", dtype=torch.bfloat16, attn="tilelang"):
    """``kind`` ("builtin" | "plugin") of ``config``'s family on ``device``, in train mode, holding
    ``state_dict`` if given (every key: a mismatch is a ValueError), else the built-in's init."""
    from nemo_automodel.components.models.common.utils import BackendConfig

    family = family_of(config)
    # V4.1's attention takes torch_fp32 (or te) norms only.
    backend = BackendConfig(
        attn=attn, linear="torch", rms_norm="torch" if family == "v4" else "torch_fp32", rope_fusion=False,
        enable_hf_state_dict_adapter=False, dispatcher="torch", experts="torch_mm",
    )  # fmt: skip
    if (family, kind) == ("v4", "builtin"):
        from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM as cls
    elif (family, kind) == ("v4", "plugin"):
        from nemo_dsa.integrations.deepseek_v4 import NemoDsaDeepseekV4ForCausalLM as cls
    elif (family, kind) == ("v41", "builtin"):
        from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM as cls
    elif (family, kind) == ("v41", "plugin"):
        from nemo_dsa.integrations.deepseek_v41 import NemoDsaDeepseekV41ForCausalLM as cls
    else:
        raise ValueError(f"kind must be 'builtin' or 'plugin', got {kind!r}")
    device = torch.device(device)
    with device:
        model = cls(config, backend=backend)
    model.initialize_weights(buffer_device=device, dtype=dtype)
    if family == "v41":
        hc_sinkhorn_on_torch_without_tile_kernels(model)
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise ValueError(f"{kind}: state dict mismatch, missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.train()


def hc_sinkhorn_on_torch_without_tile_kernels(model) -> None:
    """V4.1 asks for DeepSeek's TileKernels Sinkhorn in its hyper-connections whenever
    ``backend.attn`` is tilelang, and stops if the ``tile_kernels`` package is missing (seen on the
    H200). The hyper-connections are the built-in's on both sides, so without that package both
    sides run their Sinkhorn in torch: the comparison stays like for like."""
    from nemo_automodel.components.models.deepseek_v4.optimized_kernels import is_dsv4_kernel_available
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection

    if is_dsv4_kernel_available("sinkhorn"):
        return
    for module in model.modules():
        if isinstance(module, DeepseekV41HyperConnection):
            module.sinkhorn_backend = "torch"


def copy_weights(model) -> dict:
    """A detached copy of ``model``'s state dict, for the other side."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def training_step(model, seq: int, vocab: int, seed: int, device="cuda"):
    """One unpacked row of ``seq`` random tokens and a fused AdamW: (step() -> loss, optimizer)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, seq + 1), device=device, generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(seq, device=device).unsqueeze(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        logits = model(inputs, position_ids=position_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step, optimizer


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
                             "nemo_dsa.integrations.recompute); the built-in side is unchanged")  # fmt: skip
    parser.add_argument("--fused-q-norm-rope", choices=["on", "off"], default=None,
                        help="the plugin's V4 q norm + RoPE as one kernel or eager ops "
                             "(layers.sparse_attention.FUSED_Q_NORM_ROPE; default: its value)")  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_model_step needs a CUDA GPU")
    import nemo_dsa.layers.sparse_attention as attention_layer

    if args.fused_q_norm_rope is not None:
        attention_layer.FUSED_Q_NORM_ROPE = args.fused_q_norm_rope == "on"
    ratios = DEFAULT_RATIOS[args.family] if args.ratios is None else args.ratios
    config = model_config(args.family, ratios, args.vocab, args.experts)
    if args.recompute:
        config.recompute = args.recompute  # read by the plugin's constructor, ignored by the built-in
    torch.manual_seed(0)
    rows = []
    profiles = []
    for seq in args.seq:
        row = {"family": args.family, "S": seq, "fused_q_norm_rope": attention_layer.FUSED_Q_NORM_ROPE,
               "activation_checkpointing": args.activation_checkpointing, "recompute": args.recompute}
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
