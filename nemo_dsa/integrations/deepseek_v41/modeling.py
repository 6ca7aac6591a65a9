"""``NemoDsaDeepseekV41ForCausalLM``: nemo-automodel's DeepSeek-V4.1 with every attention layer on nemo_dsa.

The class *is* nemo-automodel 0.7.0's ``DeepseekV41ForCausalLM`` (a subclass): embeddings, the
single-pass hyper-connections, the MoE, Engram, the vision tower, the LM head's parameter, the
forward (its THD packing, labels and loss) and the state-dict adapter (released HF checkpoints, FP8
``.scale`` tensors included) are the built-in's, untouched. DSpark (V4.1's MTP) is a separate model
and is not affected. The fp32 ``lm_head`` becomes an ``Fp32HeadLinear`` (the same ``nn.Linear``
and parameter; its fp32 logits of the bf16 hidden state in exact bf16 products on the GPU,
``integrations/common/lm_head.py``), and each block's ``attn`` is replaced by
``NemoDsaDeepseekV41Attention``, which computes with nemo_dsa's ``DSASparseAttention`` (its metadata, compressors, indexer, selection and
attention ops; none of the built-in's kernels, masks or indexer) under the built-in's parameter
names, configured by ``DSAModelConfig.from_hf_config`` from the V4.1 text config.

Registered through the ``nemo_automodel.architectures`` entry point; a config selects it with
``architectures: [NemoDsaDeepseekV41ForCausalLM]``, and the model sets that name on its config.
Options (constructor keywords or config attributes): ``indexer_backend`` and ``attention_backend``
(``auto`` | ``tilelang`` | ``torch``; ``backend.attn`` of ``tilelang`` selects both unless they
are given), ``fused_topk`` and ``recompute`` (parts recomputed in the backward instead of kept, as
for V4: ``nemo_dsa.integrations.common.recompute``). Context
parallelism runs through the built-in's own CP sharder and forward (``cp_group`` reaches every
attention; see ``deepseek_v41.attention``). Pipeline stages, which the built-in does not build,
come from nemo-automodel's ``AutoPipeline`` through ``V41PipelineStages`` (``pipeline.py``): the
forward hands a stage's call to ``stage_forward``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

from nemo_dsa.integrations.deepseek_v41.hyper_connection import adopt_hyper_connections
from nemo_dsa.integrations.deepseek_v41.attention import NemoDsaDeepseekV41Attention
from nemo_dsa.integrations.deepseek_v41.configuration import OPTIONS, dsa_config_from_deepseek_v41, resolve_dsa_config
from nemo_dsa.integrations.common.lm_head import Fp32HeadLinear, adopt_fp32_head, announce_bf16_hidden
from nemo_dsa.integrations.common.hyper_connections import pop_hc_backend_option
from nemo_dsa.integrations.common.recompute import apply_recompute, pop_recompute_option
from nemo_dsa.integrations.common.strict_loading import StrictCheckpointLoading
from nemo_dsa.integrations.deepseek_v41.pipeline import StageCall, V41PipelineStages, stage_forward

__all__ = ["ARCHITECTURE", "NemoDsaDeepseekV41ForCausalLM", "dsa_config_from_deepseek_v41"]

ARCHITECTURE = "NemoDsaDeepseekV41ForCausalLM"


class NemoDsaDeepseekV41ForCausalLM(StrictCheckpointLoading, V41PipelineStages, DeepseekV41ForCausalLM):
    """nemo-automodel's DeepSeek-V4.1 whose attention layers run on nemo_dsa (see the module docstring)."""

    @dataclass(frozen=True)
    class ModelCapabilities:
        """The built-in's, plus pipeline stages (``pipeline.py``)."""

        supports_tp: bool = False
        supports_cp: bool = True
        supports_pp: bool = True
        supports_ep: bool = True
        supports_thd: bool = True

    @classmethod
    def supports_config(cls, config: Any) -> bool:
        """DeepSeek-V4.1 configs."""
        return getattr(config, "model_type", None) == "deepseek_v41"

    def __init__(self, config: DeepseekV41Config, moe_config: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not isinstance(config, DeepseekV41Config):
            raise TypeError(f"config must be a DeepseekV41Config, got {type(config).__name__}")
        options = {name: kwargs.pop(name) for name in list(kwargs) if name in OPTIONS}
        recompute = pop_recompute_option(kwargs, config)
        hc_backend = pop_hc_backend_option(kwargs, config)
        self._refuse_oversized_config(getattr(config, "_name_or_path", None), config, moe_config, backend, **kwargs)
        super().__init__(config, moe_config, backend, **kwargs)
        self.hyper_connection_backend = hc_backend
        self.dsa_config = resolve_dsa_config(config, self.backend, options)
        self.config.architectures = [ARCHITECTURE]
        for name, block in self.model.layers.items():
            block.attn = self._nemo_dsa_attention(block.attn, int(name))
        adopt_hyper_connections(self.model.layers.values(), hc_backend)
        adopt_fp32_head(self)
        announce_bf16_hidden(self.model, self.lm_head)
        apply_recompute(self.model, self.model.layers.values(), recompute, "v41")
        self._init_strict_loading()
        self._init_pipeline_stages()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_hws: torch.Tensor | None = None,
        vision_token_types: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_hidden_states: bool = False,
        output_hidden_states: bool = False,
        cp_group: Any = None,
        packed_seq_ids: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        seq_lens_padded: torch.Tensor | None = None,
        qkv_format: str | None = None,
        use_cache: bool | None = None,
    ):
        """The built-in's forward, under its signature (so nemo-automodel's ``filter_forward_kwargs``
        drops batch keys it does not name, e.g. ``padding_mask``, and sees ``logits_to_keep``).
        ``use_cache`` is accepted as generation callers pass it; there is no KV cache (a training
        forward), so only None / False are valid. The fp32 head takes the bf16 backbone output in
        exact bf16 products (``integrations/common/lm_head.py``); no announcement outlives the forward."""
        if use_cache:
            raise ValueError("use_cache: NemoDsaDeepseekV41ForCausalLM has no KV cache (full-sequence forward); pass False")
        if isinstance(input_ids, StageCall):  # a pipeline stage (pipeline.py)
            return stage_forward(
                self, input_ids, attention_mask, position_ids, labels=labels, pixel_values=pixel_values,
                image_grid_hws=image_grid_hws, vision_token_types=vision_token_types, logits_to_keep=logits_to_keep,
                return_hidden_states=return_hidden_states, output_hidden_states=output_hidden_states,
                cp_group=cp_group, packed_seq_ids=packed_seq_ids, seq_lens=seq_lens, seq_lens_padded=seq_lens_padded,
                qkv_format=qkv_format,
            )  # fmt: skip
        try:
            return super().forward(
                input_ids, attention_mask, position_ids, labels=labels, pixel_values=pixel_values,
                image_grid_hws=image_grid_hws, vision_token_types=vision_token_types, logits_to_keep=logits_to_keep,
                return_hidden_states=return_hidden_states, output_hidden_states=output_hidden_states,
                cp_group=cp_group, packed_seq_ids=packed_seq_ids, seq_lens=seq_lens, seq_lens_padded=seq_lens_padded,
                qkv_format=qkv_format,
            )  # fmt: skip
        finally:
            if isinstance(self.lm_head, Fp32HeadLinear):
                self.lm_head.bf16_valued_input = False

    def _nemo_dsa_attention(self, builtin: torch.nn.Module, layer_idx: int) -> NemoDsaDeepseekV41Attention:
        """The replacement of ``builtin``: same parameter names, shapes, dtypes and device."""
        return NemoDsaDeepseekV41Attention.replacing(builtin, self.config, layer_idx, self.backend, self.dsa_config)


ModelClass = NemoDsaDeepseekV41ForCausalLM
