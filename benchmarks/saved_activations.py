"""What a training step keeps for its backward, counted on the CPU: the V4 / V4.1 step models of
``nemo_dsa.integrations.side_by_side`` (the configs ``model_step.py`` times), nemo_dsa's plugin or the built-in, bf16.

Every distinct storage autograd packs during the forward (``torch.autograd.graph.saved_tensors_hooks``),
parameters excluded, is attributed to the module whose forward packed it. On the plugin side the
attention op runs through the kernels' own autograd Function with the reference computing in
place of the kernels, so what is kept is what the GPU keeps (the CPU reference keeps other
things). The built-in runs its CPU attention path, so its attention rows are not its GPU's. Prints
KiB a token in total and per module (``--depth`` name parts), largest first.

    python benchmarks/saved_activations.py --side plugin --family v4 --seq 512
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

from nemo_dsa.integrations import side_by_side

# The plugin side routes attention as the CPU tests do (tests/models/test_activation_memory.py).
TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "layers"), str(TESTS / "models")]


def count(
    side: str, family: str, seq: int, depth: int, activation_checkpointing: str = "off", recompute: str | None = None,
    hc_backend: str | None = None,
) -> tuple[float, dict]:
    if side == "plugin":
        import pytest

        from test_activation_memory import route_attention_through_the_kernel_function

        route_attention_through_the_kernel_function(pytest.MonkeyPatch())
    config = side_by_side.model_config(family, side_by_side.DEFAULT_RATIOS[family], 1024, 4)
    if recompute:
        config.recompute = recompute  # the plugin's own recompute parts
    if hc_backend:
        config.hyper_connection_backend = hc_backend  # "triton": the fused parts (TRITON_INTERPRET=1 on the CPU)
    model = side_by_side.build(side, config, device="cpu", dtype=torch.bfloat16, attn="torch" if family == "v4" else "sdpa")
    if activation_checkpointing != "off":  # what the blocks keep is then their inputs (the rest is recomputed)
        from nemo_automodel.components.moe.parallelizer import apply_ac

        apply_ac(model, selective=activation_checkpointing == "selective")
    stack = ["(top)"]
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda _m, _a, n=name: stack.append(n) and None)
        module.register_forward_hook(lambda _m, _a, _o: stack.pop() and None)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept.setdefault(ptr, (t.untyped_storage().nbytes(), stack[-1]))
        return t

    tokens = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, position_ids=torch.arange(seq)[None])
    per_module = collections.Counter()
    for nbytes, module in kept.values():
        per_module[".".join(module.split(".")[:depth])] += nbytes
    return sum(per_module.values()) / seq / 1024, {k: v / seq / 1024 for k, v in per_module.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["plugin", "builtin"], default="plugin")
    parser.add_argument("--family", choices=["v4", "v41"], default="v4")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--activation-checkpointing", choices=["off", "full"], default="off",
                        help="nemo-automodel's apply_ac on the decoder blocks (selective AC keeps its saved ops "
                             "out of these hooks' sight, so it is not counted here)")  # fmt: skip
    parser.add_argument("--recompute", default=None, help="the plugin's recompute parts (e.g. hyper_connections,norms)")
    parser.add_argument("--hc-backend", default=None, choices=["auto", "triton", "torch"],
                        help="the plugin's hyper_connection_backend; triton on the CPU needs TRITON_INTERPRET=1")  # fmt: skip
    args = parser.parse_args()
    total, per_module = count(
        args.side, args.family, args.seq, args.depth, args.activation_checkpointing, args.recompute, args.hc_backend
    )
    print(f"{args.side} {args.family} S={args.seq}: {total:.1f} KiB a token kept for the backward")
    for module, kib in list(per_module.items())[: args.top]:
        print(f"  {kib:8.1f} KiB/token  {module}")


if __name__ == "__main__":
    main()
