"""Compare DeepSeek-V4 and V4.1 top-k selection on one packed batch of the offline corpus.

    python benchmarks/compare_selection.py                        # random init, seed 0
    python benchmarks/compare_selection.py --checkpoint runs/tiny-v4-default/checkpoints/step_0000200

One set of weights (the tiny preset, or a checkpoint of it) is run twice on the same packed row:
with V4 scoring (fp32 logits) and with V4.1 scoring (BF16 rounding boundaries, MXFP4 index q/k).
Both models give every indexer layer its own keys (V4.1 layer roles off), so they share every
parameter and differ only in how the indexer scores. For a few queries the script prints the
visible range and the groups each mode selects (as sets: V4 orders by score, V4.1 by index), then
the mean overlap per indexer layer over all queries that see more groups than ``index_topk``.
"""

from __future__ import annotations

import argparse

import torch

from nemo_dsa.builder import build_model, load_config_node
from nemo_dsa.data import build_streams
from nemo_dsa.layers.indexer import Indexer

INPUTS = ("input_ids", "position_ids", "seq_lens", "seq_lens_padded", "packed_seq_ids", "attention_mask")


def build_pair(seed: int, checkpoint: str | None):
    """The tiny preset with V4 and with V4.1 scoring, holding identical weights."""
    config = load_config_node("model", "tiny")["config"]
    v41_scoring = {"scoring": "v41", "layer_roles": {"kv_source_every": 1, "candidate_source": "none"}}
    v4 = build_model(config, "v4", seed=seed)
    v41 = build_model(config, v41_scoring, seed=seed)
    if checkpoint:
        from nemo_dsa.models.dsa_lm.checkpoint import load_checkpoint

        load_checkpoint(v4, checkpoint)
    v41.load_state_dict(v4.state_dict())
    return v4.eval(), v41.eval()


@torch.no_grad()
def selections(model, batch) -> dict[int, tuple[torch.Tensor, object]]:
    """``{layer: (topk_indices [B,S,T], metadata)}`` of every indexer layer, captured by hooks."""
    found: dict[int, tuple[torch.Tensor, object]] = {}
    hooks = []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.attn.indexer, Indexer):
            def hook(module, args, output, i=i):
                found[i] = (output.topk_indices, args[3])  # args: x, query_latent, angles, meta, keys
            hooks.append(layer.attn.indexer.register_forward_hook(hook))
    try:
        model(**{k: batch[k] for k in INPUTS})
    finally:
        for h in hooks:
            h.remove()
    return found


def as_set(row: torch.Tensor) -> set[int]:
    return {int(j) for j in row if j >= 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--checkpoint", default=None,
                        help="checkpoint dir of a tiny V4 run of nemo-dsa-train (default: random init)")
    parser.add_argument("--queries", type=int, default=8, help="queries to print per layer")
    args = parser.parse_args()

    v4, v41 = build_pair(args.seed, args.checkpoint)
    stream, _ = build_streams(seq_len=args.seq_len, batch_size=1, seed=args.seed, val_batches=0)
    batch = next(stream)
    print(f"packed row: documents of lengths {[int(n) for n in batch['seq_lens'][0] if n > 0]}, "
          f"index_topk={v4.config.index_topk}")
    sel4, sel41 = selections(v4, batch), selections(v41, batch)
    for layer in sorted(sel4):
        idx4, meta = sel4[layer]
        idx41, _ = sel41[layer]
        ks, ke = meta.ks[0], meta.ke[0]
        crowded = [i for i in range(args.seq_len) if ke[i] - ks[i] > v4.config.index_topk]
        print(f"\nlayer {layer}: {len(crowded)} queries see more than {v4.config.index_topk} groups")
        overlaps = []
        shown = set(crowded[:: max(1, len(crowded) // max(args.queries, 1))][: args.queries])
        for i in crowded:
            a, b = as_set(idx4[0, i]), as_set(idx41[0, i])
            overlaps.append(len(a & b) / max(len(a), 1))
            if i in shown:
                doc = int(batch["packed_seq_ids"][0, i])
                print(f"  query {i:4d} (doc {doc}, pos {int(batch['position_ids'][0, i]):3d}) "
                      f"visible [{int(ks[i])},{int(ke[i])})  v4 {sorted(a)}  v41 {sorted(b)}  "
                      f"overlap {len(a & b)}/{len(a)}")
        if overlaps:
            print(f"  mean overlap over {len(overlaps)} queries: {sum(overlaps) / len(overlaps):.3f}")


if __name__ == "__main__":
    main()
