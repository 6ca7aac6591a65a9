"""nemo-automodel's DeepSeek-V4 decoder block and hyper-connection mixers on nemo_dsa's fused mHC parts.

``NemoDsaDeepseekV4Block`` is the built-in's ``DeepseekV4Block`` (its class made this subclass, no
new parameters): its forward is the built-in's sequence (mix, collapse, norm, attention, expand;
mix, collapse, norm, MoE, expand) with the collapse and the expand on
``nemo_dsa.ops.hyper_connections`` and the mixers' projection on the fused mix
(``NemoDsaDeepseekV4HyperConnection``). With the ``torch`` backend (or CPU / fp32 streams under
``auto``) it runs the built-in's own forward. See ``integrations/common/hyper_connections.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from nemo_automodel.components.models.deepseek_v4.layers import DeepseekV4HyperConnection, DeepseekV4HyperHead
from nemo_automodel.components.models.deepseek_v4.model import (
    DeepseekV4Block,
    DeepseekV4HashGate,
    DeepseekV4VisionGate,
)

from nemo_dsa.integrations.common.hyper_connections import hc_coefficients
from nemo_dsa.ops.hyper_connections import collapse_streams, expand_streams, resolve_hc_backend, stream_mix

__all__ = [
    "NemoDsaDeepseekV4Block",
    "NemoDsaDeepseekV4HyperConnection",
    "NemoDsaDeepseekV4HyperHead",
    "adopt_hyper_connections",
]


class NemoDsaDeepseekV4HyperConnection(DeepseekV4HyperConnection):
    """The built-in mixer whose projection runs on the fused mix (module docstring)."""

    hc_backend: str

    def compute_weights(self, hidden_streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mix = stream_mix(hidden_streams, self.fn, self.norm_eps, order="norm_first", backend=self.hc_backend)
        return hc_coefficients(mix, self.base, self.scale, self.hc_mult, self.hc_eps, self.hc_sinkhorn_iters,
                               fused_affine=False)  # fmt: skip


class NemoDsaDeepseekV4HyperHead(DeepseekV4HyperHead):
    """The built-in final collapse (sigmoid-weighted, no Sinkhorn) on the fused mix and collapse."""

    hc_backend: str

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = resolve_hc_backend(self.hc_backend, x)
        if backend == "torch":
            return super().forward(x)
        mixes = stream_mix(x, self.hc_fn, self.norm_eps, order="norm_first", backend=backend)
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return collapse_streams(x, pre, backend=backend)


class NemoDsaDeepseekV4Block(DeepseekV4Block):
    """The built-in block with its hyper-connections on the fused parts (module docstring)."""

    hc_backend: str

    def forward(
        self,
        x: torch.Tensor,
        position_embeddings: Any = None,
        position_ids: torch.Tensor | None = None,
        position_embeddings_compress: Any = None,
        rotary_compress: Any = None,
        attention_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        vision_token_types: torch.Tensor | None = None,
        **attn_kwargs: Any,
    ) -> torch.Tensor:
        backend = resolve_hc_backend(self.hc_backend, x)
        if backend == "torch":
            return super().forward(
                x, position_embeddings, position_ids=position_ids,
                position_embeddings_compress=position_embeddings_compress, rotary_compress=rotary_compress,
                attention_mask=attention_mask, padding_mask=padding_mask, input_ids=input_ids,
                vision_token_types=vision_token_types, **attn_kwargs,
            )  # fmt: skip
        if attention_mask is not None and padding_mask is None and attention_mask.dim() == 2:
            padding_mask = attention_mask.bool().logical_not()  # the MoE's padding marks, as the built-in derives them

        pre, post, comb = self.attn_hc(x)
        attn_out, _ = self.self_attn(
            hidden_states=self.input_layernorm(collapse_streams(x, pre, backend=backend)),
            position_embeddings=position_embeddings, attention_mask=attention_mask,
            position_embeddings_compress=position_embeddings_compress, rotary_compress=rotary_compress,
            position_ids=position_ids, vision_token_types=vision_token_types, **attn_kwargs,
        )  # fmt: skip
        x = expand_streams(attn_out, x, post, comb, rounding="terms", backend=backend)

        pre, post, comb = self.ffn_hc(x)
        gate = getattr(self.mlp, "gate", None)
        if isinstance(gate, DeepseekV4VisionGate):
            gate.set_routing_context(input_ids, vision_token_types)
        elif self.is_hash_routing_layer and isinstance(gate, DeepseekV4HashGate):
            gate.set_input_ids(input_ids)
        mlp_out = self.mlp(self.post_attention_layernorm(collapse_streams(x, pre, backend=backend)), padding_mask)
        return expand_streams(mlp_out, x, post, comb, rounding="terms", backend=backend)


def adopt_hyper_connections(blocks, heads, hc_backend: str) -> None:
    """Make each built-in block in ``blocks`` a ``NemoDsaDeepseekV4Block`` (main-stack blocks),
    each of their mixers a ``NemoDsaDeepseekV4HyperConnection`` and each final collapse in
    ``heads`` a ``NemoDsaDeepseekV4HyperHead``, running on ``hc_backend``."""
    for head in heads:
        if isinstance(head, DeepseekV4HyperHead):
            head.__class__ = NemoDsaDeepseekV4HyperHead
            head.hc_backend = hc_backend
    for block in blocks:
        if type(block) is DeepseekV4Block or isinstance(block, NemoDsaDeepseekV4Block):
            block.__class__ = NemoDsaDeepseekV4Block
            block.hc_backend = hc_backend
        for name in ("attn_hc", "ffn_hc"):
            mixer = getattr(block, name, None)
            if isinstance(mixer, DeepseekV4HyperConnection):
                mixer.__class__ = NemoDsaDeepseekV4HyperConnection
                mixer.hc_backend = hc_backend
