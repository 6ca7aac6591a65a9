"""Argument validation shared by the public functions.

Every failure names the argument and states what was expected, so a user reading the message
knows which tensor to fix without opening the source.
"""

from __future__ import annotations

import math
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


def is_int(value) -> bool:
    """Whether ``value`` is an int in the sense of every count argument: bools are not."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value, *, minimum: int = 1) -> bool:
    """The rule of :func:`check_positive_int` as a predicate, for validators that raise their own
    error type (config loaders report every bad key as a ValueError)."""
    return is_int(value) and value >= minimum


def check_seed(value, name: str = "seed") -> int:
    """A random seed: an int in [0, 2**63) (what torch's generators take as given), never a
    string, a float or a bool converted on the way (a ValueError, as config checks report)."""
    if not is_int(value) or not 0 <= value < 2**63:
        raise ValueError(f"{name} must be an int in [0, 2**63), got {value!r}")
    return value


# Sizes that land in int32 tensors (ks/ke, indices, positions of a row) must stay below this.
INT32_MAX = 2**31 - 1


def check_positive_int(name: str, value, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Check an integer argument (bools are rejected) against a lower and an optional upper bound
    (``INT32_MAX`` for sizes that int32 tensors index, so a huge value is named, not wrapped)."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not is_positive_int(value, minimum=minimum):
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_finite_float(name: str, value) -> float:
    """Check a real scalar argument (a softmax scale): an int or float, not a bool or a tensor,
    and finite. Returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite float, got an int too large for a float") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_device(name: str, value) -> torch.device:
    """A device argument as a ``torch.device``: a ``torch.device`` or a string torch parses
    (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"meta"``); anything else is named, not torch's RuntimeError."""
    if isinstance(value, torch.device):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a torch.device or a string such as 'cpu' or 'cuda:0', got {type(value).__name__}")
    try:
        return torch.device(value)
    except RuntimeError:
        raise ValueError(f"{name} must name a device such as 'cpu', 'cuda' or 'cuda:0', got {value!r}") from None


def check_has_data(name: str, value: torch.Tensor) -> torch.Tensor:
    """Reject meta tensors where values are read (a meta tensor has a shape but no data)."""
    if value.is_meta:
        raise ValueError(f"{name} must hold data, got a tensor on the meta device")
    return value


def check_qkw(
    q,
    k,
    w,
    *,
    dtypes: tuple[Iterable[torch.dtype], Iterable[torch.dtype], Iterable[torch.dtype]],
    names: tuple[str, str, str] = ("q", "k", "w"),
    seq_first: bool = False,
) -> tuple[int, int, int, int, int]:
    """Check an indexer's queries, keys and head weights; returns (B, S, H, D, K).

    BSHD layout: q [B, S, H, D], k [B, K, D], w [B, S, H]; ``seq_first`` is V4's SBHD layout:
    q [S, B, H, D], k [K, B, D], w [S, B, H]. ``dtypes`` are the allowed dtypes of each, ``names``
    the argument names the messages use. All three must share q's device.
    """
    q_name, k_name, w_name = names
    check_tensor(q_name, q, ndim=4, dtypes=dtypes[0])
    check_has_data(q_name, q)  # before k and w are compared with q's device: a meta q is named, not k
    if seq_first:
        queries, batch, heads, dim = q.shape
        key_shape, weight_shape = (None, batch, dim), (queries, batch, heads)
    else:
        batch, queries, heads, dim = q.shape
        key_shape, weight_shape = (batch, None, dim), (batch, queries, heads)
    check_tensor(k_name, k, ndim=3, dtypes=dtypes[1], shape=key_shape, device=q.device)
    check_tensor(w_name, w, ndim=3, dtypes=dtypes[2], shape=weight_shape, device=q.device)
    for name, value in zip(names, (q, k, w)):
        check_has_data(name, value)
    return batch, queries, heads, dim, k.shape[0 if seq_first else 1]


def check_index_range(name: str, indices: torch.Tensor, size: int, *, meaning: str = "-1 = no key") -> None:
    """Check that every index lies in ``[-1, size)``; -1 stands for "none" (``meaning`` says what).

    Reads the indices on the host (one device sync): call it where indices enter from outside
    (a user's argument), never on a per-step path over indices nemo_dsa produced itself.
    """
    if not indices.numel():
        return
    check_has_data(name, indices)
    low, high = torch.stack(torch.aminmax(indices)).tolist()
    if low < -1 or high >= size:
        raise ValueError(f"{name} must lie in [-1, {size}) ({meaning}), got range [{low}, {high}]")
