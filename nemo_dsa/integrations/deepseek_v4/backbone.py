"""``NemoDsaDeepseekV4Model``: nemo-automodel's ``DeepseekV4Model`` (the backbone of the causal LM)
whose forward builds nemo_dsa's attention metadata instead of the built-in's dense masks.

The causal LM calls it as the built-in calls its backbone (``self.model(input_ids, position_ids=...,
attention_mask=..., padding_mask=..., return_hc_hidden=..., **attn_kwargs)``), so forward hooks on
``model.model`` fire and a replaced backbone is honoured. Per forward it turns what reaches it
(``position_ids``, ``seq_lens`` / ``seq_lens_padded`` of nemo-automodel's THD collater,
``cu_seqlens`` / ``cu_seqlens_padded``, ``packed_seq_ids``, ``attention_mask`` / ``padding_mask``,
and under context parallelism the shards and ``_dsv4_cp_group`` of the built-in's CP sharder) into
one ``AttentionMetadata`` per compression ratio through ``nemo_dsa.models.forward_context``, in one
check of the layout together with the token-id range check (one host read per forward), and hands
it to every block's attention as ``nemo_dsa_forward``. Under CP the sharder's ``seq_lens`` describe
the documents before its compression padding, so the metadata comes from the per-rank
``position_ids``, ``packed_seq_ids`` and ``padding_mask`` instead; the compression padding inside
a document's id is padding to nemo_dsa (the built-in treats it as part of the document; real
tokens see the same keys either way, since a query never sees tokens after itself).

The causal LM's MTP attends with the same metadata: the LM passes a ``ForwardStateSlot`` as
``nemo_dsa_forward_slot`` and the backbone leaves its ``ForwardState`` there. The built-in's
constructor builds the backbone; ``adopt`` makes that module this class (it adds a forward and the
ratios, no parameters), so nothing is built twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4Model

from nemo_dsa.integrations.deepseek_v4.pipeline import stage_inputs
from nemo_dsa.layers.shared_state import SharedLayerState
from nemo_dsa.models.forward_context import ForwardState, forward_metadata, sequence_context

__all__ = ["ForwardStateSlot", "NemoDsaDeepseekV4Model", "moe_padding_mask"]

_VISION_INPUTS = ("pixel_values", "image_grid_hws", "n_images_per_sample", "vision_token_types")


@dataclass
class ForwardStateSlot:
    """Where the backbone leaves the ``ForwardState`` of one forward for the causal LM's MTP."""

    state: ForwardState | None = None


def moe_padding_mask(attention_mask: torch.Tensor | None, padding_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The MoE's padding marks (True = padding), as the built-in derives them: the MoE leaves
    padding tokens out of its routing statistics."""
    if padding_mask is not None:
        return padding_mask
    if attention_mask is not None and attention_mask.ndim == 2:
        return ~attention_mask.bool()
    return None


def _lengths_from_offsets(offsets: torch.Tensor) -> torch.Tensor:
    lengths = offsets.diff(dim=-1)
    return lengths.unsqueeze(0) if lengths.ndim == 1 else lengths


class NemoDsaDeepseekV4Model(DeepseekV4Model):
    """nemo-automodel's DeepSeek-V4 backbone running nemo_dsa's attention (see the module docstring)."""

    compress_ratios: tuple[int, ...]  # every attention layer's ratio (main and MTP), set by ``adopt``

    @classmethod
    def adopt(cls, backbone: DeepseekV4Model, compress_ratios) -> NemoDsaDeepseekV4Model:
        """``backbone`` (built by the built-in's constructor) as this class, with the ratios its
        metadata covers (the MTP's included, since the MTP shares it)."""
        if not isinstance(backbone, DeepseekV4Model):
            raise TypeError(f"backbone must be a DeepseekV4Model, got {type(backbone).__name__}")
        backbone.__class__ = cls
        backbone.compress_ratios = tuple(int(r) for r in compress_ratios)
        return backbone

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        return_hc_hidden: bool = False,
        nemo_dsa_forward_slot: ForwardStateSlot | None = None,
        **attn_kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The built-in backbone's contract: the final hidden state ``[B, S, hidden]`` (a stage
        before the last: the streams ``[B, S, hc_mult, hidden]``) and, with ``return_hc_hidden``,
        the streams before the final head. ``input_ids`` holds the token ids on the stage that owns
        the embedding, else the previous stage's streams. Vision inputs are refused."""
        given_vision = [name for name in _VISION_INPUTS if attn_kwargs.get(name) is not None]
        if given_vision:
            raise ValueError(f"{given_vision}: the nemo_dsa plugin runs the DeepSeek-V4 text model (no vision inputs)")
        inputs = stage_inputs(self, input_ids, inputs_embeds)
        token_ids = inputs.token_ids
        input_checks = ()
        if token_ids is not None:
            vocab = self.config.vocab_size

            def bad_ids():
                raise ValueError(f"input_ids must be in [0, vocab_size={vocab})")

            # Read on the host with the metadata's checks (one read per forward), before the embedding.
            input_checks = (((token_ids < 0) | (token_ids >= vocab), bad_ids),)
        if position_ids is not None and position_ids.ndim == 1:
            position_ids = position_ids.unsqueeze(0)
        state = self.forward_state(
            inputs.shape_ref, position_ids=position_ids, attention_mask=attention_mask, padding_mask=padding_mask,
            input_checks=input_checks, **attn_kwargs,
        )  # fmt: skip
        if nemo_dsa_forward_slot is not None:
            nemo_dsa_forward_slot.state = state
        if inputs.streams is not None:
            streams = inputs.streams
        else:
            embeds = self.embed_tokens(token_ids) if token_ids is not None else inputs.inputs_embeds
            streams = embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        moe_padding = moe_padding_mask(attention_mask, padding_mask)
        for block in self.layers.values():
            if block is None:  # a slot a pipeline stage cut away
                continue
            # Hash-routed layers read the token ids, which only the first stage has (the built-in
            # keeps its hash layers there too).
            streams = block(
                streams, None, position_ids=position_ids, padding_mask=moe_padding, input_ids=token_ids,
                nemo_dsa_forward=state,
            )  # fmt: skip
        hidden = streams
        if getattr(self, "hc_head", None) is not None:
            hidden = self.hc_head(hidden)
        if getattr(self, "norm", None) is not None:
            hidden = self.norm(hidden)
        return (hidden, streams) if return_hc_hidden else hidden

    def forward_state(
        self, shape_ref: torch.Tensor, *, position_ids=None, attention_mask=None, padding_mask=None, input_checks=(),
        **attn_kwargs: Any,
    ) -> ForwardState:  # fmt: skip
        """The sequence context and ``{ratio: AttentionMetadata}`` of one forward over tokens shaped
        like ``shape_ref`` (``[B, S, ...]``), from one check of the layout and ``input_checks``."""
        # The sharder's group, else the one nemo-automodel's setup_cp_attention gave the layers.
        cp_group = attn_kwargs.get("_dsv4_cp_group") or attn_kwargs.get("cp_group")
        if cp_group is None:
            cp_group = next((b.self_attn._cp_group for b in self.layers.values() if b is not None), None)
        ctx = sequence_context(cp_group)
        layout = self._layout(
            ctx.size > 1, position_ids=position_ids, attention_mask=attention_mask, padding_mask=padding_mask,
            **{name: attn_kwargs.get(name) for name in (
                "seq_lens", "seq_lens_padded", "cu_seqlens", "cu_seqlens_padded", "packed_seq_ids")},
        )  # fmt: skip
        batch, seq = shape_ref.shape[:2]
        metadata = forward_metadata(
            self.compress_ratios, ctx, batch_size=batch, seq_len=seq, device=shape_ref.device,
            extra_checks=input_checks, **layout,
        )  # fmt: skip
        return ForwardState(metadata, ctx, SharedLayerState())

    @staticmethod
    def _layout(cp_active, *, position_ids, attention_mask, padding_mask, seq_lens, seq_lens_padded, cu_seqlens,
                cu_seqlens_padded, packed_seq_ids) -> dict:  # fmt: skip
        """``build_attention_metadata`` keywords from the trainer's layout inputs (module docstring)."""
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError(f"attention_mask must be [B, S] (1 = token), got shape {tuple(attention_mask.shape)}")
        if attention_mask is None and padding_mask is not None:
            attention_mask = ~padding_mask.bool()
        if packed_seq_ids is not None and packed_seq_ids.ndim == 1:
            packed_seq_ids = packed_seq_ids.unsqueeze(0)
        if packed_seq_ids is not None and attention_mask is not None:
            # The built-in's CP sharder keeps compression padding inside a document's id.
            packed_seq_ids = packed_seq_ids * attention_mask.to(packed_seq_ids.dtype)
        if cp_active:
            # The sharder's seq_lens count documents before its compression padding: the per-rank
            # positions, document ids and padding describe the shards exactly.
            seq_lens = seq_lens_padded = cu_seqlens = None
        elif cu_seqlens_padded is not None:
            seq_lens = _lengths_from_offsets(cu_seqlens) if cu_seqlens is not None else None
            seq_lens_padded = _lengths_from_offsets(cu_seqlens_padded)
            if seq_lens is None:
                seq_lens = seq_lens_padded
            cu_seqlens = None
        elif seq_lens_padded is not None and seq_lens is None:
            seq_lens = seq_lens_padded
        if seq_lens_padded is not None and seq_lens is not None and seq_lens_padded.shape != seq_lens.shape:
            seq_lens_padded = None
        return dict(position_ids=position_ids, seq_lens=seq_lens, seq_lens_padded=seq_lens_padded,
                    cu_seqlens=cu_seqlens, packed_seq_ids=packed_seq_ids, attention_mask=attention_mask)  # fmt: skip
