"""One DSASparseAttention layer with fresh random weights, run on packed rows outside a model."""

from __future__ import annotations

import torch

from nemo_dsa.layers.context import LocalContext
from nemo_dsa.layers.shared_state import SharedLayerState
from nemo_dsa.layers.sparse_attention import DSASparseAttention
from nemo_dsa.metadata import build_attention_metadata
from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig


def make_layer(config: DSAModelConfig, layer_idx: int, seed: int = 0) -> DSASparseAttention:
    torch.manual_seed(seed)
    layer = DSASparseAttention(config, layer_idx)
    with torch.no_grad():  # fresh random values everywhere, including sinks and position biases
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim == 1 else 0.3))
    return layer


def packed_ids(rows: list[list[int]], seq: int) -> torch.Tensor:
    """1-based document ids for rows of document lengths; the rest of each row is padding."""
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    for b, lengths in enumerate(rows):
        start = 0
        for d, n in enumerate(lengths):
            ids[b, start : start + n] = d + 1
            start += n
    return ids


def run(layer, x, ids):
    ratio = max(layer.ratio, 1)
    meta = build_attention_metadata(compress_ratio=ratio, packed_seq_ids=ids)
    out, aux = layer(x, meta, LocalContext(), SharedLayerState())
    return out, aux
