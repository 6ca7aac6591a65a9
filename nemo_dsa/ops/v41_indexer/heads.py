"""The shapes the V4.1 scoring kernels take, defined once: a power of two no larger than 128
heads, an index dim that is a multiple of 16 up to 256.

The fused scorer sums heads on the tensor cores in tiles of GEMM_COLUMNS = 256 (query, head)
columns, and the released V4.1 indexer uses 64 heads; every power of two up to 128 has a kernel
configuration. The reference takes any shape: ``backend="auto"`` runs it for the others
(:func:`kernel_refusal`), the kernels themselves refuse them.
"""

from __future__ import annotations

MAX_HEADS = 128
MAX_INDEX_DIM = 256
SUPPORTED_HEADS = tuple(1 << i for i in range(MAX_HEADS.bit_length()))  # 1, 2, 4, ..., 128


def is_supported_heads(heads: int) -> bool:
    """Whether ``heads`` is a V4.1 head count (a power of two <= MAX_HEADS)."""
    return heads in SUPPORTED_HEADS


def check_heads(name: str, heads: int, *, of_tensor: bool = True) -> int:
    """Raise ValueError unless ``heads`` is a V4.1 head count; ``name`` is the tensor whose head
    axis it is (``of_tensor``) or the argument that holds the count."""
    if not is_supported_heads(heads):
        what = "have a power-of-two number of heads" if of_tensor else "be a power of two"
        raise ValueError(f"{name} must {what} <= {MAX_HEADS}, got {heads}")
    return heads


def largest_supported_heads(heads: int) -> int:
    """The largest V4.1 head count <= ``heads`` (>= 1): a power of two, at most MAX_HEADS."""
    return min(1 << (max(heads, 1).bit_length() - 1), MAX_HEADS)


def kernel_refusal(heads: int, dim: int) -> str | None:
    """Why the V4.1 scoring kernels cannot take ``heads`` x ``dim`` queries, or None when they can."""
    if not is_supported_heads(heads):
        return f"the V4.1 indexer kernels take a power of two <= {MAX_HEADS} index heads, got {heads}"
    if dim % 16 or not 16 <= dim <= MAX_INDEX_DIM:
        return f"the V4.1 indexer kernels take an index dim that is a multiple of 16 in [16, {MAX_INDEX_DIM}], got {dim}"
    return None
