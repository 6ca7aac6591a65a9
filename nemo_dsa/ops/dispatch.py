"""Choosing between the TileLang kernels and the torch references."""

from __future__ import annotations

import torch

BACKENDS = ("auto", "tilelang", "torch")


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Return ``"tilelang"`` or ``"torch"`` for ``backend`` given the inputs' device.

    ``"auto"`` takes the kernels for CUDA tensors and the reference otherwise; asking for the
    kernels with CPU tensors is an error rather than a silent fallback.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        return "tilelang" if on_cuda else "torch"
    if backend == "tilelang" and not on_cuda:
        raise ValueError("backend='tilelang' needs CUDA tensors; use backend='torch' or 'auto' on CPU")
    return backend


def resolve_fused_topk(fused_topk: bool | None, backend: str) -> bool:
    """Whether selection streams query chunks instead of materialising [B, S, K] scores.

    ``None`` (the default everywhere) streams where the TileLang kernels run (``backend`` is the
    resolved one): that is where long contexts live and where the matrix would cost memory. The
    CPU references keep the materialising path, the readable one.
    """
    if fused_topk is not None and not isinstance(fused_topk, bool):
        raise TypeError(f"fused_topk must be True, False or None (auto), got {type(fused_topk).__name__}")
    return backend == "tilelang" if fused_topk is None else fused_topk
