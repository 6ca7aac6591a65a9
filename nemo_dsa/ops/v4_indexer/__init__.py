"""V4 indexer: fp32 scoring, top-k selection and gradients through the selected scores.

``naive`` (reference) -> ``kernels`` (TileLang) -> ``interface`` (validation, dispatch, autograd).
Public names load lazily (``nemo_dsa._lazy``): importing the scorers (as ``fused_selection``
does) never imports the interface, which itself depends on ``fused_selection``.
"""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {
    "v4_indexer_bshd": "nemo_dsa.ops.v4_indexer.interface",
    "v4_indexer_in_ranges": "nemo_dsa.ops.v4_indexer.interface",
    "v4_lighting_indexer": "nemo_dsa.ops.v4_indexer.interface",
    "v4_lightning_indexer": "nemo_dsa.ops.v4_indexer.interface",
    "V4IndexerBSHDFunction": "nemo_dsa.ops.v4_indexer.interface",
    "V4IndexerFunction": "nemo_dsa.ops.v4_indexer.interface",
    "pytorch_extract_topk_scores": "nemo_dsa.ops.topk.gather",
    "v4_logits": "nemo_dsa.ops.v4_indexer.naive",
    "v4_logits_in_ranges": "nemo_dsa.ops.v4_indexer.naive",
    "v4_backward": "nemo_dsa.ops.v4_indexer.naive",
    "v4_backward_in_ranges": "nemo_dsa.ops.v4_indexer.naive",
    "v4_logits_chunk_size": "nemo_dsa.ops.v4_indexer.naive",
    "v4_backward_chunk_size": "nemo_dsa.ops.v4_indexer.naive",
    "v4_logits_tilelang": "nemo_dsa.ops.v4_indexer.kernels",
    "v4_topk_backward_tilelang": "nemo_dsa.ops.v4_indexer.kernels",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
