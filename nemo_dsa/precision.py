"""Precision control for the fp32 references: matmuls in full IEEE fp32, never TF32.

The V4 reference promises fp32 products and sums (docs/semantics.md "Index scoring"); TF32 would silently drop
13 mantissa bits on CUDA. Every reference that multiplies fp32 matrices runs inside
:func:`ieee_fp32_matmul`.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def ieee_fp32_matmul():
    """Run CUDA fp32 matmuls in full IEEE fp32 (no TF32), restoring the caller's setting after.

    A no-op for CPU work.
    """
    if not torch.cuda.is_available():
        yield
        return
    matmul = torch.backends.cuda.matmul
    # torch >= 2.9 has fp32_precision and refuses to read the legacy allow_tf32 flag once the new
    # one was set, so use the new flag wherever it exists.
    flag, ieee = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    previous = getattr(matmul, flag)
    setattr(matmul, flag, ieee)
    try:
        yield
    finally:
        setattr(matmul, flag, previous)
