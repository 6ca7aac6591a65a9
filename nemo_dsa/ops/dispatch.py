"""Choosing between the TileLang kernels and the torch references."""

from __future__ import annotations

import logging

import torch

BACKENDS = ("auto", "tilelang", "torch")

_LOG = logging.getLogger("nemo_dsa")
_REPORTED: set[str] = set()


def resolve_backend(backend: str, *tensors: torch.Tensor, kernel_refusal: str | None = None) -> str:
    """Return ``"tilelang"`` or ``"torch"`` for ``backend`` given the inputs' device and shapes.

    ``"auto"`` takes the kernels for CUDA tensors and the reference otherwise; asking for the
    kernels with CPU tensors is an error rather than a silent fallback. ``kernel_refusal`` is why
    the kernels cannot take these shapes (None when they can; each op's kernels say it): ``"auto"``
    then runs the reference, which takes every shape, and says so once in the log;
    ``"tilelang"`` is a ValueError naming the reason.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        if on_cuda and kernel_refusal is not None:
            report_reference_fallback(kernel_refusal)
            return "torch"
        return "tilelang" if on_cuda else "torch"
    if backend == "tilelang" and not on_cuda:
        raise ValueError("backend='tilelang' needs CUDA tensors; use backend='torch' or 'auto' on CPU")
    if backend == "tilelang" and kernel_refusal is not None:
        raise ValueError(f"backend='tilelang': {kernel_refusal}; backend='auto' runs the torch reference for it")
    return backend


def report_reference_fallback(reason: str) -> None:
    """Log, once per process and reason, that ``"auto"`` runs a torch reference on CUDA because
    the kernels do not take a shape (the run is correct, only slower)."""
    if reason not in _REPORTED:
        _REPORTED.add(reason)
        _LOG.warning("nemo_dsa: %s; backend 'auto' runs the torch reference for it", reason)


def resolve_fused_topk(fused_topk: bool | None, backend: str) -> bool:
    """Whether selection streams query chunks instead of materialising [B, S, K] scores.

    ``None`` (the default everywhere) streams where the TileLang kernels run (``backend`` is the
    resolved one): that is where long contexts live and where the matrix would cost memory. The
    CPU references keep the materialising path, the readable one.
    """
    if fused_topk is not None and not isinstance(fused_topk, bool):
        raise TypeError(f"fused_topk must be True, False or None (auto), got {type(fused_topk).__name__}")
    return backend == "tilelang" if fused_topk is None else fused_topk
