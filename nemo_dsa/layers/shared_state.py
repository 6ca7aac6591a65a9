"""What attention layers hand on to later layers within one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_dsa.layers.indexer import Selection


@dataclass
class SourceState:
    """The latest kv source's outputs, reused by later ``reindex`` / ``reuse`` layers of its ratio."""

    ratio: int  # its compression ratio (a consumer of another ratio is an error)
    compressed_kv: torch.Tensor  # [B, K, head_dim] on the global compressed axis
    selection: Selection  # its index keys and the latest top-k
    candidate_blocks: torch.Tensor | None = None  # int32 [B, S, NB] (V4.1 candidate source), else None


@dataclass
class SharedLayerState:
    """Per-forward state the model threads through its layers (one fresh object per forward)."""

    source: SourceState | None = None
