"""nemo_dsa's attention inside nemo-automodel's DeepSeek-V4 blocks, under the built-in's parameter names.

``NemoDsaDeepseekV4Attention`` replaces a block's ``self_attn``. It computes with nemo_dsa's
``DSASparseAttention`` (nemo_dsa's metadata, compressor, indexer, selection and attention ops),
but its parameters sit where nemo-automodel's ``DeepseekV4Attention`` keeps them
(``sinks_param.weight``, ``compressor.ape_param.weight``, ``compressor.kv_norm``,
``compressor.indexer.*``), so the built-in's state-dict adapter, its FSDP2 wrapping (fp32 islands
found by module name) and its ``_keep_in_fp32_modules_strict`` list apply unchanged
(``common.attention_layout``).

It is built as the built-in is, ``(config, layer_idx, backend)``, and has its forward signature,
its ``sinks``, ``setup_cp_attention`` and, on ratio-128 layers, the compressor's FSDP hooks
(``_set_hca_param_sync_group``, ``_compute_fsdp_group_has_complete_hca_window``).

The per-forward metadata (one ``AttentionMetadata`` per compression ratio, the sequence context and
the layers' shared state) is built once by ``NemoDsaDeepseekV4ForCausalLM.forward`` and reaches
every layer as the ``nemo_dsa_forward`` keyword, which nemo-automodel's blocks pass through to
their attention untouched. Called on its own, a layer builds it from what the built-in's attention
receives (``position_ids``, ``packed_seq_ids``, the CP group, and the padding that the additive
``attention_mask`` marks: a token whose own diagonal entry is masked is padding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nemo_dsa.integrations.common.attention_layout import CoreAttention, adopt_builtin_layout
from nemo_dsa.integrations.deepseek_v4.configuration import resolve_dsa_config
from nemo_dsa.models.forward_context import ForwardState, build_forward_state, sequence_context

__all__ = [
    "BUILTIN_TO_NEMO_MODULES",
    "BUILTIN_TO_NEMO_TENSORS",
    "DeepseekV4Compressor",
    "DsaForwardState",
    "NemoDsaDeepseekV4Attention",
]

# The state one model forward hands every attention layer (nemo_dsa.models.forward_context).
DsaForwardState = ForwardState
# nemo-automodel's compressors keep the HCA window alignment for ratio 128 only.
_HCA_RATIO = 128

# Built-in DeepseekV4Attention submodule name -> the nemo_dsa DSASparseAttention submodule it is.
BUILTIN_TO_NEMO_MODULES = {
    "wq_a": "wq_a",
    "q_norm": "q_norm",
    "wq_b": "wq_b",
    "wkv": "wkv",
    "kv_norm": "kv_norm",
    "wo_a": "wo_a",
    "wo_b": "wo_b",
    "compressor.wkv": "compressor.wkv",
    "compressor.wgate": "compressor.wgate",
    "compressor.kv_norm": "compressor.norm",
    "compressor.indexer.wkv": "indexer.compressor.wkv",
    "compressor.indexer.wgate": "indexer.compressor.wgate",
    "compressor.indexer.kv_norm": "indexer.compressor.norm",
    "compressor.indexer.wq_b": "indexer.wq_b",
    "compressor.indexer.weights_proj": "indexer.weights_proj",
}
# Built-in one-parameter holder module -> the nemo_dsa tensor it stores (held by ``core`` itself).
BUILTIN_TO_NEMO_TENSORS = {
    "sinks_param": "attn_sink",
    "compressor.ape_param": "compressor.ape",
    "compressor.indexer.ape_param": "indexer.compressor.ape",
}



class DeepseekV4Compressor(nn.Module):
    """The plugin layout's ``compressor`` (its projections, norm and position bias are registered
    by ``CoreAttention``), with nemo-automodel's FSDP hooks for the ratio-128 (HCA) parameters.

    Named as nemo-automodel's compressor because its FSDP2 wrapping finds the HCA compressors by
    class name and hands each the 1-D FSDP group through ``_set_hca_param_sync_group``. The
    semantics are the built-in's: in training, a rank whose shard holds no complete 128-token
    window while a peer of that group holds one still sends its HCA parameters through the
    backward, with zero gradients, so that every rank of the group reduces the same parameters.
    """

    def __init__(self, compress_ratio: int) -> None:
        super().__init__()
        self.compress_ratio = compress_ratio
        self._hca_param_sync_group = None

    def _set_hca_param_sync_group(self, process_group) -> None:
        self._hca_param_sync_group = process_group

    def _compute_fsdp_group_has_complete_hca_window(self, local_has_complete_hca_window: bool, device) -> bool:
        """Whether any rank of the HCA sync group holds a complete window (this rank's answer
        without a group of more than one rank)."""
        group = self._hca_param_sync_group
        if group is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return local_has_complete_hca_window
        flag = torch.tensor(int(local_has_complete_hca_window), device=device, dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def zero_through_parameters(self, like: torch.Tensor) -> torch.Tensor:
        """A zero of ``like``'s dtype whose backward gives every parameter here a zero gradient."""
        zero = like.new_zeros(())
        for param in self.parameters():
            zero = zero + (param.sum() * 0).to(like.dtype)
        return zero


class NemoDsaDeepseekV4Attention(CoreAttention):
    """Drop-in ``self_attn`` of a DeepSeek-V4 block that computes with nemo_dsa (see module docstring).

    ``config``: the built-in's ``DeepseekV4Config``; ``backend``: its ``BackendConfig`` (``attn``
    ``tilelang`` / ``torch`` picks nemo_dsa's kernels). nemo_dsa options are config attributes
    (``nemo_dsa.integrations.deepseek_v4.configuration``); ``dsa_config`` (the model passes its
    own) replaces that resolution.
    """

    def __init__(self, config, layer_idx: int, backend: Any = None, *, dsa_config=None, **options: Any) -> None:
        from nemo_automodel.components.models.common import BackendConfig

        backend = backend or BackendConfig()
        standalone = dsa_config is None
        if standalone:
            dsa_config = resolve_dsa_config(config, backend, options)
        if options:
            raise TypeError(f"NemoDsaDeepseekV4Attention got unexpected keyword arguments {sorted(options)}")
        super().__init__(dsa_config, layer_idx, BUILTIN_TO_NEMO_MODULES, BUILTIN_TO_NEMO_TENSORS, "DeepseekV4Attention")
        self.config = config
        self.backend = backend
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads  # one KV head for every query head
        self.head_dim = config.head_dim
        self.rope_head_dim = config.qk_rope_head_dim
        self.sliding_window = dsa_config.sliding_window
        self.attention_dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        self.is_causal = True
        self.scaling = self.head_dim**-0.5
        if not hasattr(self, "compressor"):
            self.compressor = None  # a window-only layer, as the built-in's
        self._cp_group = None
        if standalone:  # the built-in's dtypes (e.g. bf16 norms in a bf16 config), checked name by name
            from nemo_automodel.components.models.deepseek_v4.layers import DeepseekV4Attention

            with torch.device("meta"):
                builtin = DeepseekV4Attention(config, layer_idx, backend)
            adopt_builtin_layout(builtin, self, layer_idx)


    def _container(self, dotted: str) -> nn.Module:
        if dotted == "compressor":
            return DeepseekV4Compressor(self.compress_ratio)
        return super()._container(dotted)

    @property
    def sinks(self) -> torch.Tensor:
        """The per-head fp32 sink logits (the built-in's accessor)."""
        return self.sinks_param()

    def setup_cp_attention(self, cp_mesh) -> None:
        """nemo-automodel's CP hook: the group that calls without one in their inputs use."""
        self._cp_group = cp_mesh.get_group()

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Any = None,
        attention_mask: Any = None,
        position_embeddings_compress: Any = None,
        rotary_compress: Any = None,
        start_pos: int = 0,
        position_ids: Any = None,
        *,
        nemo_dsa_forward: ForwardState | None = None,
        output_attentions: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend over ``hidden_states [B, S, hidden]``; returns ``(output, attention weights or None)``.

        The block's RoPE tables are not used (nemo_dsa rotates with its own). Visibility, positions
        and documents come from ``nemo_dsa_forward.metadata``; without it (a layer called on its
        own) from ``position_ids``, ``packed_seq_ids``, the padding ``attention_mask`` marks and the
        CP group (``_dsv4_cp_group`` or ``setup_cp_attention``'s).

        Attention weights: the dense probabilities ``[B, H, S, S * cp_size + K]`` in the built-in's
        layout (``_wants_weights`` says when; ``DSASparseAttention._attend_with_probabilities``),
        with the built-in's masked synthetic pooled column where the HCA alignment adds one.
        """
        if start_pos:
            raise ValueError(f"start_pos must be 0 (training forward, no KV cache), got {start_pos}")
        standalone = nemo_dsa_forward is None
        weights = self._wants_weights(output_attentions, standalone)
        if standalone:
            nemo_dsa_forward = self._own_forward_state(hidden_states, attention_mask, position_ids, kwargs)
        meta = nemo_dsa_forward.metadata[max(self.compress_ratio, 1)]
        result = self.call_core(hidden_states, meta, nemo_dsa_forward.ctx, nemo_dsa_forward.shared, probabilities=weights)
        out, aux = result[:2]
        probs = result[2] if weights else None
        if aux is not None:
            nemo_dsa_forward.aux_losses.append(aux)
        # The built-in aligns in training whenever the model built the mask (always inside the model;
        # a layer called on its own only with a mask, which can hide the synthetic window).
        if self.training and self.compress_ratio == _HCA_RATIO and (not standalone or attention_mask is not None):
            if self._align_hca_parameters(hidden_states.shape[1] * nemo_dsa_forward.ctx.size, out.device):
                out = out + self.compressor.zero_through_parameters(out)
                if probs is not None:  # the built-in's synthetic pooled key, masked: probability 0
                    probs = torch.nn.functional.pad(probs, (0, 1))
        return out, probs

    def _wants_weights(self, output_attentions: bool | None, standalone: bool) -> bool:
        """Whether this call returns the attention weights. ``output_attentions`` (HF's keyword)
        decides when given; otherwise a layer called on its own returns them on the backends whose
        built-in attention returns them (every ``backend.attn`` but ``tilelang``: its dense eager
        path), and a layer inside the plugin model returns none (its blocks drop them), so a model
        forward computes no probabilities unless asked."""
        if output_attentions is not None:
            return bool(output_attentions)
        return standalone and self.backend.attn != "tilelang"

    def _align_hca_parameters(self, seq_len: int, device) -> bool:
        """Whether the built-in's mixed-length FSDP alignment (``DeepseekV4Compressor``) applies:
        a rank whose sequence holds no complete HCA window, in a sync group where a peer holds one,
        sends zero gradients to its compressor."""
        local = seq_len >= self.compress_ratio
        # Every rank of the group takes part in the collective, the long ones included.
        group_has_window = self.compressor._compute_fsdp_group_has_complete_hca_window(local, device)
        return not local and group_has_window

    def _own_forward_state(self, hidden_states, attention_mask, position_ids, kwargs) -> ForwardState:
        batch, seq = hidden_states.shape[:2]
        ctx = sequence_context(kwargs.get("_dsv4_cp_group") or self._cp_group)
        packed_seq_ids = kwargs.get("packed_seq_ids")
        if packed_seq_ids is not None and packed_seq_ids.ndim == 1:
            packed_seq_ids = packed_seq_ids.unsqueeze(0)
        if position_ids is not None:
            position_ids = position_ids.unsqueeze(0) if position_ids.ndim == 1 else position_ids
            position_ids = position_ids.expand(batch, -1)
        if packed_seq_ids is not None:
            packed_seq_ids = packed_seq_ids.expand(batch, -1)
        valid = None
        if attention_mask is not None:
            if attention_mask.ndim == 4 and attention_mask.shape[-1] in (seq, seq * ctx.size):
                # The built-in's additive [B, 1, S, keys] (keys: the whole sequence under CP): a
                # padding token cannot see itself; a query's own key sits at its global position.
                own = torch.arange(seq, device=attention_mask.device)
                if attention_mask.shape[-1] != seq:
                    own = own + ctx.rank * seq
                diagonal = attention_mask[:, 0, torch.arange(seq, device=attention_mask.device), own]
                valid = (diagonal == 0).long().expand(batch, -1)
            elif attention_mask.ndim == 2:
                valid = attention_mask.long()
            else:
                raise ValueError(
                    f"attention_mask must be [B, 1, S, S or S * cp_size] (additive) or [B, S] (1 = token), got "
                    f"shape {tuple(attention_mask.shape)} for S = {seq}"
                )
            if packed_seq_ids is not None:
                packed_seq_ids = packed_seq_ids * valid.to(packed_seq_ids.dtype)
                valid = None
        return build_forward_state(
            self.core.config.compress_ratios, ctx, batch_size=batch, seq_len=seq, device=hidden_states.device,
            position_ids=position_ids, packed_seq_ids=packed_seq_ids, attention_mask=valid,
        )  # fmt: skip
