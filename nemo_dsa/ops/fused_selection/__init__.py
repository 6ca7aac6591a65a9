"""Fused score + select: top-k of the V4 and V4.1 indexers without the [B, S, K] score matrix.

Depends on the scorers (``v4_indexer`` / ``v41_indexer`` naive and kernels) and on ``topk``;
``plan`` (chunk plans) -> ``window`` (exact selection on a key window) -> ``interface`` (the
public functions and the scorer seams). Public names load lazily (``nemo_dsa._lazy``).
"""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {
    "v4_select_topk": "nemo_dsa.ops.fused_selection.interface",
    "v4_select_topk_in_ranges": "nemo_dsa.ops.fused_selection.interface",
    "v41_select_topk": "nemo_dsa.ops.fused_selection.interface",
    "v41_select_topk_in_ranges": "nemo_dsa.ops.fused_selection.interface",
    "v4_chunk_logits": "nemo_dsa.ops.fused_selection.interface",
    "v41_chunk_scores": "nemo_dsa.ops.fused_selection.interface",
    "DEFAULT_CHUNK_BYTES": "nemo_dsa.ops.fused_selection.plan",
    "ROW_ALIGN": "nemo_dsa.ops.fused_selection.plan",
    "KEY_ALIGN": "nemo_dsa.ops.fused_selection.plan",
    "QueryChunk": "nemo_dsa.ops.fused_selection.plan",
    "ChunkPlan": "nemo_dsa.ops.fused_selection.plan",
    "plan_query_chunks": "nemo_dsa.ops.fused_selection.plan",
    "planned_chunks": "nemo_dsa.ops.fused_selection.plan",
    "v4_row_bytes": "nemo_dsa.ops.fused_selection.plan",
    "v41_row_bytes": "nemo_dsa.ops.fused_selection.plan",
    "select_window": "nemo_dsa.ops.fused_selection.window",
    "select_chunks": "nemo_dsa.ops.fused_selection.window",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
