"""Whole training steps of a small DeepSeek-V4 model: nemo_dsa's plugin against the built-in.

Both sides are nemo-automodel 0.7.0's ``DeepseekV4ForCausalLM`` built from one config (V4-Flash
attention shapes: 64 heads of 512, 64 rotary dims, q rank 1024, 8 output groups of rank 1024,
window 128, top-512 of 64 index heads; a small MoE; hyper-connections hc_mult 4) with the same
weights; they differ only in the attention: the built-in with ``backend.attn: tilelang`` and
``NemoDsaDeepseekV4ForCausalLM`` (every attention layer computed by nemo_dsa). A step is forward,
the next-token loss, backward and a fused AdamW update, on one packed-free row of S tokens.
Reports the median step time over CUDA events, tokens/s, peak memory and the ratio, as a table
and as JSON (``--out``). Needs a CUDA GPU, TileLang and nemo-automodel.

    python examples/benchmark_model_step.py --seq 4096 16384 65536 --out step.json

``--profile`` runs torch.profiler over a few more steps of each side after the timed ones and
writes the ops' self CUDA time (key_averages, grouped by op name) as a table to
``<out>.profile.txt`` (and prints it); the forward of every decoder-layer part is also marked
with a range (``fwd L<i> <part>``) so its CUDA time can be read beside the ops.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch


def model_config(layers: int, ratios: list[int], vocab: int, experts: int):
    from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=vocab, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=layers,
        num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_lora_rank=1024,
        o_groups=8, n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=2,
        compress_ratios=ratios, sliding_window=128, num_hash_layers=0, hc_mult=4,
        index_n_heads=64, index_head_dim=128, index_topk=512, num_nextn_predict_layers=0,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1 << 20, torch_dtype="bfloat16",
    )  # fmt: skip


def build(kind: str, config, state_dict=None):
    from nemo_automodel.components.models.common.utils import BackendConfig

    backend = BackendConfig(
        attn="tilelang", linear="torch", rms_norm="torch", rope_fusion=False,
        enable_hf_state_dict_adapter=False, dispatcher="torch", experts="torch_mm",
    )  # fmt: skip
    if kind == "builtin":
        from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM as cls
    else:
        from nemo_dsa.integrations.deepseek_v4 import NemoDsaDeepseekV4ForCausalLM as cls
    device = torch.device("cuda")
    with device:
        model = cls(config, backend=backend)
    model.initialize_weights(buffer_device=device, dtype=torch.bfloat16)
    if state_dict is not None:
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise ValueError(f"{kind}: state dict mismatch, missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.train()


def training_step(model, seq: int, vocab: int, seed: int):
    """One unpacked row of ``seq`` random tokens and a fused AdamW: (step() -> loss, optimizer)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = torch.randint(0, vocab, (1, seq + 1), device="cuda", generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(seq, device="cuda").unsqueeze(0)
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


PROFILED_PARTS = ("input_layernorm", "attn_hc", "self_attn", "post_attention_layernorm", "ffn_hc", "mlp")


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
        for part in PROFILED_PARTS:
            child = getattr(layer, part, None)
            if child is None:
                continue
            wrap(child, f"fwd L{index} {part}")
            if part == "self_attn":
                for sub_name, sub in child.named_children():
                    wrap(sub, f"fwd L{index} self_attn.{sub_name}")
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
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--ratios", type=int, nargs="+", default=[0, 4, 128])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sides", nargs="+", default=["plugin", "builtin"], choices=["plugin", "builtin"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", action="store_true", help="profile a few more steps per side (see above)")
    parser.add_argument("--profile-steps", type=int, default=2)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_model_step needs a CUDA GPU")
    config = model_config(len(args.ratios), args.ratios, args.vocab, args.experts)
    torch.manual_seed(0)
    rows = []
    profiles = []
    for seq in args.seq:
        row = {"S": seq}
        weights = None
        for side in args.sides:
            model = build(side, config, weights)
            if weights is None:  # the second side gets the first side's weights
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            try:
                row[side] = time_steps(model, seq, args.vocab, args.steps, args.warmup)
            except torch.OutOfMemoryError:
                row[side] = {"oom": True}
            print(f"S={seq} {side}: {row[side]}", flush=True)
            if args.profile and not row[side].get("oom"):
                free()
                try:
                    text = profile_steps(model, seq, args.vocab, args.profile_steps)
                except torch.OutOfMemoryError:
                    text = f"{args.profile_steps} steps at S={seq}: out of memory under the profiler"
                profiles.append(f"=== {side} ===\n{text}")
                print(profiles[-1], flush=True)
            del model
            free()
        del weights
        free()
        rows.append(row)

    print(f"\n| S | {' | '.join(f'{s} ms / tokens/s / peak GiB' for s in args.sides)} | plugin / built-in tokens/s |")
    print("|---|" + "---|" * (len(args.sides) + 1))
    for row in rows:
        cells = []
        for side in args.sides:
            r = row[side]
            cells.append("OOM" if r.get("oom") else f"{r['ms']:.1f} / {r['tokens_per_s']:,.0f} / {r['peak_gib']:.1f}")
        both = all(s in row and not row[s].get("oom") for s in ("plugin", "builtin"))
        ratio = f"{row['plugin']['tokens_per_s'] / row['builtin']['tokens_per_s']:.2f}x" if both else "-"
        print(f"| {row['S']:,} | {' | '.join(cells)} | {ratio} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"config": config.to_dict(), "rows": rows}, f, indent=1, default=str)
        if profiles:
            with open(f"{args.out}.profile.txt", "w") as f:
                f.write("\n\n".join(profiles) + "\n")


if __name__ == "__main__":
    main()
