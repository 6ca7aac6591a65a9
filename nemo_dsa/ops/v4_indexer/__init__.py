"""V4 indexer: fp32 scoring, top-k selection and gradients through the selected scores."""

from nemo_dsa.ops.v4_indexer.interface import (
    V4IndexerBSHDFunction,
    V4IndexerFunction,
    pytorch_extract_topk_scores,
    v4_indexer_bshd,
    v4_lighting_indexer,
)

__all__ = [
    "V4IndexerBSHDFunction",
    "V4IndexerFunction",
    "pytorch_extract_topk_scores",
    "v4_indexer_bshd",
    "v4_lighting_indexer",
]
