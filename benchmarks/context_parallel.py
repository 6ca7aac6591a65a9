"""Per-rank time and memory of a DSAForCausalLM training step under context parallelism.

Every rank holds a contiguous 1/P of each row (``nemo_dsa.distributed.shard_batch``) and runs
forward + backward with ``cp_group``; the script reports, per rank, the forward and the
forward+backward time (median over the timed steps) and the peak memory, and rank 0 writes them
as JSON. Run the same global length with 1 and 2 processes to see what CP buys:

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --seq-len 65536 --out cp2.json
    torchrun --nproc-per-node 1 benchmarks/context_parallel.py --seq-len 65536 --out cp1.json
    # CPU check of the same code path (gloo, tiny model):
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --device cpu --tiny --seq-len 512 --steps 2
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import time

import torch

from nemo_dsa.data import SEQ_LENS_PAD
from nemo_dsa.labels import IGNORE_INDEX
from nemo_dsa.ops.dispatch import BACKENDS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=65536, help="global tokens per row (before CP padding)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--scoring", choices=("v4", "v41"), default="v4")
    p.add_argument("--packed", action="store_true", help="pack documents of ~--doc-len tokens (crossing shards)")
    p.add_argument("--doc-len", type=int, default=6000)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", choices=("bf16", "fp32"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="indexer kernels")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke runs)")
    p.add_argument("--out", default=None, help="JSON file written by rank 0")
    return p.parse_args(argv)


def model_config(args):
    from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig

    if args.tiny:
        return DSAModelConfig(
            vocab_size=259, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=32,
            qk_rope_head_dim=16, q_lora_rank=32, intermediate_size=128, compress_ratios=(0, 4, 16, 4),
            sliding_window=16, index_n_heads=4, index_head_dim=32, index_topk=8, scoring=args.scoring,
            backend=args.backend,
        )  # fmt: skip
    # configs/model/small.yaml's shape (~30M parameters): V4-like ratios, window 128, top-64.
    return DSAModelConfig(
        vocab_size=259, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, head_dim=64,
        qk_rope_head_dim=32, q_lora_rank=256, intermediate_size=1536,
        compress_ratios=(0, 4, 128, 4, 128, 4, 128, 4), sliding_window=128, index_n_heads=16,
        index_head_dim=64, index_topk=64, max_position_embeddings=max(65536, args.seq_len), scoring=args.scoring,
        backend=args.backend,
    )  # fmt: skip


def make_batch(args, vocab: int) -> dict[str, torch.Tensor]:
    """The global batch, identical on every rank (seeded); packed rows get THD-style fields."""
    gen = torch.Generator().manual_seed(1234)
    rows, length = args.batch_size, args.seq_len
    batch = {
        "input_ids": torch.randint(0, vocab, (rows, length), generator=gen),
        "labels": torch.randint(0, vocab, (rows, length), generator=gen),
    }
    if args.packed:
        lens = []
        for _ in range(rows):
            row, left = [], length
            while left > 0:
                n = min(left, int(torch.randint(args.doc_len // 2, args.doc_len * 3 // 2 + 1, (1,), generator=gen)))
                row.append(n)
                left -= n
            lens.append(row)
        width = max(len(r) for r in lens)
        batch["seq_lens"] = torch.tensor([r + [SEQ_LENS_PAD] * (width - len(r)) for r in lens])
        batch["position_ids"] = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in lens])
    return batch


def _now(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs CUDA GPUs (one per rank); use --device cpu --tiny for a CPU smoke run")
    import torch.distributed as dist

    from nemo_dsa.distributed import init_from_env, shard_batch, shutdown
    from nemo_dsa.models.dsa_lm.modeling import DSAForCausalLM

    env = init_from_env(backend="nccl" if args.device == "cuda" else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    torch.manual_seed(0)
    config = model_config(args)
    model = DSAForCausalLM(config).to(device)
    batch = shard_batch(make_batch(args, config.vocab_size), env.cp_group, compress_ratios=config.compress_ratios)
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    count = (inputs["labels"] != IGNORE_INDEX).sum().float()
    total = count.clone()
    if env.cp_group is not None:
        dist.all_reduce(total, group=env.cp_group)

    def step() -> tuple[float, float]:
        start = _now(args.device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(**inputs, cp_group=env.cp_group)
        forward_done = _now(args.device)
        (out.loss * count / total).backward()
        end = _now(args.device)
        model.zero_grad(set_to_none=True)
        return forward_done - start, end - start

    for _ in range(args.warmup):
        step()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [step() for _ in range(args.steps)]
    if args.device == "cuda":
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
    else:  # process peak RSS (KiB on Linux): the whole process, not just tensors
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    mine = {
        "cp_rank": env.cp_rank,
        "local_tokens": int(inputs["input_ids"].shape[1]),
        "forward_ms": 1e3 * statistics.median(t[0] for t in times),
        "step_ms": 1e3 * statistics.median(t[1] for t in times),
        "peak_memory_gib": peak_gib,
    }
    ranks = [mine]
    if env.cp_group is not None:
        ranks = [None] * env.cp_size
        dist.all_gather_object(ranks, mine, group=env.cp_group)
    if env.cp_rank == 0:
        report = {
            "cp_size": env.cp_size, "global_seq_len": args.seq_len, "batch_size": args.batch_size,
            "scoring": args.scoring, "backend": args.backend, "packed": args.packed, "precision": precision,
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if args.device == "cuda" else None,
            "parameters": model.num_parameters(), "steps": args.steps, "ranks": ranks,
            "tokens_per_s": args.batch_size * args.seq_len / (max(r["step_ms"] for r in ranks) / 1e3),
        }  # fmt: skip
        print(f"CP={env.cp_size} G={args.seq_len} B={args.batch_size} scoring={args.scoring} backend={args.backend} "
              f"packed={args.packed} {precision} {report['gpu'] or 'cpu'} params={report['parameters'] / 1e6:.1f}M")  # fmt: skip
        print(f"{'rank':>4} {'tokens':>8} {'fwd ms':>9} {'fwd+bwd ms':>11} {'peak GiB':>9}")
        for r in ranks:
            print(f"{r['cp_rank']:>4} {r['local_tokens']:>8} {r['forward_ms']:>9.1f} {r['step_ms']:>11.1f} "
                  f"{r['peak_memory_gib']:>9.2f}")  # fmt: skip
        print(f"tokens/s (slowest rank): {report['tokens_per_s']:.0f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    if not math.isfinite(mine["step_ms"]):
        raise RuntimeError("non-finite timing")
    shutdown()


if __name__ == "__main__":
    main()
