"""V4.1 indexer: frozen BF16-boundary scores (docs/semantics.md "Index scoring", V4.1).

``heads`` (the head-count rule) and ``naive`` (reference) -> ``kernels`` (TileLang) ->
``interface`` (validation and dispatch). ``candidates`` holds the V4.1 candidate blocks (the
hierarchical selection's block stage, selecting through ``nemo_dsa.ops.topk``). Public names load
lazily (``nemo_dsa._lazy``).
"""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {
    "indexer_scores": "nemo_dsa.ops.v41_indexer.interface",
    "indexer_scores_in_ranges": "nemo_dsa.ops.v41_indexer.interface",
    "v41_scores": "nemo_dsa.ops.v41_indexer.naive",
    "v41_scores_in_ranges": "nemo_dsa.ops.v41_indexer.naive",
    "v41_scores_chunk_size": "nemo_dsa.ops.v41_indexer.naive",
    "v41_scores_tilelang": "nemo_dsa.ops.v41_indexer.kernels",
    "v41_scores_masked_tilelang": "nemo_dsa.ops.v41_indexer.kernels",
    "candidate_blocks": "nemo_dsa.ops.v41_indexer.candidates",
    "candidate_block_mask": "nemo_dsa.ops.v41_indexer.candidates",
    "blocks_to_mask": "nemo_dsa.ops.v41_indexer.candidates",
    "MAX_HEADS": "nemo_dsa.ops.v41_indexer.heads",
    "SUPPORTED_HEADS": "nemo_dsa.ops.v41_indexer.heads",
    "check_heads": "nemo_dsa.ops.v41_indexer.heads",
    "is_supported_heads": "nemo_dsa.ops.v41_indexer.heads",
    "kernel_refusal": "nemo_dsa.ops.v41_indexer.heads",
    "largest_supported_heads": "nemo_dsa.ops.v41_indexer.heads",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
