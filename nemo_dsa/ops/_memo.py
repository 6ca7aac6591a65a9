"""Host-side facts about device tensors, remembered while the tensors stay unchanged.

Every indexer layer of a step receives the same metadata tensors (ks, ke). Facts that need their
values on the host (the validation of their ranges, the chunk plan of the streamed selection)
would otherwise cost one device-to-host sync per layer and call: each sync drains the GPU queue
and leaves the device idle while the host catches up. A fact is stored on the first tensor and
reused while every tensor is the same object at the same version: torch bumps ``_version`` on
each in-place op, so a modified tensor invalidates the fact. (A raw write through
``data_ptr()`` by foreign code would not; nemo_dsa never writes its metadata in place.)
"""

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

_ATTRIBUTE = "_nemo_dsa_memo"


def memo_on_tensors(tensors: Sequence[torch.Tensor], key: Hashable, compute: Callable[[], Any]) -> Any:
    """``compute()``, or its remembered value for these very tensors at their current versions.

    Inference tensors (made under ``torch.inference_mode``) have no version counter, so nothing
    is remembered for them: every call computes.
    """
    if any(t.is_inference() for t in tensors):
        return compute()
    anchor = tensors[0]
    store = anchor.__dict__.setdefault(_ATTRIBUTE, {})
    versions = tuple(t._version for t in tensors)
    entry = store.get(key)
    if entry is not None:
        refs, seen_versions, value = entry
        # Weak references, so a remembered fact never keeps the other tensors alive, and a tensor
        # freed and replaced at the same address cannot pass for the old one.
        if seen_versions == versions and all(ref() is t for ref, t in zip(refs, tensors[1:])):
            return value
    value = compute()
    store[key] = (tuple(weakref.ref(t) for t in tensors[1:]), versions, value)
    return value
