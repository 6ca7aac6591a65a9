"""``sequence_context_for``: a trainer's context-parallel group -> the layers' ``SequenceContext``.

The protocol and its single-rank identity live in ``nemo_dsa.layers.context`` (importable without
torch.distributed); ``ProcessGroupContext`` (``process_group.py``) implements it over a group.
"""

from __future__ import annotations

from nemo_dsa.layers.context import LocalContext, SequenceContext

__all__ = ["LocalContext", "SequenceContext", "sequence_context_for"]


def sequence_context_for(cp_group=None) -> SequenceContext:
    """The context for ``cp_group``: None = no CP (``LocalContext``), a ``SequenceContext`` as
    given, otherwise a torch.distributed process group (or 1-D DeviceMesh)."""
    if cp_group is None:
        return LocalContext()
    if isinstance(cp_group, SequenceContext):
        return cp_group
    from nemo_dsa.distributed.process_group import ProcessGroupContext

    return ProcessGroupContext(cp_group)
