"""Attention building blocks: RoPE, RMSNorm, the compressor, the indexer and DSASparseAttention."""

from nemo_dsa.layers.compressor import Compressor
from nemo_dsa.layers.context import LocalContext, SequenceContext
from nemo_dsa.layers.indexer import Indexer, Selection
from nemo_dsa.layers.indexer_loss import indexer_kl_loss
from nemo_dsa.layers.norm import RMSNorm, rms_normalize
from nemo_dsa.layers.rope import apply_rope, rope_angles
from nemo_dsa.layers.shared_state import SharedLayerState, SourceState
from nemo_dsa.layers.sparse_attention import DSASparseAttention

__all__ = [
    "Compressor",
    "DSASparseAttention",
    "Indexer",
    "LocalContext",
    "RMSNorm",
    "Selection",
    "SequenceContext",
    "SharedLayerState",
    "SourceState",
    "apply_rope",
    "indexer_kl_loss",
    "rms_normalize",
    "rope_angles",
]
