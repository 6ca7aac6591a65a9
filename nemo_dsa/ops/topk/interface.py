"""Top-k selection on a score matrix: the TileLang radix select on CUDA, the reference elsewhere.

Both paths implement docs/semantics.md "Top-k selection" exactly (same indices, bit for bit); the
reference (``naive.select_topk_reference``) is the readable one, the kernel (``kernels``) the
fast one. Importing the kernel module does not import TileLang (its factories do, when built).
"""

import math

import torch

from nemo_dsa._checks import check_has_data, check_positive_int, check_tensor
from nemo_dsa.ops.dispatch import resolve_backend
from nemo_dsa.ops.topk.kernels import MAX_COUNT, select_rows_tilelang
from nemo_dsa.ops.topk.naive import select_topk_reference
from nemo_dsa.ops.topk.rows import ORDERS, SCORE_DTYPES

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernel_supports(scores: torch.Tensor, topk: int) -> bool:
    """Whether the TileLang selector serves these scores (fp32/bf16, T within its sort width)."""
    return scores.dtype in KERNEL_DTYPES and min(topk, scores.shape[-1]) <= MAX_COUNT


def select_topk(
    scores: torch.Tensor,
    topk: int,
    order: str = "score",
    *,
    ks: torch.Tensor | None = None,
    ke: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Top-k key indices of ``scores [..., S, K]`` as int32 ``[..., S, min(topk, K)]``.

    Same contract as :func:`nemo_dsa.ops.topk.naive.select_topk_reference` (best finite scores, ties to
    the smaller index, -1 padding; ``order`` "score" or "index"). ``ks``/``ke`` (int32, the
    scores' leading shape) name each row's visible range ``[ks, ke)``: only keys inside it are
    selected (the kernel reads only those; the reference masks the rest), and a row with
    ``ks >= ke`` selects nothing. ``backend="auto"`` takes the kernel
    for CUDA fp32/bf16 scores with T <= 8192 and the reference otherwise.
    """
    _check_arguments(scores, topk, order, ks, ke)
    if ks is not None and ks.numel():
        # Caller's ranges: the kernel reads [ks, ke) of each row, so they must lie inside it (one
        # host read). ks >= ke stays allowed (the row selects nothing).
        below, above = torch.stack(((ks < 0).any(), (ke > scores.shape[-1]).any())).tolist()
        if below:
            raise ValueError(f"ks must be >= 0, got minimum {int(ks.min())}")
        if above:
            raise ValueError(f"ke must be <= the number of keys {scores.shape[-1]}, got maximum {int(ke.max())}")
    return _select(scores, topk, order, ks, ke, backend)


def _check_arguments(scores, topk, order, ks, ke) -> None:
    check_tensor("scores", scores, dtypes=SCORE_DTYPES)
    check_has_data("scores", scores)  # the selection reads values (meta tensors have none)
    if scores.ndim < 1:
        raise ValueError("scores must have at least 1 dimension (the key axis)")
    check_positive_int("topk", topk)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if (ks is None) != (ke is None):
        raise ValueError("give both ks and ke, or neither")
    for name, value in (("ks", ks), ("ke", ke)):
        if value is not None:
            check_tensor(name, value, dtypes=(torch.int32,), shape=tuple(scores.shape[:-1]), device=scores.device)


def select_topk_in_ranges(
    scores: torch.Tensor,
    topk: int,
    order: str = "score",
    *,
    ks: torch.Tensor | None = None,
    ke: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`select_topk` on ranges known to satisfy ``0 <= ks`` and ``ke <= K`` (made by the
    visibility rule or an op from such ranges): their values are not read back."""
    _check_arguments(scores, topk, order, ks, ke)
    return _select(scores, topk, order, ks, ke, backend)


def _select(scores, topk, order, ks, ke, backend) -> torch.Tensor:
    if resolve_backend(backend, scores) == "torch" or not kernel_supports(scores, topk):
        if backend == "tilelang":  # asked for explicitly: no silent fallback
            if scores.dtype not in KERNEL_DTYPES:
                raise TypeError(f"backend='tilelang' selects on float32 or bfloat16 scores, got {scores.dtype}")
            raise ValueError("backend='tilelang' selects at most 8192 keys per row; use backend='torch'")
        if ks is not None:
            # The range is honoured here as the kernel honours it (it reads only [ks, ke)): keys
            # outside it are never selected, and ks >= ke selects nothing (-1s).
            keys = torch.arange(scores.shape[-1], device=scores.device)
            outside = (keys < ks.unsqueeze(-1)) | (keys >= ke.unsqueeze(-1))
            scores = scores.masked_fill(outside, float("-inf"))
        return select_topk_reference(scores, topk, order)
    num_keys = scores.shape[-1]
    count = min(topk, num_keys)
    rows = math.prod(scores.shape[:-1])
    if count == 0 or rows == 0:
        return torch.full((*scores.shape[:-1], count), -1, dtype=torch.int32, device=scores.device)
    flat = scores.reshape(rows, num_keys)
    ranges = (ks.reshape(rows), ke.reshape(rows)) if ks is not None else (None, None)
    index, _ = select_rows_tilelang(flat, count, order, *ranges, capacity=topk)
    return index.view(*scores.shape[:-1], count)
