"""Sparse multi-query attention with a per-head sink: the index-list reference
(:func:`sparse_attention`) and the window + compressed op (:func:`sparse_window_attention`,
TileLang kernels on Hopper, imported lazily).

Public names load lazily (``nemo_dsa._lazy``), like the other op packages: importing the
reference does not import the interface.
"""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {
    "SparseWindowAttentionFunction": "nemo_dsa.ops.sparse_attention.interface",
    "attend": "nemo_dsa.ops.sparse_attention.interface",
    "attend_to_indices": "nemo_dsa.ops.sparse_attention.naive",
    "attend_window_and_compressed": "nemo_dsa.ops.sparse_attention.naive",
    "sparse_window_attention": "nemo_dsa.ops.sparse_attention.interface",
    "sparse_attention": "nemo_dsa.ops.sparse_attention.naive",
    "window_compressed_attention_reference": "nemo_dsa.ops.sparse_attention.naive",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
