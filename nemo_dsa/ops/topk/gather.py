"""Gather scores at selected indices, -inf where the index is -1 (no key).

:func:`pytorch_extract_topk_scores` is the checked public form (the seed name), for indices from
outside; :func:`gather_at_indices` the unchecked one the ops use on indices they produced.
"""

from __future__ import annotations

import torch

from nemo_dsa._checks import check_index_range, check_tensor, is_int


def pytorch_extract_topk_scores(logits: torch.Tensor, topk_indices: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Gather ``logits`` at ``topk_indices`` along ``dim``, -inf where the index is -1.

    Indices must lie in [-1, size): anything else is a ValueError rather than being clipped.
    All other dimensions of the two tensors must match.
    """
    check_tensor("logits", logits, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64))
    check_tensor("topk_indices", topk_indices, dtypes=(torch.int32, torch.int64), device=logits.device)
    if topk_indices.ndim != logits.ndim:
        raise ValueError(
            f"topk_indices must have {logits.ndim} dimensions like logits, got shape {tuple(topk_indices.shape)}"
        )
    if not is_int(dim):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -logits.ndim <= dim < logits.ndim:
        raise ValueError(f"dim must lie in [{-logits.ndim}, {logits.ndim}) for {logits.ndim}-dimensional logits, got {dim}")
    axis = dim % logits.ndim
    for d in range(logits.ndim):
        if d != axis and topk_indices.shape[d] != logits.shape[d]:
            raise ValueError(
                f"topk_indices must match logits outside dim {dim}: "
                f"got {tuple(topk_indices.shape)} vs {tuple(logits.shape)}"
            )
    check_index_range("topk_indices", topk_indices, logits.shape[axis])
    return gather_at_indices(logits, topk_indices, axis)


def gather_at_indices(logits: torch.Tensor, indices: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """:func:`pytorch_extract_topk_scores` without the checks, for indices nemo_dsa selected or
    validated itself: no host read of the index range on the per-step path."""
    if logits.shape[dim] == 0:  # no key to gather: every index is -1 (checked by the caller)
        return torch.full(indices.shape, float("-inf"), dtype=logits.dtype, device=logits.device)
    present = indices >= 0
    gathered = torch.gather(logits, dim, torch.where(present, indices, 0).long())
    return torch.where(present, gathered, float("-inf"))
