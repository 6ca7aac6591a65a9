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
context). An attention that makes a new kv source or selection returns a new state object holding
a fresh ``SharedLayerState``; one with nothing new (window-only and reuse layers) returns the state
it received, so no state a layer received is changed afterwards (activation recomputation replays
a layer on the state it first saw, as with the built-in's immutable state). The state reads as the
built-in's where callers look (``DsaV41ForwardState``); what it holds for padding (groups with a
padding token, queries that are padding) is never attended and may differ from the built-in's.

Context parallelism: the built-in's own CP sharder (``prepare_model_inputs_for_cp``: documents
aligned to the compression multiple, the row padded to ``cp_size * lcm(ratios)``, contiguous
shards) hands every rank its shard's document-local ``position_ids`` (global positions on plain
rows), ``packed_seq_ids``, ``attention_mask`` and ``cp_group``, which the built-in forward passes
to each block's attention. The first attention builds the shard's metadata from them (``cp_rank``,
``cp_size``) and nemo_dsa's ``SequenceContext`` over the group, through which the layers gather
the compressed KV and index keys and read the previous rank's window tail.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from nemo_dsa.integrations.common.attention_layout import CoreAttention, adopt_builtin_layout
from nemo_dsa.integrations.deepseek_v41.configuration import resolve_dsa_config
from nemo_dsa.layers.norm import RMSNorm
from nemo_dsa.layers.rope import rope_angles
from nemo_dsa.layers.shared_state import SharedLayerState
from nemo_dsa.models.forward_context import build_forward_state

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
    """nemo_dsa's state of one V4.1 forward, as the built-in blocks thread it from layer to layer.

    It reads as the built-in's ``DeepseekV41AttentionState`` where callers look: ``compressed_kv``
    (the latest kv source's rotated, cache-rounded compressed KV ``[B, K, head_dim]``),
    ``index_keys`` ``[B, K, index_head_dim]``, ``topk_indices`` (compressed-relative ``[B, S, topk]``,
    -1 = nothing) and ``compression_ratio`` (0 until a kv source ran)."""

    metadata: dict  # compression ratio (1 for window-only layers) -> AttentionMetadata
    ctx: Any  # nemo_dsa SequenceContext
    shared: SharedLayerState  # the latest kv source's compressed KV, index keys, selection
    compression_ratio: int = 0  # the latest kv source's ratio; a consumer of another ratio is refused
    candidate_block_size: int = 1  # compressed positions per candidate block (the config's)
    # Dense views made on first read (``candidates``), shared by the states of one forward so that a
    # view of the same tensors is one object, as the built-in hands the same tensor on.
    views: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def compressed_kv(self) -> torch.Tensor | None:
        return None if self.shared.source is None else self.shared.source.compressed_kv

    @property
    def index_keys(self) -> torch.Tensor | None:
        return None if self.shared.source is None else self.shared.source.selection.index_keys

    @property
    def topk_indices(self) -> torch.Tensor | None:
        return None if self.shared.source is None else self.shared.source.selection.topk_indices

    @property
    def compressed_valid(self) -> torch.Tensor | None:
        """``bool [B, K]``: compressed positions whose R tokens are all real ones of one document,
        on the global compressed axis (gathered over the CP group)."""
        if self.shared.source is None:
            return None
        cached = self.views.get(("compressed_valid", self.compression_ratio))
        if cached is None:
            local = self.metadata[self.compression_ratio].group_valid
            cached = self.ctx.gather_sequence(local.to(torch.uint8), 1).bool()
            self.views[("compressed_valid", self.compression_ratio)] = cached
        return cached

    @property
    def candidates(self) -> torch.Tensor | None:
        """The candidate source's kept blocks as the built-in's mask ``bool [B, S, K]``: the visible
        compressed positions ``[ks, ke)`` of each query whose block (counted from ``ks``) was kept."""
        source = self.shared.source
        blocks = None if source is None else source.candidate_blocks
        if blocks is None:
            return None
        cached = self.views.get("candidates")
        if cached is None or cached[0] is not blocks:
            meta = self.metadata[source.ratio]
            keys = torch.arange(source.compressed_kv.shape[1], device=blocks.device)
            ks, ke = meta.ks.long().unsqueeze(-1), meta.ke.long().unsqueeze(-1)
            visible = (keys >= ks) & (keys < ke)
            block_of_key = torch.div(keys - ks, self.candidate_block_size, rounding_mode="floor")
            kept = (block_of_key.unsqueeze(-1) == blocks.long().unsqueeze(-2)).any(-1)
            cached = (blocks, visible & kept)
            self.views["candidates"] = cached
        return cached[1]


@dataclass(frozen=True)
class NemoDsaV41AttentionOutput:
    """What a V4.1 block reads from its attention: ``hidden_states [B, S, hidden]`` and ``state``;
    ``attentions``: the probabilities ``[B, H, S, S * cp_size + K]`` when the caller asked for them
    (``output_attentions=True``), else None."""

    hidden_states: torch.Tensor
    state: DsaV41ForwardState
    attentions: torch.Tensor | None = None


def _check_backend(backend, attention_dropout: float) -> None:
    """The built-in's backend contract, refused with the built-in's words (``torch`` also selects
    nemo_dsa's torch kernels)."""
    if backend.attn not in ("eager", "sdpa", "tilelang", "torch"):
        raise ValueError(
            f"DeepSeek V4.1 attention supports backend.attn='eager', 'sdpa', or 'tilelang' (got {backend.attn!r})"
        )
    if backend.attn == "tilelang" and attention_dropout:
        raise ValueError(
            f"The TileLang sparse attention backend requires attention_dropout=0 (got {attention_dropout})"
        )
    if backend.linear != "torch" or backend.rms_norm not in ("torch_fp32", "te"):
        raise ValueError(
            "DeepSeek V4.1 attention requires torch linear layers and torch_fp32 or te RMSNorm "
            f"(got backend.linear={backend.linear!r}, backend.rms_norm={backend.rms_norm!r})"
        )


def _refusal(message: str):
    def raise_error():
        raise ValueError(message)

    return raise_error


def _layout_checks(position_ids, attention_mask, packed_seq_ids, batch: int, seq: int, cp_group) -> list:
    """The built-in's input contract, refused in its words: ``position_ids`` ``[B|1, S]``, on rows
    the contiguous global positions (no packing by position resets: packs come with
    ``packed_seq_ids``); a binary right-padding ``attention_mask [B, S]``. Shapes are checked here;
    the value checks come back as ``(bad, raise_error)`` pairs for the metadata's one host read."""
    if tuple(position_ids.shape) not in ((1, seq), (batch, seq)):
        raise ValueError(
            "DeepSeek V4.1 position_ids must have shape [batch, sequence] or [1, sequence] "
            f"(got {tuple(position_ids.shape)})"
        )
    checks = []
    if packed_seq_ids is None:
        rank = 0 if cp_group is None else torch.distributed.get_rank(cp_group)
        expected = torch.arange(seq, device=position_ids.device) + rank * seq
        checks.append((
            (position_ids != expected.expand_as(position_ids)).any(),
            _refusal("DeepSeek V4.1 attention supports only contiguous zero-based full-sequence position_ids "
                     "(packed documents come with packed_seq_ids)"),
        ))  # fmt: skip
    elif tuple(packed_seq_ids.shape) != (batch, seq):
        raise ValueError(f"packed_seq_ids must have shape [batch, local_sequence] (got {tuple(packed_seq_ids.shape)})")
    if attention_mask is None:
        return checks
    if tuple(attention_mask.shape) != (batch, seq):
        raise ValueError(
            f"DeepSeek V4.1 attention_mask must have shape [batch, sequence] (got {tuple(attention_mask.shape)})"
        )
    checks.append((
        ((attention_mask != 0) & (attention_mask != 1)).any(),
        _refusal("DeepSeek V4.1 attention_mask must contain only zero and one"),
    ))  # fmt: skip
    if packed_seq_ids is None:
        valid = attention_mask.bool()
        checks.append((
            (valid[:, 1:] & ~valid[:, :-1]).any(),
            _refusal("DeepSeek V4.1 compression supports right padding only (attention_mask has a 0 before a 1)"),
        ))  # fmt: skip
    return checks


class RotaryAngles(nn.Module):
    """The layer's RoPE as the built-in's ``rotary_emb`` describes and computes it: ``dim``,
    ``theta``; YaRN ``factor``, ``original_length`` (0 = no YaRN), ``beta_fast``, ``beta_slow``
    (YaRN on compressed layers only, as in the release); ``forward(position_ids)`` -> fp32 angles
    ``[..., dim // 2]``. It holds no tensors (nothing to save or shard)."""

    def __init__(self, dim: int, theta: float, scaling) -> None:
        super().__init__()
        self.dim, self.theta, self.scaling = dim, float(theta), scaling
        yarn = scaling or {}
        self.factor = float(yarn.get("factor", 1.0))
        self.original_length = int(yarn.get("original_max_position_embeddings", 0))
        self.beta_fast, self.beta_slow = float(yarn.get("beta_fast", 32)), float(yarn.get("beta_slow", 1))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return rope_angles(position_ids, self.dim, self.theta, self.scaling)


class NemoDsaDeepseekV41Attention(CoreAttention):
    """Drop-in ``attn`` of a DeepSeek-V4.1 block that computes with nemo_dsa (see module docstring)."""

    def __init__(self, config, layer_idx: int, backend: Any = None, *, dsa_config=None, **options: Any) -> None:
        from nemo_automodel.components.models.common import BackendConfig

        backend = backend or BackendConfig()
        text = getattr(config, "text_config", None) or config
        _check_backend(backend, float(getattr(text, "attention_dropout", 0.0) or 0.0))
        standalone = dsa_config is None
        if standalone:
            dsa_config = resolve_dsa_config(config, backend, options)
        if options:
            raise TypeError(f"NemoDsaDeepseekV41Attention got unexpected keyword arguments {sorted(options)}")
        super().__init__(
            dsa_config, layer_idx, V41_BUILTIN_TO_NEMO_MODULES, V41_BUILTIN_TO_NEMO_TENSORS, "DeepseekV41Attention"
        )
        self.dsa_config = dsa_config
        self.backend = backend
        self.cp_group = None
        self.num_heads = text.num_attention_heads
        self.head_dim = text.head_dim
        self.num_groups = text.o_groups
        self.window_size = text.sliding_window
        self.attention_dropout = float(getattr(text, "attention_dropout", 0.0) or 0.0)
        self.is_kv_source = layer_idx in text.kv_source_layer_ids
        self.is_index_source = layer_idx in text.index_source_layer_ids
        self.rotary_emb = RotaryAngles(self._core.rope_dim, self._core.rope_theta, self._core.rope_scaling)
        for absent in ("compressor", "indexer"):
            if not hasattr(self, absent):
                setattr(self, absent, None)  # as the built-in's layers without them
        if standalone:  # the built-in's dtypes (its config's torch_dtype), checked name by name
            from nemo_automodel.components.models.deepseek_v41.attention import DeepseekV41Attention

            with torch.device("meta"):
                builtin = DeepseekV41Attention(text, layer_idx, backend)
            adopt_builtin_layout(builtin, self, layer_idx)


    def setup_cp_attention(self, cp_mesh) -> None:
        """nemo-automodel's CP hook: the group that calls without ``cp_group`` use."""
        self.cp_group = cp_mesh.get_group()

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
        output_attentions: bool = False,
    ) -> NemoDsaV41AttentionOutput:
        """Attend over ``hidden_states [B, S, hidden]`` (the local shard under CP); ``state``: the
        previous attention's (module docstring). ``output_attentions`` (HF's keyword; the built-in
        returns no weights, so off by default): also return the attention probabilities, dense as
        V4's built-in lays them out (``DSASparseAttention._attend_with_probabilities``)."""
        batch, seq = hidden_states.shape[:2]
        consumer = self.compress_ratio > 0 and self.compressor is None
        has_source = getattr(state, "compressed_kv", None) is not None
        if consumer and (not has_source or state.compression_ratio != self.compress_ratio):
            raise ValueError(
                f"layer {self.layer_idx} (compression ratio {self.compress_ratio}) reuses a kv source: a CSA2 consumer "
                "requires a preceding Full layer with the same compression ratio"
            )
        fresh = not isinstance(state, DsaV41ForwardState)  # the forward's first attention layer, or a layer alone
        if not fresh:
            meta = state.metadata[max(self.compress_ratio, 1)]
            if (meta.batch_size, meta.seq_len) != (batch, seq):
                if consumer:
                    raise ValueError(
                        f"state: the CSA2 state an earlier layer built belongs to a different batch or sequence "
                        f"([B, S] = [{meta.batch_size}, {meta.seq_len}]), "
                        f"got hidden_states of [B, S] = [{batch}, {seq}] "
                        f"(layer {self.layer_idx}, which reuses it)"
                    )
                fresh = True  # a kv source or window layer starts its own forward, as the built-in's
        if fresh:
            state = self._own_forward_state(hidden_states, position_ids, attention_mask, packed_seq_ids, cp_group)
        shared = SharedLayerState(source=state.shared.source)
        meta = state.metadata[max(self.compress_ratio, 1)]
        result = self.call_core(hidden_states, meta, state.ctx, shared, probabilities=output_attentions)
        out, aux = result[:2]
        probs = result[2] if output_attentions else None
        if aux is not None:
            raise ValueError("the V4.1 indexer is frozen: no indexer loss exists (indexer_kl_coef must be 0)")
        if shared.source is state.shared.source:  # nothing new to hand on: the same state, as the built-in
            return NemoDsaV41AttentionOutput(out, state, probs)
        ratio = self.compress_ratio if self.compressor is not None else state.compression_ratio
        return NemoDsaV41AttentionOutput(out, replace(state, shared=shared, compression_ratio=ratio), probs)

    def _own_forward_state(self, hidden_states, position_ids, attention_mask, packed_seq_ids, cp_group):
        batch, seq = hidden_states.shape[:2]
        group = self.cp_group if cp_group is None else cp_group
        cp_size = 1 if group is None else torch.distributed.get_world_size(group)
        straddling = sorted({r for r in self.dsa_config.compress_ratios if r > 1 and seq % r})
        if cp_size > 1 and straddling:
            # Every layer's metadata is built here, so a ratio of any layer that splits a group across ranks is refused.
            raise ValueError(
                f"DeepSeek V4.1 CP shards must contain complete compression groups: local length {seq} is not a "
                f"multiple of compression ratio(s) {straddling}"
            )
        # Read with the metadata's own flags (one host read), so they must sit on its device.
        checks = [(bad.to(hidden_states.device), refuse)
                  for bad, refuse in _layout_checks(position_ids, attention_mask, packed_seq_ids, batch, seq, group)]  # fmt: skip
        if position_ids.shape[0] != batch:
            position_ids = position_ids.expand(batch, -1)
        if packed_seq_ids is not None:
            # Rows: position_ids and the right-padding attention_mask. Packs (the built-in's aligned
            # THD layout): document-local position_ids and packed_seq_ids, 0 = padding.
            if attention_mask is not None:
                packed_seq_ids = packed_seq_ids * attention_mask.to(packed_seq_ids.dtype)
            layout = {"position_ids": position_ids, "packed_seq_ids": packed_seq_ids}
        else:
            layout = {"position_ids": position_ids, "attention_mask": None if attention_mask is None else attention_mask.long()}
        forward = build_forward_state(
            self.dsa_config.compress_ratios, self.cp_group if cp_group is None else cp_group, batch_size=batch,
            seq_len=seq, device=hidden_states.device, extra_checks=checks, **layout,
        )  # fmt: skip
        return DsaV41ForwardState(
            forward.metadata, forward.ctx, forward.shared, candidate_block_size=self.dsa_config.candidate_block_size
        )

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02) -> None:
        """The built-in's initialisation: normal projections, unit norm scales, zero sinks."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=init_std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        nn.init.zeros_(self.sinks_param.weight)
