"""The DeepSeek-V4 plugin as one of nemo-automodel's pipeline stages.

nemo-automodel builds a stage by deep-copying the whole model and setting every module the stage
does not own to None (``embed_tokens`` off the first stage; ``norm``, ``hc_head``, ``lm_head`` and
``mtp`` off the last; the layers of other stages deleted from ``model.layers``), then runs the
model's own forward on each stage. Positional arguments carry what one stage sends the next:
the token ids into the first stage, then the hyper-connection streams ``[B, S, hc_mult, hidden]``
and, with MTP, one embedding ``[B, S, hidden]`` of the shifted tokens per MTP depth (built on the
first stage, which owns the embedding, and passed through to the last, which owns the MTP). The
batch's keyword inputs (``position_ids``, ``seq_lens``, ``padding_mask`` ...) reach every stage,
split into the same micro-batches, so each stage builds its own attention metadata from them:
nothing computed on one stage is read on another. This is the built-in's stage contract
(``DeepseekV4ForCausalLM.get_pipeline_stage_metas``), which the plugin inherits unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StageInputs", "mtp_embeds_to_send", "stage_inputs"]


@dataclass(frozen=True)
class StageInputs:
    """What reaches one stage: token ids (the first stage) or the previous stage's streams."""

    token_ids: torch.Tensor | None  # [B, S] on the stage that owns the embedding, else None
    inputs_embeds: torch.Tensor | None  # [B, S, hidden] embeddings given instead of token ids
    streams: torch.Tensor | None  # [B, S, hc_mult, hidden] from the previous stage, else None
    mtp_embeds: tuple[torch.Tensor, ...]  # the MTP depths' shifted-token embeddings carried along

    @property
    def shape_ref(self) -> torch.Tensor:
        """A ``[B, S]`` view whose shape and device describe the stage's tokens."""
        if self.token_ids is not None:
            return self.token_ids
        if self.inputs_embeds is not None:
            return self.inputs_embeds[..., 0]
        return self.streams[..., 0, 0]


def stage_inputs(model, input_ids, inputs_embeds, mtp_embed_inputs) -> StageInputs:
    """Read the stage's positional inputs (module docstring), refusing what does not fit it."""
    mtp_embeds = tuple(mtp_embed_inputs)
    owns_embedding = model.model.embed_tokens is not None
    if mtp_embeds:
        if owns_embedding or not model.mtp_config.enabled:
            raise ValueError(
                f"{len(mtp_embeds)} mtp_embed_inputs given: they are what a later pipeline stage of a model with "
                "MTP (num_nextn_predict_layers > 0) receives, and this model "
                + ("owns the embedding (a first stage or the whole model)" if owns_embedding else "has no MTP")
            )
        if len(mtp_embeds) != model.mtp_config.num_layers:
            raise ValueError(
                f"mtp_embed_inputs: expected {model.mtp_config.num_layers} (one per MTP depth), got {len(mtp_embeds)}"
            )
    if not owns_embedding:
        streams = input_ids if input_ids is not None else inputs_embeds
        if streams is None or (input_ids is not None and inputs_embeds is not None):
            raise ValueError(
                "a pipeline stage without the embedding takes the previous stage's streams, as input_ids or "
                "inputs_embeds (exactly one)"
            )
        hc_mult, hidden = model.config.hc_mult, model.config.hidden_size
        if streams.ndim == 3 and hc_mult == 1:
            streams = streams.unsqueeze(2)
        if not streams.is_floating_point() or streams.ndim != 4 or tuple(streams.shape[2:]) != (hc_mult, hidden):
            raise ValueError(
                f"a pipeline stage without the embedding takes the previous stage's streams [B, S, {hc_mult}, "
                f"{hidden}] (hc_mult, hidden_size), got {streams.dtype} of shape {tuple(streams.shape)}"
            )
        return StageInputs(None, None, streams, mtp_embeds)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        if input_ids.ndim == 1:  # THD rows arrive flattened
            input_ids = input_ids.unsqueeze(0)
        if input_ids.ndim != 2 or input_ids.is_floating_point():
            raise ValueError(f"input_ids must be integer token ids [B, S], got {input_ids.dtype} {tuple(input_ids.shape)}")
        return StageInputs(input_ids, None, None, mtp_embeds)
    if inputs_embeds.ndim == 2:
        inputs_embeds = inputs_embeds.unsqueeze(0)
    return StageInputs(None, inputs_embeds, None, mtp_embeds)


def mtp_embeds_to_send(model, inputs: StageInputs) -> tuple[torch.Tensor, ...]:
    """The MTP embeddings a non-last stage sends on: built from the tokens on the first stage."""
    if inputs.mtp_embeds:
        return inputs.mtp_embeds
    if inputs.token_ids is None:
        raise ValueError("the first pipeline stage of a model with MTP needs input_ids (the shifted tokens' embeddings)")
    return tuple(model._build_mtp_embed_inputs_for_pp(inputs.token_ids))

