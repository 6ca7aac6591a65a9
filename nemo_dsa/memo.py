"""Host-side facts about device tensors, remembered while the tensors stay unchanged.

Every indexer layer of a step receives the same metadata tensors (ks, ke). Facts that need their
values on the host (the validation of their ranges, the chunk plan of the streamed selection)
would otherwise cost one device-to-host sync per layer and call: each sync drains the GPU queue
and leaves the device idle while the host catches up. A fact is reused while every tensor is the
same object at the same version: torch bumps ``_version`` on each in-place op, so a modified
tensor invalidates the fact. (A raw write through ``data_ptr()`` by foreign code would not;
nemo_dsa never writes its metadata in place.)

The facts live in a module table keyed by the first tensor's identity, dropped when that tensor
is freed, and hold only weak references to the tensors: nothing is attached to the tensors
themselves, so they still pickle (torch.save, DataLoader workers) and are never kept alive here.
"""

import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

# id(anchor tensor) -> (weak reference to it, {key: (weak refs to the other tensors, versions, value)})
_facts: dict[int, tuple[weakref.ref, dict]] = {}
_lock = threading.Lock()


def _facts_of(anchor: torch.Tensor) -> dict:
    with _lock:
        entry = _facts.get(id(anchor))
        if entry is not None and entry[0]() is anchor:
            return entry[1]
        facts: dict = {}
        # The callback runs when the anchor is freed, before its id can be reused.
        ref = weakref.ref(anchor, lambda _, key=id(anchor): _facts.pop(key, None))
        _facts[id(anchor)] = (ref, facts)
        return facts


def memo_on_tensors(tensors: Sequence[torch.Tensor], key: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()``, or its remembered value for these very tensors at their current versions.

    Inference tensors (made under ``torch.inference_mode``) have no version counter, so nothing
    is remembered for them: every call computes.
    """
    if any(t.is_inference() for t in tensors):
        return compute()
    facts = _facts_of(tensors[0])
    versions = tuple(t._version for t in tensors)
    entry = facts.get(key)
    if entry is not None:
        refs, seen_versions, value = entry
        # A tensor freed and replaced at the same address cannot pass for the old one.
        if seen_versions == versions and all(ref() is t for ref, t in zip(refs, tensors[1:])):
            return value
    value = compute()
    facts[key] = (tuple(weakref.ref(t) for t in tensors[1:]), versions, value)
    return value



def anchors() -> set[int]:
    """Ids of the tensors facts are held for: an entry must go when its anchor is freed."""
    with _lock:
        return set(_facts)
