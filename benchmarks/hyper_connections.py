"""The hyper-connection (mHC) parts alone: nemo_dsa's fused kernels against nemo-automodel's torch
arithmetic, and DeepSeek's tile-kernels where it is installed, on one site's shapes.

Shapes: T tokens (default 16,384) of M = 4 bf16 streams of width D (default 4,096, V4-Flash; 5,120
for V4.1-Flash), the mixer's fp32 ``fn [24, M * D]``. Each row is a median of CUDA-event timings
(20 repetitions after 3 warm-ups), forward + backward unless it says forward; "bitwise" is the
share of output elements equal to nemo-automodel's; "err vs fp32" is each bf16 result's relative
distance (Frobenius) to the same part computed in fp32, fused and torch side by side: the rounding
a bf16 part has anyway. Also prints which Sinkhorn nemo-automodel's V4 runs here
(``optimized_kernels`` looks for tile-kernels names that 2.1.0 does not have) and, when
``tile_kernels`` imports, its Sinkhorn, collapse and expand (``mhc_post``) on the same inputs.

    python benchmarks/hyper_connections.py --tokens 16384 --width 4096 --json hc.json
"""

from __future__ import annotations

import argparse
import json

import torch

from nemo_dsa.ops.hyper_connections import collapse_streams, expand_streams, stream_mix
from nemo_dsa.ops.hyper_connections.naive import sinkhorn_reference


def median_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in events)[reps // 2]


def forward_backward(fn):
    def run():
        out = fn()
        out.backward(torch.ones_like(out))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hyper_connections needs a CUDA GPU")
    t, m, d = args.tokens, 4, args.width
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, t, m, d, device="cuda", generator=g).bfloat16().requires_grad_()
    out = torch.randn(1, t, d, device="cuda", generator=g).bfloat16().requires_grad_()
    fn = (torch.randn(m * (m + 2), m * d, device="cuda", generator=g) * 0.02).requires_grad_()
    pre = (torch.rand(1, t, m, device="cuda", generator=g) + 0.1).requires_grad_()
    post = (2 * torch.rand(1, t, m, device="cuda", generator=g)).requires_grad_()
    comb = sinkhorn_reference(torch.randn(1, t, m, m, device="cuda", generator=g), 20, 1e-6).requires_grad_()
    rows = {}

    def both(name, call):
        rows[name] = {side: median_ms(forward_backward(lambda: call(side))) for side in ("triton", "torch")}

    both("mix (projection + 1/RMS)", lambda b: stream_mix(x, fn, 1e-6, order="norm_first", backend=b))
    both("collapse", lambda b: collapse_streams(x, pre, backend=b))
    both("expand, V4 rounding", lambda b: expand_streams(out, x, post, comb, rounding="terms", backend=b))
    both("expand, V4.1 rounding", lambda b: expand_streams(out, x, post, comb, rounding="once", backend=b))
    with torch.no_grad():
        xf, of = x.float(), out.float()
        truth = post.unsqueeze(-1) * of.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), xf)
        for rounding in ("terms", "once"):
            fused = expand_streams(out, x, post, comb, rounding=rounding, backend="triton")
            ref = expand_streams(out, x, post, comb, rounding=rounding, backend="torch")
            rows[f"expand, {rounding}: bitwise / err vs fp32 fused, torch"] = {
                "bitwise": (fused == ref).float().mean().item(),
                "err_fused": ((fused.float() - truth).norm() / truth.norm()).item(),
                "err_torch": ((ref.float() - truth).norm() / truth.norm()).item(),
            }

    from nemo_automodel.components.models.deepseek_v4 import optimized_kernels

    rows["built-in V4 Sinkhorn on tile-kernels"] = optimized_kernels.is_dsv4_kernel_available("sinkhorn")
    logits = torch.randn(t, m, m, device="cuda", generator=g)
    rows["Sinkhorn forward, torch ms"] = median_ms(lambda: sinkhorn_reference(logits, 20, 1e-6))
    try:
        import tile_kernels
        from tile_kernels import mhc
    except ImportError as error:
        rows["tile_kernels"] = f"not importable: {error}"
    else:
        rows["tile_kernels"] = getattr(tile_kernels, "__version__", "?")
        result = torch.empty_like(logits)
        rows["Sinkhorn forward, tile-kernels ms"] = median_ms(lambda: mhc.mhc_sinkhorn_fwd(logits, result, 20, 1e-6))
        rows["Sinkhorn, tile-kernels max |diff|"] = (result - sinkhorn_reference(logits, 20, 1e-6)).abs().max().item()
        xs, pm = x.detach().view(t, m, d), pre.detach().view(t, m).contiguous()
        collapsed = torch.empty(t, d, device="cuda", dtype=torch.bfloat16)
        rows["collapse forward, tile-kernels ms"] = median_ms(lambda: mhc.mhc_pre_apply_mix_fwd(xs, pm, collapsed))
        post4 = post.detach().view(1, t, m, 1).contiguous()
        expanded = mhc.mhc_post_fwd(out.detach(), x.detach(), post4, comb.detach().contiguous())
        once = expand_streams(out, x, post, comb, rounding="once", backend="torch")
        rows["expand forward, tile-kernels ms"] = median_ms(
            lambda: mhc.mhc_post_fwd(out.detach(), x.detach(), post4, comb.detach().contiguous()))
        rows["expand, tile-kernels bitwise vs V4.1 rounding"] = (expanded == once).float().mean().item()
        grad = torch.randn_like(x)
        rows["expand backward, tile-kernels ms"] = median_ms(
            lambda: mhc.mhc_post_bwd(out.detach(), x.detach(), post4, comb.detach().contiguous(), grad))
    for name, value in rows.items():
        print(f"{name}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
