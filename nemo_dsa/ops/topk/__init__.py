"""Exact top-k selection (docs/semantics.md "Top-k selection") and what is built on it.

Modules, imports one way: ``rows`` (row selection by unique keys) -> ``naive`` (the reference)
-> ``vector_kernels`` (the bf16 index-order select) -> ``kernels`` (the TileLang radix select, and
the launch of both) -> ``interface`` (validation and dispatch).
``gather`` (scores at selected indices) stands beside them; ``block_kernels`` (TileLang block maxima)
and ``naive.candidate_blocks_reference`` serve the V4.1 candidate blocks, which live with the V4.1
indexer (``nemo_dsa.ops.v41_indexer.candidates``). Public names load lazily (``nemo_dsa._lazy``).
"""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {
    "select_topk": "nemo_dsa.ops.topk.interface",
    "select_topk_in_ranges": "nemo_dsa.ops.topk.interface",
    "kernel_supports": "nemo_dsa.ops.topk.interface",
    "select_topk_reference": "nemo_dsa.ops.topk.naive",
    "select_rows_tilelang": "nemo_dsa.ops.topk.kernels",
    "pytorch_extract_topk_scores": "nemo_dsa.ops.topk.gather",
    "gather_at_indices": "nemo_dsa.ops.topk.gather",
    "candidate_blocks_reference": "nemo_dsa.ops.topk.naive",
    "ORDERS": "nemo_dsa.ops.topk.rows",
    "SCORE_DTYPES": "nemo_dsa.ops.topk.rows",
    "TIE_MARGIN": "nemo_dsa.ops.topk.rows",
    "orderable_image": "nemo_dsa.ops.topk.rows",
    "orderable_int32": "nemo_dsa.ops.topk.rows",
    "selection_keys": "nemo_dsa.ops.topk.rows",
    "select_rows": "nemo_dsa.ops.topk.rows",
    "select_rows_exact": "nemo_dsa.ops.topk.rows",
    "redo_rows": "nemo_dsa.ops.topk.rows",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
