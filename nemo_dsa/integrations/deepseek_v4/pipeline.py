"""The DeepSeek-V4 plugin as one of nemo-automodel's pipeline stages.

nemo-automodel builds a stage by deep-copying the whole model and setting every module the stage
does not own to None (``embed_tokens`` off the first stage; ``norm``, ``hc_head``, ``lm_head`` and
``mtp`` off the last; the layers of other stages deleted from ``model.layers``), then runs the
model's own forward on each stage. Positional arguments carry what one stage sends the next:
the token ids into the first stage, then the hyper-connection streams ``[B, S, hc_mult, hidden]``
and, with MTP, one embedding ``[B, S, hidden]`` of the shifted tokens per MTP depth (built on the
first stage, which owns the embedding, and passed through to the last, which owns the MTP). The
batch's keyword inputs (``position_ids``, ``seq_lens``, ``padding_mask`` ...) reach every stage,
split into the same micro-batches, so each stage's backbone builds its own attention metadata
from them: nothing computed on one stage is read on another. This is the built-in's stage
contract (``DeepseekV4ForCausalLM.get_pipeline_stage_metas``), which the plugin inherits unchanged.

``stage_inputs`` reads what reaches the backbone (token ids or streams); ``checked_mtp_embeds``
and ``mtp_embeds_to_send`` are the causal LM's part (the MTP embeddings beside them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StageInputs", "checked_mtp_embeds", "mtp_embeds_to_send", "stage_inputs"]


@dataclass(frozen=True)
class StageInputs:
    """What reaches one stage's backbone: token ids (the first stage) or the previous stage's streams."""

    token_ids: torch.Tensor | None  # [B, S] on the stage that owns the embedding, else None
    inputs_embeds: torch.Tensor | None  # [B, S, hidden] embeddings given instead of token ids
    streams: torch.Tensor | None  # [B, S, hc_mult, hidden] from the previous stage, else None

    @property
    def shape_ref(self) -> torch.Tensor:
        """A ``[B, S]`` view whose shape and device describe the stage's tokens."""
        if self.token_ids is not None:
            return self.token_ids
        if self.inputs_embeds is not None:
            return self.inputs_embeds[..., 0]
        return self.streams[..., 0, 0]


def owns_embedding(model) -> bool:
    """Whether ``model`` (the causal LM) is a first stage or the whole model."""
    return getattr(model.model, "embed_tokens", None) is not None


def stage_inputs(backbone, input_ids, inputs_embeds) -> StageInputs:
    """Read the backbone's positional input (module docstring), refusing what does not fit the stage."""
    if backbone.embed_tokens is None:
        streams = input_ids if input_ids is not None else inputs_embeds
        if streams is None or (input_ids is not None and inputs_embeds is not None):
            raise ValueError(
                "a pipeline stage without the embedding takes the previous stage's streams, as input_ids or "
                "inputs_embeds (exactly one)"
            )
        hc_mult, hidden = backbone.config.hc_mult, backbone.config.hidden_size
        if streams.ndim == 3 and hc_mult == 1:
            streams = streams.unsqueeze(2)
        if not streams.is_floating_point() or streams.ndim != 4 or tuple(streams.shape[2:]) != (hc_mult, hidden):
            raise ValueError(
                f"a pipeline stage without the embedding takes the previous stage's streams [B, S, {hc_mult}, "
                f"{hidden}] (hc_mult, hidden_size), got {streams.dtype} of shape {tuple(streams.shape)}"
            )
        return StageInputs(None, None, streams)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        if input_ids.ndim == 1:  # THD rows arrive flattened
            input_ids = input_ids.unsqueeze(0)
        if input_ids.ndim != 2 or input_ids.is_floating_point():
            raise ValueError(f"input_ids must be integer token ids [B, S], got {input_ids.dtype} {tuple(input_ids.shape)}")
        return StageInputs(input_ids, None, None)
    if inputs_embeds.ndim == 2:
        inputs_embeds = inputs_embeds.unsqueeze(0)
    return StageInputs(None, inputs_embeds, None)


def checked_mtp_embeds(model, mtp_embed_inputs) -> tuple[torch.Tensor, ...]:
    """The MTP embeddings a later stage of ``model`` receives, refused where they do not belong."""
    mtp_embeds = tuple(mtp_embed_inputs)
    if not mtp_embeds:
        return mtp_embeds
    first = owns_embedding(model)
    if first or not model.mtp_config.enabled:
        raise ValueError(
            f"{len(mtp_embeds)} mtp_embed_inputs given: they are what a later pipeline stage of a model with "
            "MTP (num_nextn_predict_layers > 0) receives, and this model "
            + ("owns the embedding (a first stage or the whole model)" if first else "has no MTP")
        )
    if len(mtp_embeds) != model.mtp_config.num_layers:
        raise ValueError(
            f"mtp_embed_inputs: expected {model.mtp_config.num_layers} (one per MTP depth), got {len(mtp_embeds)}"
        )
    return mtp_embeds


def mtp_embeds_to_send(model, input_ids, mtp_embeds: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The MTP embeddings a non-last stage sends on: built from the tokens on the first stage."""
    if mtp_embeds:
        return mtp_embeds
    if input_ids is None or input_ids.is_floating_point():
        raise ValueError("the first pipeline stage of a model with MTP needs input_ids (the shifted tokens' embeddings)")
    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    return tuple(model._build_mtp_embed_inputs_for_pp(input_ids))
