"""Count the host reads of tensor values (what is a device-to-host sync on a GPU), on the CPU.

``count_host_reads()`` patches the ``torch.Tensor`` methods and torch functions that read a
tensor's values on the host, or give a result whose shape depends on them (``item``, ``tolist``,
``bool()``/``int()``/``float()``/``operator.index``, ``nonzero``, ``unique``, boolean-mask
indexing, ``cpu``/``numpy``), and attributes each call to the innermost nemo_dsa source line
that made it: the first caller outside torch must be nemo_dsa code (reads by nemo-automodel's own
modules, e.g. its MoE routing, are not counted, nor are reads nested inside a counted one). The
``torch.cuda.set_sync_debug_mode`` notion of a sync, without a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading

import torch

import nemo_dsa

_PACKAGE = os.path.dirname(os.path.abspath(nemo_dsa.__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")
_FUNCTIONS = ("nonzero", "unique")
_state = threading.local()


class HostReads:
    """Counted reads: ``sites`` lists (nemo_dsa file relative to the package, line, what) per read."""

    def __init__(self) -> None:
        self.sites: list[tuple[str, int, str]] = []

    @property
    def total(self) -> int:
        return len(self.sites)

    def by_site(self) -> collections.Counter:
        return collections.Counter(f"{path}:{line} {what}" for path, line, what in self.sites)

    def outside(self, *prefixes: str) -> list[tuple[str, int, str]]:
        """The reads made from nemo_dsa files not under any of ``prefixes`` (e.g. "ops/")."""
        return [site for site in self.sites if not site[0].startswith(prefixes)]


def _caller_site() -> tuple[str, int] | None:
    """The first caller outside torch (and this module): a nemo_dsa line, else None (not ours)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(_PACKAGE):
        return None
    return os.path.relpath(frame.f_code.co_filename, _PACKAGE), frame.f_lineno


def _counting(original, what: str, reads: HostReads, condition=None):
    def wrapper(*args, **kwargs):
        if getattr(_state, "inside", False) or (condition is not None and not condition(*args, **kwargs)):
            return original(*args, **kwargs)
        site = _caller_site()
        if site is not None and all(isinstance(a, torch.Tensor) and a.device.type != "meta" for a in args[:1]):
            reads.sites.append((*site, what))
        _state.inside = True
        try:
            return original(*args, **kwargs)
        finally:
            _state.inside = False

    return wrapper


def _bool_mask_index(tensor, index, *_):
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextlib.contextmanager
def count_host_reads():
    """``with count_host_reads() as reads: ...``; ``reads`` holds what the block read on the host."""
    reads = HostReads()
    saved = []
    for name in _METHODS:
        saved.append((torch.Tensor, name, getattr(torch.Tensor, name)))
        setattr(torch.Tensor, name, _counting(getattr(torch.Tensor, name), name, reads))
    saved.append((torch.Tensor, "__getitem__", torch.Tensor.__getitem__))
    torch.Tensor.__getitem__ = _counting(torch.Tensor.__getitem__, "bool-mask index", reads, _bool_mask_index)
    for name in _FUNCTIONS:
        saved.append((torch, name, getattr(torch, name)))
        setattr(torch, name, _counting(getattr(torch, name), f"torch.{name}", reads))
    try:
        yield reads
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
