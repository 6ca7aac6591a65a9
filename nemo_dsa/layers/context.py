"""The sequence (context-parallel) handle that the attention layers talk to.

Layer code never touches process groups: it asks a ``SequenceContext`` for the pieces of the
sequence held by other ranks. ``LocalContext`` is the single-rank identity. The torch.distributed
implementation (``nemo_dsa.distributed.ProcessGroupContext``) implements this protocol; it lives in
``nemo_dsa/distributed`` so that importing a layer never imports torch.distributed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class SequenceContext(ABC):
    """Contiguous sequence sharding: rank ``rank`` of ``size`` holds tokens [rank*S, (rank+1)*S)."""

    rank: int = 0
    size: int = 1

    @abstractmethod
    def gather_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's shard of ``x`` along ``dim`` in rank order (autograd-aware)."""

    @abstractmethod
    def previous_tail(self, x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
        """The last ``n`` entries of the previous rank's ``x`` along ``dim`` (autograd-aware).

        Rank 0 gets zeros; callers mask them through the metadata (they belong to no document).
        """


class LocalContext(SequenceContext):
    """No context parallelism: the local shard is the whole sequence."""

    def gather_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x

    def previous_tail(self, x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] = n
        return x.new_zeros(shape)
