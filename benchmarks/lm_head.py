"""The fp32 LM head of a bf16 model: nemo-automodel's projection against nemo_dsa's
``Fp32HeadLinear`` (the same weight, its products exact on bf16 tensor cores).

Two kinds of logits, as the two models use them. ``bf16`` (DeepSeek-V4): the built-in side is
``compute_lm_head_logits(lm_head, hidden, fp32_lm_head=True)`` with a plain fp32 ``nn.Linear``,
``lm_head(hidden.float()).to(bf16)``; nemo_dsa's calls the ``Fp32HeadLinear`` with the bf16 hidden
state, as the V4 plugin does. ``fp32`` (V4.1): ``compute_lm_head_logits(lm_head, hidden)``, fp32
logits, on both sides, nemo_dsa's head told that its fp32 input holds bf16 values (as the V4.1
plugin's hook does). Both: median
CUDA-event times of the forward and of forward + backward (a bf16 logits gradient, as from the
loss), TFLOP/s on the fp32 GEMMs' work (2 N K V forward, 6 N K V forward + backward), peak memory
above the inputs, the ratio; and the largest logit difference between the sides in bf16 ulps of
the row's largest logit, with the relative norm of the difference.

    python benchmarks/lm_head.py --rows 16384 --hidden 4096 --vocab 32768 129280 --json head.json
    python benchmarks/lm_head.py --hidden 5120 --logits fp32   # the V4.1 step model's head
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from attention import median_ms, peak_mib


def sides(hidden: int, vocab: int, logits: str):
    from nemo_automodel.components.models.common.utils import compute_lm_head_logits

    from nemo_dsa.integrations.common.lm_head import Fp32HeadLinear, called_with_bf16

    builtin = nn.Linear(hidden, vocab, bias=False, device="cuda", dtype=torch.float32)
    nn.init.normal_(builtin.weight, std=hidden**-0.5)
    ours = nn.Linear(hidden, vocab, bias=False, device="cuda", dtype=torch.float32)
    ours.load_state_dict(builtin.state_dict())
    ours.__class__ = Fp32HeadLinear
    if logits == "bf16":
        return {
            "built-in": lambda h: compute_lm_head_logits(builtin, h, fp32_lm_head=True).logits,
            "nemo_dsa": lambda h: ours(h).to(h.dtype),
        }, (builtin, ours)

    def announced(h):
        with called_with_bf16(ours, h):
            return compute_lm_head_logits(ours, h).logits

    return {"built-in": lambda h: compute_lm_head_logits(builtin, h).logits, "nemo_dsa": announced}, (builtin, ours)


def run(rows: int, hidden: int, vocab: int, logits: str, iters: int) -> dict:
    fns, modules = sides(hidden, vocab, logits)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    logits_dtype = torch.bfloat16 if logits == "bf16" else torch.float32
    grad = torch.randn(rows, vocab, device="cuda", generator=gen).to(logits_dtype)
    flops = 2 * rows * hidden * vocab
    row = {"rows": rows, "hidden": hidden, "vocab": vocab, "logits": logits}
    with torch.no_grad():
        a, b = fns["built-in"](x), fns["nemo_dsa"](x)
    # in ulps of each row's largest logit: a logit near zero has a tiny ulp of its own, which an
    # fp32 sum in another order does not resolve
    row_ulp = torch.exp2(torch.floor(torch.log2(a.float().abs().amax(-1, keepdim=True).clamp_min(2.0**-126))) - 7)
    row["max_diff_row_ulps"] = float(((a.float() - b.float()).abs() / row_ulp).max())
    row["rel_diff"] = float((a.float() - b.float()).norm() / a.float().norm())
    for name, fn in fns.items():
        def forward():
            with torch.no_grad():
                fn(x)

        def forward_backward():
            fn(x).backward(grad)
            x.grad = None
            for module in modules:
                module.weight.grad = None

        fwd, fwd_bwd = median_ms(forward, iters), median_ms(forward_backward, iters)
        row[name] = {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "fwd_tflops": flops / fwd / 1e9,
                     "fwd_bwd_tflops": 3 * flops / fwd_bwd / 1e9, "peak_mib": peak_mib(forward_backward)}  # fmt: skip
    row["fwd_ratio"] = row["built-in"]["fwd_ms"] / row["nemo_dsa"]["fwd_ms"]
    row["fwd_bwd_ratio"] = row["built-in"]["fwd_bwd_ms"] / row["nemo_dsa"]["fwd_bwd_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16384])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 129280])
    parser.add_argument("--logits", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lm_head.py needs a CUDA GPU")
    rows = [run(n, args.hidden, v, kind, args.iters) for kind in args.logits for n in args.rows for v in args.vocab]
    print("| logits | N x K x V | built-in fwd / fwd+bwd ms (TFLOP/s) | nemo_dsa fwd / fwd+bwd ms (TFLOP/s) | ratio fwd / fwd+bwd | peak MiB built-in / nemo_dsa | max diff (row-max ulps) / rel |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b, o = r["built-in"], r["nemo_dsa"]
        print(f"| {r['logits']} | {r['rows']} x {r['hidden']} x {r['vocab']} | {b['fwd_ms']:.2f} / {b['fwd_bwd_ms']:.2f} "
              f"({b['fwd_tflops']:.0f} / {b['fwd_bwd_tflops']:.0f}) | {o['fwd_ms']:.2f} / {o['fwd_bwd_ms']:.2f} "
              f"({o['fwd_tflops']:.0f} / {o['fwd_bwd_tflops']:.0f}) | {r['fwd_ratio']:.2f}x / {r['fwd_bwd_ratio']:.2f}x | "
              f"{b['peak_mib']:.0f} / {o['peak_mib']:.0f} | {r['max_diff_row_ulps']:.2f} / {r['rel_diff']:.1e} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
