"""nemo_dsa: DeepSeek-V4 / V4.1 sparse attention with exact references and TileLang kernels.

Public names load lazily (``nemo_dsa._lazy``) so that ``import nemo_dsa`` pulls in neither
TileLang nor nemo-automodel and never initialises CUDA.
"""

from __future__ import annotations

from nemo_dsa._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "AttentionMetadata": "nemo_dsa.metadata",
    "build_attention_metadata": "nemo_dsa.metadata",
    "v4_lighting_indexer": "nemo_dsa.ops.v4_indexer.interface",
    "v4_lightning_indexer": "nemo_dsa.ops.v4_indexer.interface",
    "v4_indexer_bshd": "nemo_dsa.ops.v4_indexer.interface",
    "V4IndexerFunction": "nemo_dsa.ops.v4_indexer.interface",
    "pytorch_extract_topk_scores": "nemo_dsa.ops.topk.gather",
    "indexer_scores": "nemo_dsa.ops.v41_indexer.interface",
    "DSAModelConfig": "nemo_dsa.models.dsa_lm",
    "DSAForCausalLM": "nemo_dsa.models.dsa_lm",
    "DSASparseAttention": "nemo_dsa.layers",
    "build_model": "nemo_dsa.builder",
}

__all__ = sorted(_EXPORTS) + ["__version__"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
