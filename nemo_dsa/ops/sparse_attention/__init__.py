"""Sparse multi-query attention with a per-head sink: the index-list reference
(:func:`sparse_attention`) and the window + compressed op (:func:`sparse_window_attention`,
TileLang kernels on Hopper, imported lazily)."""

from nemo_dsa.ops.sparse_attention.interface import SparseWindowAttentionFunction, sparse_window_attention
from nemo_dsa.ops.sparse_attention.naive import sparse_attention, window_compressed_attention_reference

__all__ = [
    "SparseWindowAttentionFunction",
    "sparse_attention",
    "sparse_window_attention",
    "window_compressed_attention_reference",
]
