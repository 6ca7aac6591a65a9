"""What the first training step at a new sequence length costs, and what it builds.

For each length in ``--seq`` (in the order given, one model, B = 1), one training step of the
side_by_side model (``--family``, ``--side``): its wall time (synchronised), the TileLang kernels
it added to nemo_dsa's compile cache (``ops._tilelang``: a compile, or a load from TileLang's disk
cache; each listed by factory and configuration), and the graphs torch.compile (dynamo) captured
during it (nemo-automodel's compiled functions recompile for new shapes). A second step at the
same length shows the steady cost. Writes JSON (``--out``) and prints a table.

    python benchmarks/new_length.py --family v4 --seq 4096 4224 4352 8192 6000 --out new_length.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nemo_dsa.integrations.side_by_side import DEFAULT_RATIOS, build, model_config, training_step


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def timed_step(step) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="v4", choices=["v4", "v41"])
    parser.add_argument("--side", default="plugin", choices=["plugin", "builtin"])
    parser.add_argument("--ratios", type=int, nargs="+", default=None, help="default: the family's step model")
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 4224, 4352, 8192, 6000, 4096])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.exit(2, "new_length: needs a CUDA GPU\n")
    from nemo_dsa.ops import _tilelang

    ratios = DEFAULT_RATIOS[args.family] if args.ratios is None else args.ratios
    config = model_config(args.family, ratios, args.vocab, args.experts)
    torch.manual_seed(0)
    model = build(args.side, config)
    rows = []
    for seq in args.seq:
        step, optimizer = training_step(model, seq, args.vocab, seed=seq)
        kernels_before, graphs_before = set(_tilelang._compile_cache), dynamo_graphs()
        first = timed_step(step)
        built = [f"{key[1]} {dict(key[2])}" for key in set(_tilelang._compile_cache) - kernels_before]
        graphs = dynamo_graphs() - graphs_before
        second = timed_step(step)
        rows.append({"S": seq, "first_s": first, "second_s": second, "tilelang_kernels": built, "dynamo_graphs": graphs})
        print(f"S={seq}: first {first:.2f} s, second {second:.3f} s, {len(built)} TileLang kernels, "
              f"{graphs} dynamo graphs", *built, sep="\n  ", flush=True)  # fmt: skip
        del optimizer
    print("\n| S | first step s | second step s | TileLang kernels built | dynamo graphs |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['S']:,} | {r['first_s']:.2f} | {r['second_s']:.3f} | {len(r['tilelang_kernels'])} | {r['dynamo_graphs']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"family": args.family, "side": args.side, "ratios": ratios, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
