"""nemo_dsa's attention inside nemo-automodel's DeepSeek-V4.1 blocks, under the built-in's parameter names.

``NemoDsaDeepseekV41Attention`` replaces a block's ``attn``. It computes with nemo_dsa's
``DSASparseAttention`` configured as the release (``DSAModelConfig.from_hf_config`` of the V4.1
text config: roles on ratios 1 and 2, latent index keys, fp8 window KV, NVFP4 compressed KV, the
frozen MXFP4 indexer, candidate blocks), through the layout adapter the V4 plugin uses
(``common.attention_layout.CoreAttention``). The V4.1 attention names are the HF checkpoint's
(``compressor.{wkv,wgate,norm}``, ``indexer.{wq_b,weights_proj,wk,k_norm}``), which are also
nemo_dsa's, except the sink: ``sinks_param.weight`` holds nemo_dsa's ``attn_sink``.

Cross-layer state: the built-in's blocks hand each attention the state the previous attention
returned. The first attention of a forward receives the model's empty built-in state and builds
nemo_dsa's per-forward state from the block's inputs (``position_ids``, ``attention_mask``,
``packed_seq_ids``, ``cp_group``: one ``AttentionMetadata`` per compression ratio and the sequence
context); every attention returns a
new state object holding a fresh ``SharedLayerState`` with the latest kv source, so no state a
layer received is changed afterwards (activation recomputation replays a layer on the state it
first saw, as with the built-in's immutable state).

Context parallelism: the built-in's own CP sharder (``prepare_model_inputs_for_cp``: documents
aligned to the compression multiple, the row padded to ``cp_size * lcm(ratios)``, contiguous
shards) hands every rank its shard's document-local ``position_ids`` (global positions on plain
rows), ``packed_seq_ids``, ``attention_mask`` and ``cp_group``, which the built-in forward passes
to each block's attention. The first attention builds the shard's metadata from them (``cp_rank``,
``cp_size``) and nemo_dsa's ``SequenceContext`` over the group, through which the layers gather
the compressed KV and index keys and read the previous rank's window tail.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from nemo_dsa.integrations.common.attention_layout import CoreAttention
from nemo_dsa.layers.context import LocalContext
from nemo_dsa.layers.norm import RMSNorm
from nemo_dsa.layers.shared_state import SharedLayerState
from nemo_dsa.metadata import build_attention_metadata_for_ratios

__all__ = ["V41_BUILTIN_TO_NEMO_MODULES", "V41_BUILTIN_TO_NEMO_TENSORS", "NemoDsaDeepseekV41Attention"]

# Built-in DeepseekV41Attention submodule name -> the nemo_dsa DSASparseAttention submodule it is.
V41_BUILTIN_TO_NEMO_MODULES = {
    name: name
    for name in (
        "wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b", "compressor.wkv", "compressor.wgate",
        "compressor.norm", "indexer.wq_b", "indexer.weights_proj", "indexer.wk", "indexer.k_norm",
    )
}  # fmt: skip
V41_BUILTIN_TO_NEMO_TENSORS = {"sinks_param": "attn_sink"}


@dataclass(frozen=True)
class DsaV41ForwardState:
    """nemo_dsa's state of one V4.1 forward, as the built-in blocks thread it from layer to layer."""

    metadata: dict  # compression ratio (1 for window-only layers) -> AttentionMetadata
    ctx: Any  # nemo_dsa SequenceContext
    shared: SharedLayerState  # the latest kv source's compressed KV, index keys, selection


@dataclass(frozen=True)
class NemoDsaV41AttentionOutput:
    """What a V4.1 block reads from its attention: ``hidden_states [B, S, hidden]`` and ``state``."""

    hidden_states: torch.Tensor
    state: DsaV41ForwardState


def forward_metadata(
    ratios, *, position_ids, attention_mask=None, packed_seq_ids=None, cp_rank: int = 0, cp_size: int = 1
) -> dict:
    """``AttentionMetadata`` per distinct ratio of ``ratios`` (window-only layers use ratio 1).

    Rows: ``position_ids`` (global, 0..S-1 over the whole row) and the right-padding
    ``attention_mask``. Packs (the built-in's aligned THD layout): document-local ``position_ids``
    and ``packed_seq_ids`` (0 = padding). Under CP all are the local shard's (``cp_rank`` of
    ``cp_size`` contiguous shards)."""
    if packed_seq_ids is not None:
        if attention_mask is not None:
            packed_seq_ids = packed_seq_ids * attention_mask.to(packed_seq_ids.dtype)
        layout = {"position_ids": position_ids, "packed_seq_ids": packed_seq_ids}
    else:
        layout = {"position_ids": position_ids}
        if attention_mask is not None:
            layout["attention_mask"] = attention_mask.long()
    # Every ratio from one layout check: one host read per forward.
    return build_attention_metadata_for_ratios(
        compress_ratios={max(int(r), 1) for r in ratios}, cp_rank=cp_rank, cp_size=cp_size, **layout
    )


def active_cp_group(cp_group):
    """``cp_group`` when it spans more than one rank of an initialised process group, else None."""
    if cp_group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return cp_group if torch.distributed.get_world_size(group=cp_group) > 1 else None


class NemoDsaDeepseekV41Attention(CoreAttention):
    """Drop-in ``attn`` of a DeepSeek-V4.1 block that computes with nemo_dsa (see module docstring)."""

    def __init__(self, dsa_config, layer_idx: int) -> None:
        super().__init__(
            dsa_config, layer_idx, V41_BUILTIN_TO_NEMO_MODULES, V41_BUILTIN_TO_NEMO_TENSORS, "DeepseekV41Attention"
        )
        self.dsa_config = dsa_config

    @property
    def attn_sink(self) -> nn.Parameter:
        """The per-head fp32 sink logits (the built-in's accessor)."""
        return self.sinks_param.weight

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        state: Any,
        attention_mask: torch.Tensor | None = None,
        cp_group: Any = None,
        packed_seq_ids: torch.Tensor | None = None,
    ) -> NemoDsaV41AttentionOutput:
        """Attend over ``hidden_states [B, S, hidden]`` (the local shard under CP); ``state``: the
        previous attention's (module docstring)."""
        if not isinstance(state, DsaV41ForwardState):  # the forward's first attention layer
            from nemo_dsa.distributed.context import sequence_context_for

            group = active_cp_group(cp_group)
            ctx = sequence_context_for(group) if group is not None else LocalContext()
            if position_ids.shape[0] != hidden_states.shape[0]:
                position_ids = position_ids.expand(hidden_states.shape[0], -1)
            metadata = forward_metadata(
                self.dsa_config.compress_ratios, position_ids=position_ids, attention_mask=attention_mask,
                packed_seq_ids=packed_seq_ids, cp_rank=ctx.rank, cp_size=ctx.size,
            )  # fmt: skip
            state = DsaV41ForwardState(metadata, ctx, SharedLayerState())
        shared = SharedLayerState(source=state.shared.source)
        out, aux = self.call_core(hidden_states, state.metadata[max(self.compress_ratio, 1)], state.ctx, shared)
        if aux is not None:
            raise ValueError("the V4.1 indexer is frozen: no indexer loss exists (indexer_kl_coef must be 0)")
        return NemoDsaV41AttentionOutput(out, replace(state, shared=shared))

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02) -> None:
        """The built-in's initialisation: normal projections, unit norm scales, zero sinks."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=init_std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        nn.init.zeros_(self.sinks_param.weight)
