"""Where the indexer's time goes on one Hopper GPU: each stage of the V4 and V4.1 paths alone.

    python benchmarks/parts.py --seq-len 32768

H=64 index heads, D=128, R=4, T=512, causal, B=1. Medians of CUDA-event timings after one warm-up
call (TileLang compiles on first use). Stages: the scoring kernels, the bare torch.topk on the
materialised scores, nemo_dsa's exact selection on them (the TileLang radix select through
`ops.topk.interface.select_topk`, and the torch reference `naive.select_topk_reference`), the streamed
scoring + selection (`v4_select_topk` / `v41_select_topk`) and the V4 top-k backward kernel.
"""

from __future__ import annotations

import argparse

import torch
from indexer import measure  # the sibling script's timing loop (median of CUDA events)

HEADS, DIM, RATIO, TOPK = 64, 128, 4, 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("parts.py needs a CUDA GPU (Hopper): it times the TileLang kernels")
    from nemo_dsa.ops.fused_selection import v4_select_topk, v41_select_topk
    from nemo_dsa.ops.topk import select_topk, select_topk_reference
    from nemo_dsa.visibility import causal_ks_ke
    from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang, v4_topk_backward_tilelang
    from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

    seq, keys = args.seq_len, args.seq_len // RATIO
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, seq, HEADS, DIM, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, keys, DIM, device="cuda", generator=g).bfloat16()
    w = torch.randn(1, seq, HEADS, device="cuda", generator=g) * (HEADS * DIM) ** -0.5
    w16 = w.bfloat16()
    ks, ke = causal_ks_ke(1, seq, keys, RATIO, q.device)
    logits = v4_logits_tilelang(q, k, w, ks, ke)
    index = select_topk(logits, TOPK, ks=ks, ke=ke)
    grad = torch.ones(index.shape, device="cuda")
    stages = {
        "V4 logits kernel": lambda: v4_logits_tilelang(q, k, w, ks, ke, out=logits),
        "torch.topk on the fp32 logits": lambda: torch.topk(logits[0], TOPK, dim=-1),
        "radix select kernel, fp32 logits": lambda: select_topk(logits, TOPK, ks=ks, ke=ke),
        "reference select_topk, fp32 logits": lambda: select_topk_reference(logits, TOPK),
        "v4_select_topk (streamed)": lambda: v4_select_topk(q, k, w, ks, ke, TOPK),
        "V4 top-k backward kernel": lambda: v4_topk_backward_tilelang(q, k, w, index, grad, ks, ke),
    }
    results = {name: measure(fn, args.reps, warmup=1)["ms"] for name, fn in stages.items()}
    del logits
    scores = v41_scores_tilelang(q, k, w16, ks, ke)
    stages = {
        "V4.1 scores kernel": lambda: v41_scores_tilelang(q, k, w16, ks, ke),
        "torch.topk on the bf16 scores": lambda: torch.topk(scores[0], TOPK, dim=-1),
        "radix select kernel, bf16 scores": lambda: select_topk(scores, TOPK, "index", ks=ks, ke=ke),
        "reference select_topk, bf16 scores": lambda: select_topk_reference(scores, TOPK, order="index"),
        "v41_select_topk (streamed)": lambda: v41_select_topk(q, k, w16, ks, ke, TOPK),
    }
    results.update({name: measure(fn, args.reps, warmup=1)["ms"] for name, fn in stages.items()})
    print(f"{torch.cuda.get_device_name()}  S={seq} K={keys} H={HEADS} D={DIM} T={TOPK}")
    for name, ms in results.items():
        print(f"{name:<38}{ms:9.3f} ms")


if __name__ == "__main__":
    main()
