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
attention; see ``deepseek_v41.attention``).
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

from nemo_dsa.integrations.common.attention_layout import adopt_builtin_layout
from nemo_dsa.integrations.deepseek_v41.attention import NemoDsaDeepseekV41Attention
from nemo_dsa.integrations.common.lm_head import Fp32HeadLinear, adopt_fp32_head, announce_bf16_hidden
from nemo_dsa.integrations.common.recompute import apply_recompute, pop_recompute_option
from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig

__all__ = ["ARCHITECTURE", "NemoDsaDeepseekV41ForCausalLM", "dsa_config_from_deepseek_v41"]

ARCHITECTURE = "NemoDsaDeepseekV41ForCausalLM"
_OPTIONS = ("indexer_backend", "attention_backend", "fused_topk")
_ATTN_TO_INDEXER_BACKEND = {"tilelang": "tilelang", "torch": "torch"}


def dsa_config_from_deepseek_v41(config: DeepseekV41Config, **options: Any) -> DSAModelConfig:
    """nemo_dsa's module config for every attention layer of ``config`` (its ``text_config``).

    ``options`` are ``DSAModelConfig`` fields (``backend``, ``attention_backend``, ``fused_topk``); None leaves the default."""
    overrides = {k: v for k, v in options.items() if v is not None}
    return DSAModelConfig.from_hf_config(config, **overrides)


class NemoDsaDeepseekV41ForCausalLM(DeepseekV41ForCausalLM):
    """nemo-automodel's DeepSeek-V4.1 whose attention layers run on nemo_dsa (see the module docstring)."""

    @classmethod
    def supports_config(cls, config: Any) -> bool:
        """DeepSeek-V4.1 configs."""
        return getattr(config, "model_type", None) == "deepseek_v41"

    def __init__(self, config: DeepseekV41Config, moe_config: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not isinstance(config, DeepseekV41Config):
            raise TypeError(f"config must be a DeepseekV41Config, got {type(config).__name__}")
        options = {name: kwargs.pop(name, None) for name in _OPTIONS}
        options = {name: value if value is not None else getattr(config, name, None) for name, value in options.items()}
        recompute = pop_recompute_option(kwargs, config)
        super().__init__(config, moe_config, backend, **kwargs)
        attn = getattr(self.backend, "attn", None)
        # backend.attn tilelang selects both the indexer's and the attention's kernels unless given.
        indexer_backend = options.pop("indexer_backend") or _ATTN_TO_INDEXER_BACKEND.get(attn)
        options["attention_backend"] = options["attention_backend"] or _ATTN_TO_INDEXER_BACKEND.get(attn)
        self.dsa_config = dsa_config_from_deepseek_v41(config, backend=indexer_backend, **options)
        self.config.architectures = [ARCHITECTURE]
        for name, block in self.model.layers.items():
            block.attn = self._nemo_dsa_attention(block.attn, int(name))
        adopt_fp32_head(self)
        announce_bf16_hidden(self.model, self.lm_head)
        apply_recompute(self.model, self.model.layers.values(), recompute, "v41")

    def forward(self, *args: Any, **kwargs: Any):
        """The built-in's forward; its fp32 head takes the bf16 backbone output in exact bf16
        products (``integrations/common/lm_head.py``), and no announcement outlives the forward."""
        try:
            return super().forward(*args, **kwargs)
        finally:
            if isinstance(self.lm_head, Fp32HeadLinear):
                self.lm_head.bf16_valued_input = False

    def _nemo_dsa_attention(self, builtin: torch.nn.Module, layer_idx: int) -> NemoDsaDeepseekV41Attention:
        """The replacement of ``builtin``: same parameter names, shapes, dtypes and device."""
        device = next(builtin.parameters()).device
        with torch.device(device):
            attention = NemoDsaDeepseekV41Attention(self.dsa_config, layer_idx)
        return adopt_builtin_layout(builtin, attention, layer_idx)


ModelClass = NemoDsaDeepseekV41ForCausalLM
