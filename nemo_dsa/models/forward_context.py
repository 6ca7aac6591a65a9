"""What one model forward hands its attention layers: the sequence context and the metadata per ratio.

Every nemo_dsa model (the small LM and the DeepSeek-V4 / V4.1 plugins, whose attention layers may
also be called on their own) turns a forward's inputs into the same two things here, in one place:
the CP group becomes a ``SequenceContext`` (``LocalContext`` without context parallelism, or for a
group of one rank) and the batch layout becomes one ``AttentionMetadata`` per compression ratio
(window-only layers use ratio 1) from a single check of the layout (one host read per forward).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_dsa.layers.context import LocalContext, SequenceContext
from nemo_dsa.layers.shared_state import SharedLayerState

__all__ = ["ForwardState", "build_forward_state", "forward_metadata", "metadata_ratios", "sequence_context"]


def sequence_context(cp_group: Any = None) -> SequenceContext:
    """``LocalContext`` for None, an uninitialised process group world or a one-rank group; a given
    ``SequenceContext`` as it is; otherwise nemo_dsa.distributed's context over ``cp_group``."""
    if cp_group is None or isinstance(cp_group, SequenceContext):
        return LocalContext() if cp_group is None else cp_group
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return LocalContext()
    from nemo_dsa.distributed.context import sequence_context_for

    ctx = sequence_context_for(cp_group)
    return ctx if ctx.size > 1 else LocalContext()


def metadata_ratios(compress_ratios: Iterable[int]) -> set[int]:
    """The ratios a forward needs metadata for: each layer's ratio, 1 for window-only layers
    (ratio 0) and for a model without compressed layers."""
    return {max(int(r), 1) for r in compress_ratios} or {1}


def forward_metadata(
    compress_ratios: Iterable[int],
    ctx: SequenceContext,
    *,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    extra_checks=(),
    **layout: torch.Tensor | None,
) -> dict:
    """``{ratio: AttentionMetadata}`` of this rank's shard (``ctx``) for the layers' ratios.

    ``layout``: ``nemo_dsa.metadata.build_attention_metadata`` keywords (``position_ids``,
    ``seq_lens``, ``seq_lens_padded``, ``cu_seqlens``, ``packed_seq_ids``, ``attention_mask``);
    None entries are left out, tensors move to ``device`` (a collator may build them on the host).
    """
    from nemo_dsa.metadata import build_attention_metadata_for_ratios

    layout = {k: v.to(device) for k, v in layout.items() if v is not None}
    return build_attention_metadata_for_ratios(
        compress_ratios=metadata_ratios(compress_ratios), cp_rank=ctx.rank, cp_size=ctx.size,
        batch_size=batch_size, seq_len=seq_len, device=device, extra_checks=extra_checks, **layout,
    )  # fmt: skip


@dataclass
class ForwardState:
    """What one model forward hands every attention layer."""

    metadata: dict  # compression ratio (1 for window-only layers) -> AttentionMetadata
    ctx: SequenceContext
    shared: SharedLayerState = field(default_factory=SharedLayerState)  # ratio-4 sources publish here
    aux_losses: list = field(default_factory=list)  # indexer KL losses, when enabled


def build_forward_state(
    compress_ratios: Iterable[int],
    cp_group: Any = None,
    *,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    extra_checks=(),
    **layout: torch.Tensor | None,
) -> ForwardState:
    """The sequence context of ``cp_group`` and the metadata of ``layout`` for one forward."""
    ctx = sequence_context(cp_group)
    metadata = forward_metadata(
        compress_ratios, ctx, batch_size=batch_size, seq_len=seq_len, device=device, extra_checks=extra_checks,
        **layout,
    )  # fmt: skip
    return ForwardState(metadata, ctx)
