"""nemo_dsa's attention inside nemo-automodel's DeepSeek-V4 blocks, under the built-in's parameter names.

``NemoDsaDeepseekV4Attention`` replaces a block's ``self_attn``. It computes with nemo_dsa's
``DSASparseAttention`` (nemo_dsa's metadata, compressor, indexer, selection and attention ops),
but its parameters sit where nemo-automodel's ``DeepseekV4Attention`` keeps them
(``sinks_param.weight``, ``compressor.ape_param.weight``, ``compressor.kv_norm``,
``compressor.indexer.*``), so the built-in's state-dict adapter, its FSDP2 wrapping (fp32 islands
found by module name) and its ``_keep_in_fp32_modules_strict`` list apply unchanged.

How: the nemo_dsa module (``core``) is built first and kept outside the module tree. Its
submodules (``wq_a``, ``compressor.wkv``, ``indexer.wq_b`` ...) are registered again here under
the built-in's names: the same module objects, so whatever FSDP2 or ``.to()`` does to them,
``core`` sees it, and calling them from ``core`` runs their FSDP hooks. The few tensors ``core``
holds directly (the sink logits, the compressors' position biases) live here in one-parameter
holder modules, the layout the built-in uses for fp32 parameters, and are handed to ``core`` for
each call through ``torch.func.functional_call``.

The per-forward metadata (one ``AttentionMetadata`` per compression ratio, the sequence
context and the layers' shared state) is built once by ``NemoDsaDeepseekV4ForCausalLM.forward``
and reaches every layer as the ``nemo_dsa_forward`` keyword, which nemo-automodel's blocks pass
through to their attention untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nemo_dsa.integrations.common.attention_layout import CoreAttention

__all__ = [
    "BUILTIN_TO_NEMO_MODULES",
    "BUILTIN_TO_NEMO_TENSORS",
    "DsaForwardState",
    "NemoDsaDeepseekV4Attention",
]

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


@dataclass
class DsaForwardState:
    """What one model forward hands to every attention layer."""

    metadata: dict  # compression ratio (1 for window-only layers) -> AttentionMetadata
    ctx: Any  # nemo_dsa SequenceContext (LocalContext without context parallelism)
    shared: Any  # the layers' shared state (ratio-4 sources publish to later layers)
    aux_losses: list = field(default_factory=list)  # indexer KL losses, when enabled


class NemoDsaDeepseekV4Attention(CoreAttention):
    """Drop-in ``self_attn`` of a DeepSeek-V4 block that computes with nemo_dsa (see module docstring)."""

    def __init__(self, dsa_config, layer_idx: int) -> None:
        super().__init__(dsa_config, layer_idx, BUILTIN_TO_NEMO_MODULES, BUILTIN_TO_NEMO_TENSORS, "DeepseekV4Attention")

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
        nemo_dsa_forward: DsaForwardState | None = None,
        **unused: Any,
    ) -> tuple[torch.Tensor, None]:
        """Attend over ``hidden_states [B, S, hidden]``.

        The block's RoPE tables, additive mask and positions are not used: visibility, positions
        and documents come from ``nemo_dsa_forward.metadata``, which the plugin's forward built
        from the batch.
        """
        if nemo_dsa_forward is None:
            raise ValueError(
                f"layer {self.layer_idx}: nemo_dsa_forward is missing; NemoDsaDeepseekV4Attention runs inside "
                "NemoDsaDeepseekV4ForCausalLM.forward, which builds the attention metadata once per forward"
            )
        if start_pos:
            raise ValueError(f"start_pos must be 0 (training forward, no KV cache), got {start_pos}")
        meta = nemo_dsa_forward.metadata[max(self.compress_ratio, 1)]
        out, aux = self.call_core(hidden_states, meta, nemo_dsa_forward.ctx, nemo_dsa_forward.shared)
        if aux is not None:
            nemo_dsa_forward.aux_losses.append(aux)
        return out, None
