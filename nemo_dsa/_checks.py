"""Argument validation shared by the public functions.

Every failure names the argument and states what was expected, so a user reading the message
knows which tensor to fix without opening the source.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def check_tensor(
    name: str,
    value,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that ``value`` is a tensor of the given rank, dtype, shape (None = any) and device."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} must have dtype {allowed}, got {str(value.dtype).replace('torch.', '')}")
    if shape is not None:
        ok = len(shape) == value.ndim and all(s is None or s == v for s, v in zip(shape, value.shape))
        if not ok:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(value.shape)}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} must be on {device} like the other inputs, got {value.device}")
    return value


def check_positive_int(name: str, value, *, minimum: int = 1) -> int:
    """Check an integer argument (bools are rejected) against a lower bound."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
