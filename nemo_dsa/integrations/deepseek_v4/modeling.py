"""``NemoDsaDeepseekV4ForCausalLM``: nemo-automodel's DeepSeek-V4 with every attention layer on nemo_dsa.

The class *is* nemo-automodel 0.7.0's ``DeepseekV4ForCausalLM`` (a subclass): embeddings,
hyper-connections, MoE (hash and score routing, experts, shared experts), MTP, the LM head's
parameter, the state-dict adapter (released HF checkpoints, FP8 ``.scale`` tensors included), the
FSDP2 / expert-parallel parallelizer and the contiguous CP sharder are the built-in's, untouched.
Each block's ``self_attn`` (main layers and MTP layers) is replaced by
``NemoDsaDeepseekV4Attention``, which computes with nemo_dsa's ``DSASparseAttention`` under the
built-in's parameter names (see ``deepseek_v4.attention``), and the fp32 ``lm_head`` becomes an
``Fp32HeadLinear``: the same ``nn.Linear`` and parameter, its fp32 projection of the bf16 hidden
state computed in exact bf16 products on the GPU (``integrations/common/lm_head.py``).

The outer forward is the built-in's: it calls its backbone ``self.model`` as the built-in does
(forward hooks on ``model.model`` fire), then the MTP, the LM head and the pipeline stage outputs.
The backbone is the built-in's module made a ``NemoDsaDeepseekV4Model`` (``backbone.py``), whose
forward builds nemo_dsa's ``AttentionMetadata`` once per forward, per compression ratio, from what
the trainer passes (one host read), runs the built-in's blocks with it, and builds none of the
built-in's dense [B, 1, S, S] masks (the MTP block still computes its small RoPE cos/sin tables,
which nothing reads). The MTP attends with the backbone's metadata, handed over in a
``ForwardStateSlot``.

Packed documents need not start on a multiple of the compression ratio: nemo_dsa's visibility
rule is causal for every layout, where the built-in's per-document group numbering lets a query
see a group that holds later tokens (the tests show both).

Registered through the ``nemo_automodel.architectures`` entry point. A config selects it with
``architectures: [NemoDsaDeepseekV4ForCausalLM]`` (e.g. ``config: {architectures: [...]}`` beside
``pretrained_model_name_or_path`` of a released checkpoint); the model sets that name on its
config, so checkpoints it saves come back through it.

nemo_dsa options (constructor keywords, or config attributes of the same name):
``scoring`` (``v4`` | ``v41``), ``indexer_kl_coef``, ``indexer_straight_through`` (default off,
so default gradients equal the built-in's), ``indexer_backend`` and ``attention_backend`` (the
indexer's and the window + compressed attention's kernels: ``auto`` | ``tilelang`` | ``torch``;
``auto`` runs the attention's reference where its kernels cannot take the shapes; ``backend.attn``
of ``tilelang`` / ``torch`` selects both unless they are given; an unset ``attention_backend``
follows the indexer's), ``fused_topk`` and ``recompute`` (parts recomputed in the backward instead
of kept: ``hyper_connections``, ``norms``, ``attention``; a list or a comma-separated string,
default none; see ``nemo_dsa.integrations.common.recompute``) and ``hyper_connection_backend``
(``auto`` | ``triton`` | ``torch``: the blocks' hyper-connections on nemo_dsa's fused kernels or
in nemo-automodel's torch arithmetic; ``integrations/common/hyper_connections.py``).
Enabled indexer KL losses reach the backward through the final hidden state (zero in the
forward), with the gradient nemo-automodel's trainer gives auxiliary losses under gradient
accumulation and CP (``nemo_dsa.integrations.common.aux_loss``), and are reported as ``indexer_aux_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_automodel.components.models.common.utils import compute_lm_head_logits
from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4CausalLMOutput, DeepseekV4ForCausalLM

from nemo_dsa.integrations.common.aux_loss import attach_indexer_loss
from nemo_dsa.integrations.deepseek_v4.attention import NemoDsaDeepseekV4Attention
from nemo_dsa.integrations.deepseek_v4.configuration import (
    OPTION_DEFAULTS,
    dsa_config_from_deepseek_v4,
    resolve_dsa_config,
)
from nemo_dsa.integrations.common.lm_head import Fp32HeadLinear, adopt_fp32_head, called_with_bf16
from nemo_dsa.integrations.common.hyper_connections import pop_hc_backend_option
from nemo_dsa.integrations.common.recompute import apply_recompute, pop_recompute_option
from nemo_dsa.integrations.common.strict_loading import IDENTITY_KEY_MAPPING, StrictCheckpointLoading
from nemo_dsa.integrations.deepseek_v4.block import adopt_hyper_connections
from nemo_dsa.integrations.deepseek_v4.backbone import ForwardStateSlot, NemoDsaDeepseekV4Model, moe_padding_mask
from nemo_dsa.integrations.deepseek_v4.pipeline import checked_mtp_embeds, mtp_embeds_to_send
from nemo_dsa.layers.shared_state import SharedLayerState
from nemo_dsa.models.forward_context import ForwardState

__all__ = ["ARCHITECTURE", "NemoDsaDeepseekV4ForCausalLM", "NemoDsaDeepseekV4Output", "dsa_config_from_deepseek_v4"]

ARCHITECTURE = "NemoDsaDeepseekV4ForCausalLM"


@dataclass
class NemoDsaDeepseekV4Output(DeepseekV4CausalLMOutput):
    """The built-in's output plus the summed indexer KL loss (None when disabled)."""

    indexer_aux_loss: torch.Tensor | None = None


class NemoDsaDeepseekV4ForCausalLM(StrictCheckpointLoading, DeepseekV4ForCausalLM):
    """nemo-automodel's DeepSeek-V4 whose attention layers run on nemo_dsa (see the module docstring)."""

    @dataclass(frozen=True)
    class ModelCapabilities:
        """What nemo-automodel may combine with this model."""

        supports_tp: bool = False
        # CP through the built-in's contiguous sharder; nemo_dsa gathers keys and window tails.
        supports_cp: bool = True
        # nemo-automodel's pipeline stages run this model's forward (pipeline.py).
        supports_pp: bool = True
        supports_ep: bool = True
        supports_thd: bool = True

    # Document boundaries and CP transport are handled inside the model (nemo_dsa's metadata).
    _owns_packed_attention = True
    _owns_cp_attention = True
    # nemo-automodel reads it as _checkpoint_conversion_mapping (see strict_loading).
    _checkpoint_key_mapping = IDENTITY_KEY_MAPPING

    @classmethod
    def supports_config(cls, config: Any) -> bool:
        """DeepSeek-V4 text configs (the vision tower is not supported)."""
        return getattr(config, "model_type", None) == "deepseek_v4" and not int(
            getattr(config, "vision_n_layers", 0) or 0
        )

    def __init__(self, config: DeepseekV4Config, moe_config: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not isinstance(config, DeepseekV4Config):
            raise TypeError(f"config must be a DeepseekV4Config, got {type(config).__name__}")
        if int(getattr(config, "vision_n_layers", 0) or 0):
            raise ValueError("vision_n_layers must be 0: the nemo_dsa plugin supports the DeepSeek-V4 text model")
        options = {name: kwargs.pop(name) for name in list(kwargs) if name in OPTION_DEFAULTS}
        recompute = pop_recompute_option(kwargs, config)
        hc_backend = pop_hc_backend_option(kwargs, config)
        self._refuse_oversized_config(getattr(config, "_name_or_path", None), config, moe_config, backend, **kwargs)
        super().__init__(config, moe_config, backend, **kwargs)
        self.hyper_connection_backend = hc_backend
        self.dsa_config = resolve_dsa_config(config, self.backend, options)
        self.config.architectures = [ARCHITECTURE]
        # A model without attention layers (dsa_config None) still checks each forward's layout.
        NemoDsaDeepseekV4Model.adopt(self.model, self.dsa_config.compress_ratios if self.dsa_config else ())
        for block in self.model.layers.values():
            block.self_attn = self._nemo_dsa_attention(block.self_attn, block.layer_idx)
        for block in self.mtp.layers if self.mtp is not None else ():
            block.self_attn = self._nemo_dsa_attention(block.self_attn, block.layer_idx)
        adopt_fp32_head(self)
        mtp_blocks = list(self.mtp.layers) if self.mtp is not None else []
        heads = [getattr(self.model, "hc_head", None), *(getattr(b, "hc_head", None) for b in mtp_blocks)]
        adopt_hyper_connections([*self.model.layers.values(), *mtp_blocks], heads, self.hyper_connection_backend)
        apply_recompute(self.model, [*self.model.layers.values(), *mtp_blocks], recompute, "v4")
        self._init_strict_loading()

    def _nemo_dsa_attention(self, builtin: torch.nn.Module, layer_idx: int) -> NemoDsaDeepseekV4Attention:
        """The replacement of ``builtin``: same parameter names, shapes, dtypes and device."""
        return NemoDsaDeepseekV4Attention.replacing(builtin, self.config, layer_idx, self.backend, self.dsa_config)

    # ------------------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *mtp_embed_inputs: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_hidden_states: bool | None = None,
        **attn_kwargs: Any,
    ) -> NemoDsaDeepseekV4Output:
        """Logits of the local shard ``[B, S, vocab]`` (and MTP hidden states when training).

        The built-in's outer forward: the backbone ``self.model`` (``NemoDsaDeepseekV4Model``,
        which builds the attention metadata) is called as the built-in calls it, then the MTP (on
        the backbone's metadata), the LM head and the stage outputs. Accepts the built-in's
        training inputs; ``labels`` and other recipe keys are ignored. Vision inputs are refused.
        On a pipeline stage (some parts of the model cut away by nemo-automodel) it takes and
        returns what the built-in's stages do (``pipeline.py``): the previous stage's streams and
        the MTP embeddings in, the stage's streams (or, on the last stage, logits) and the MTP
        tensors out.
        """
        if output_hidden_states is None:
            output_hidden_states = getattr(getattr(self, "config", None), "output_hidden_states", False)
        pipeline_stage = self._is_pipeline_parallel_stage()
        mtp_stage = pipeline_stage and self.mtp_config.enabled
        thd = attn_kwargs.get("qkv_format") == "thd"
        mtp_embeds = checked_mtp_embeds(self, mtp_embed_inputs)
        use_mtp = self.mtp is not None and self.training
        if use_mtp:
            if pipeline_stage and not mtp_embeds:
                raise ValueError("the last pipeline stage of a model with MTP needs the MTP embeddings (mtp_embed_inputs)")
            if not pipeline_stage and (input_ids is None or attn_kwargs.get("inputs_embeds") is not None):
                raise ValueError("MTP training needs input_ids (the next tokens' embeddings)")

        slot = ForwardStateSlot()
        backbone_out = self.model(
            input_ids, position_ids=position_ids, attention_mask=attention_mask, padding_mask=padding_mask,
            return_hc_hidden=use_mtp, nemo_dsa_forward_slot=slot, **attn_kwargs,
        )  # fmt: skip
        hidden, hc_hidden = backbone_out if use_mtp else (backbone_out, None)
        aux_losses = slot.state.aux_losses if slot.state is not None else []

        mtp_hidden = None
        if mtp_stage and self.lm_head is None:
            # A stage before the last carries the MTP depths' embeddings on to the MTP.
            mtp_hidden = list(mtp_embeds_to_send(self, input_ids, mtp_embeds))
        elif use_mtp:
            if position_ids is not None and position_ids.ndim == 1:
                position_ids = position_ids.unsqueeze(0)
            mtp_inputs = {"embed_inputs": mtp_embeds} if mtp_embeds else {
                "input_ids": input_ids if input_ids.ndim == 2 else input_ids.unsqueeze(0),
                "embed_fn": self.model.embed_tokens,
            }  # fmt: skip
            mtp_hidden = self.mtp(
                hidden_states=hc_hidden, position_ids=position_ids, attention_mask=None,
                padding_mask=moe_padding_mask(attention_mask, padding_mask),
                nemo_dsa_forward=self._mtp_forward_state(slot, hc_hidden, position_ids, attention_mask, padding_mask,
                                                         aux_losses, attn_kwargs),
                **mtp_inputs,
            )  # fmt: skip
            # nemo-automodel keeps DeepSeek's LM head in fp32, and its MTP loss applies lm_head to
            # these states as they are: in a bf16 model they must arrive in the head's dtype
            # (0.7.0's built-in stops there: "expected mat1 and mat2 to have the same dtype").
            head_dtype = self.lm_head.weight.dtype
            mtp_hidden = [h.to(head_dtype) for h in mtp_hidden]
        elif mtp_stage:
            # The last stage outside training: the stage's outputs keep their number of tensors.
            mtp_hidden = [hidden.new_empty(hidden.shape) for _ in range(self.mtp_config.num_layers)]

        aux = None
        if aux_losses:
            aux = torch.stack([loss.reshape(()) for loss in aux_losses]).sum()
            # On the stage's output (the final hidden state on the last stage), so the KL term
            # trains whether the trainer's loss reads the logits or (fused linear cross-entropy)
            # the hidden states; at the trainer's gradient for auxiliary losses (micro-batches
            # and CP ranks, see aux_loss).
            hidden = attach_indexer_loss(hidden, aux)
        if self.lm_head is None:  # a pipeline stage before the last: its streams go on
            logits = hidden
        elif isinstance(self.lm_head, Fp32HeadLinear) and isinstance(logits_to_keep, int) and logits_to_keep == 0:
            # The built-in's fp32 head, called with the bf16 hidden state itself (its products exact
            # on bf16 tensor cores, integrations/common/lm_head.py); the logits in the hidden state's dtype.
            with called_with_bf16(self.lm_head, hidden):
                logits = self.lm_head(hidden).to(hidden.dtype)
            if thd and logits.dim() == 2:
                logits = logits.unsqueeze(0)
        else:
            logits = compute_lm_head_logits(self.lm_head, hidden, logits_to_keep, is_thd=thd, fp32_lm_head=True).logits
        if pipeline_stage:
            # torch.distributed.pipelining sends tensors: the built-in's stage outputs.
            return logits if mtp_hidden is None else (logits, *mtp_hidden)
        return NemoDsaDeepseekV4Output(
            logits=logits,
            hidden_states=hidden if output_hidden_states else None,
            mtp_per_depth_h=mtp_hidden,
            mtp_loss_scaling_factor=self.mtp_config.loss_scaling_factor,
            indexer_aux_loss=aux,
        )

    def _mtp_forward_state(self, slot, hc_hidden, position_ids, attention_mask, padding_mask, aux_losses,
                           attn_kwargs) -> ForwardState:  # fmt: skip
        """The MTP's ``ForwardState``: the backbone's metadata and sequence context (its own ratio-4
        sources, the same list of indexer losses). A backbone that left none (its forward replaced)
        costs the MTP a second check of the layout (one more host read)."""
        state = slot.state
        if state is None:
            state = NemoDsaDeepseekV4Model.forward_state(
                self.model, hc_hidden, position_ids=position_ids, attention_mask=attention_mask,
                padding_mask=padding_mask, **attn_kwargs,
            )  # fmt: skip
        return ForwardState(state.metadata, state.ctx, SharedLayerState(), aux_losses)

    @torch.no_grad()
    def initialize_weights(
        self, buffer_device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        """The built-in's initialisation, on the parameters' device when none is given (CPU-safe)."""
        if buffer_device is None:
            device = next((p.device for p in self.parameters() if p.device.type != "meta"), torch.device("cpu"))
            buffer_device = device
        super().initialize_weights(buffer_device=buffer_device, dtype=dtype)


ModelClass = NemoDsaDeepseekV4ForCausalLM
