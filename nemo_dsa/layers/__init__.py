"""Attention building blocks: RoPE, RMSNorm, the compressor, the indexer and DSASparseAttention."""

from nemo_dsa.layers.compressor import Compressor
from nemo_dsa.layers.indexer import Indexer, Selection
from nemo_dsa.layers.norm import RMSNorm, rms_normalize
from nemo_dsa.layers.rope import apply_rope, rope_angles
from nemo_dsa.layers.sparse_attention import DSASparseAttention, indexer_kl_loss

__all__ = [
    "Compressor",
    "DSASparseAttention",
    "Indexer",
    "RMSNorm",
    "Selection",
    "apply_rope",
    "indexer_kl_loss",
    "rms_normalize",
    "rope_angles",
]
