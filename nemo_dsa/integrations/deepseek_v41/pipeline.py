"""The DeepSeek-V4.1 plugin as nemo-automodel's pipeline stages (``AutoPipeline``, ``train_ft``).

nemo-automodel 0.7.0 builds no stages for its V4.1 model; the plugin builds them through the same
``AutoPipeline`` and hooks the V4 model uses. ``AutoPipeline`` deep-copies the whole model once per
stage and sets every module a stage does not own to None (``embed_tokens`` off the first stage;
``norm`` and ``lm_head`` off the last; the layers of other stages deleted from ``model.layers``).
``V41PipelineStages`` (a base class of ``NemoDsaDeepseekV41ForCausalLM``) gives it:

Where stages are cut (``customize_pipeline_stage_modules``). V4.1 layers hand state to later
layers of the same forward: a ``reuse`` or ``reindex`` layer reads the latest kv source's
compressed KV and index keys, a ``reuse`` layer the latest selection, and every selecting layer
after the candidate source its candidate blocks (``SharedLayerState``). A cut before layer L is
*clean* when no layer at or after L reads anything a layer before L made; only clean cuts are
used, so nothing but the hyper-connection streams crosses a boundary and every stage starts its
layers from an empty state, as a whole forward starts. Among the clean cuts the split with the
fewest layers on its largest stage is taken, nearest to nemo-automodel's even split. A model
with fewer clean segments than stages is refused when the stages are built, naming the cuts.

What crosses a boundary (``get_pipeline_stage_metas``), positional tensors of one micro-batch:
the token ids ``[B, S]`` into the first stage; then the streams ``[B, S, hc_mult, hidden]`` (the
model's dtype), the single-pass mHC carry ``pre_mix`` ``[B, S, hc_mult]`` (fp32, as the built-in
requires) and, while an Engram layer lies ahead, the token ids ``[B, S]`` (int64, no gradient):
Engram hashes n-grams of the token ids, and the stage that owns an Engram layer hashes them
again (its ``engram_hash`` kept there). The batch's keyword inputs (``position_ids``,
``attention_mask``, ``seq_lens`` / ``seq_lens_padded`` / ``qkv_format`` of THD packs) reach every
stage, split into the same micro-batches, so each stage builds its own packed layout and attention
metadata from them. A THD pack is re-laid out on every stage (the built-in's
``packed_layout``: documents start on multiples of the compression ratios), and the streams cross
a boundary in the caller's token order, so every boundary tensor has the batch's static
``[B, S]`` shape. The last stage returns the logits ``[B, S, vocab]`` for the pipeline's loss.
V4.1's MTP (DSpark) is a separate model trained by its own recipe: the causal LM has no MTP head
to place. Vision inputs and context parallelism are refused on stages.

The stage's own forward: nemo-automodel calls a stage with the tensors above positionally and
every batch key as a keyword. A forward pre-hook (``stage_call``) hands the plugin's forward those
tensors as one ``StageCall`` in ``input_ids`` and only the keywords its signature names (as
``filter_forward_kwargs`` does without stages), so the forward keeps the built-in's signature;
``stage_forward`` then runs the stage's layers as ``DeepseekV41Model.forward`` runs them.

Engram tables on stages: the built-in spreads each table's rows over its owner group (every rank
by default), which spans other stages, and a lookup is a collective of that group. While the stages
are cut (``customize_pipeline_stage_modules``, on every rank before the stages are copied) each
table becomes a complete table of each rank: its rows gathered from the owners, nothing moved on
the meta device (where ``train_ft`` builds a model of more than one rank). With expert parallelism
nemo-automodel's MoE parallelizer then calls ``_nemo_prepare_model_owned_dtensors`` with the
stage's data-parallel mesh, and the stage's tables are rebuilt on that mesh's group (the ranks
holding this stage) before they become row-sharded DTensors as in the built-in. The dense FSDP2
path (``ep_size`` 1) does not call that hook and shards the complete tables like other parameters;
without FSDP2 (one rank per stage) they stay complete local tables. A stage whose table is still
owned by other stages' ranks is refused before any collective.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from nemo_automodel.components.models.common.utils import (
    _has_dtensor_params,
    cast_model_to_dtype,
    compute_lm_head_logits,
)
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4VisionGate
from nemo_automodel.components.models.deepseek_v41.attention import DeepseekV41AttentionState
from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41Model
from nemo_automodel.components.models.deepseek_v41.packing import packed_layout
from nemo_automodel.components.models.qwen3_8_flash_next.engram import Qwen3_8_FlashNextEngramTableConfig

from nemo_dsa.integrations.common.lm_head import called_with_bf16

logger = logging.getLogger(__name__)

__all__ = [
    "StageCall",
    "StagePlan",
    "V41PipelineStages",
    "clean_cuts",
    "plan_stage_layers",
    "stage_forward",
]


# --------------------------------------------------------------------------------------------
# where stages may be cut
# --------------------------------------------------------------------------------------------


def layer_reads(dsa_config, num_layers: int) -> list[set[int]]:
    """Per layer: the earlier layers whose state (compressed KV and index keys, selection,
    candidate blocks) it reads within one forward (nemo_dsa's ``DSASparseAttention._compressed``)."""
    reads: list[set[int]] = [set() for _ in range(num_layers)]
    if dsa_config is None:
        return reads
    roles = [dsa_config.attention_role(i) for i in range(num_layers)]
    kv_source = index_source = None
    candidate = int(getattr(dsa_config, "candidate_source_layer_id", -1))
    for layer, role in enumerate(roles):
        if role in ("reindex", "reuse"):
            reads[layer].add(kv_source)
        if role == "reuse":
            reads[layer].add(index_source)
        if role in ("source", "reindex") and 0 <= candidate < layer:
            reads[layer].add(candidate)  # its scores are masked to the candidate source's blocks
        if role == "source":
            kv_source = layer
        if role in ("source", "reindex"):
            index_source = layer
    return [{i for i in r if i is not None} for r in reads]


def clean_cuts(dsa_config, num_layers: int) -> list[int]:
    """The layers L in ``1 .. num_layers - 1`` before which a cut leaves no state behind: no layer
    at or after L reads state a layer before L made."""
    reads = layer_reads(dsa_config, num_layers)
    cuts = []
    for cut in range(1, num_layers):
        if all(min(reads[j], default=cut) >= cut for j in range(cut, num_layers)):
            cuts.append(cut)
    return cuts


def plan_stage_layers(num_layers: int, num_stages: int, allowed: list[int], default_cuts: list[int]) -> list[int]:
    """``num_stages - 1`` cuts from ``allowed``: the fewest layers on the largest stage, then the
    least total distance from ``default_cuts`` (nemo-automodel's even split). Every stage keeps
    at least one layer."""
    if num_stages == 1:
        return []
    points = [0, *sorted(set(allowed)), num_layers]
    if len(points) - 1 < num_stages:
        raise ValueError(
            f"{num_stages} pipeline stages need {num_stages - 1} cuts, and DeepSeek-V4.1's layer roles allow a stage "
            f"boundary only before layers {sorted(set(allowed))} ({len(points) - 1} segments of {num_layers} layers): "
            "a reuse / reindex layer reads its kv source's compressed KV and selection, and every selecting layer "
            "after the candidate source its candidate blocks, within one stage. Use fewer pipeline stages "
            "(distributed.pp_size, or one stage per rank instead of an interleaved schedule)."
        )
    # best[k][p]: (largest stage, distance) over splits of layers [0, points[p]) into k stages.
    inf = (math.inf, math.inf)
    best = [[inf] * len(points) for _ in range(num_stages + 1)]
    back = [[-1] * len(points) for _ in range(num_stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, num_stages + 1):
        for p in range(1, len(points)):
            for q in range(p):
                prev = best[k - 1][q]
                if prev == inf:
                    continue
                size = points[p] - points[q]
                dist_ = prev[1] + (abs(points[p] - default_cuts[k - 1]) if k < num_stages else 0)
                cand = (max(prev[0], size), dist_)
                if cand < best[k][p]:
                    best[k][p], back[k][p] = cand, q
    cuts, p = [], len(points) - 1
    for k in range(num_stages, 1, -1):
        p = back[k][p]
        cuts.append(points[p])
    return sorted(cuts)


# --------------------------------------------------------------------------------------------
# one stage: what it holds, receives and sends
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StagePlan:
    """One stage of the V4.1 model: its layers and what crosses its two boundaries."""

    first_layer: int  # the stage's layers are first_layer .. last_layer
    last_layer: int
    num_layers: int  # the whole model's
    owns_embedding: bool  # the first stage
    owns_head: bool  # the last stage (norm and lm_head)
    ids_in: bool  # later stages: the token ids arrive beside the streams (an Engram layer lies ahead)
    ids_out: bool  # earlier stages: the token ids leave beside the streams


def _text_config(model):
    return getattr(model.config, "text_config", None) or model.config


def engram_layers(model) -> list[int]:
    text = _text_config(model)
    return [i for i in text.engram_layer_ids if i < text.num_hidden_layers]


def stage_plan(model) -> StagePlan:
    """The plan of ``model`` (a stage, or the whole model), checked against the clean cuts (once
    per layout of the stage)."""
    layers = tuple(sorted(int(name) for name in model.model.layers.keys()))
    owns_embedding = getattr(model.model, "embed_tokens", None) is not None
    owns_head = getattr(model, "lm_head", None) is not None
    key = (layers, owns_embedding, owns_head)
    cached = model.__dict__.get("_nemo_dsa_stage_plan")
    if cached is None or cached[0] != key:
        cached = (key, _stage_plan(model, list(layers), owns_embedding, owns_head))
        model.__dict__["_nemo_dsa_stage_plan"] = cached
    return cached[1]


def _stage_plan(model, layers: list[int], owns_embedding: bool, owns_head: bool) -> StagePlan:
    text = _text_config(model)
    num_layers = int(text.num_hidden_layers)
    if not layers:
        raise ValueError("a DeepSeek-V4.1 pipeline stage needs at least one decoder layer")
    first, last = layers[0], layers[-1]
    if layers != list(range(first, last + 1)):
        raise ValueError(f"a DeepSeek-V4.1 pipeline stage holds consecutive layers, got {layers}")
    if owns_embedding != (first == 0) or owns_head != (last == num_layers - 1):
        raise ValueError(
            f"a DeepSeek-V4.1 pipeline stage with layers {first}..{last} of {num_layers} must own the embedding "
            "exactly when it starts at layer 0 and the norm and lm_head exactly when it ends at the last layer"
        )
    if owns_head and getattr(model.model, "norm", None) is None:
        raise ValueError("the last DeepSeek-V4.1 pipeline stage owns the final norm with the lm_head")
    cuts = clean_cuts(getattr(model, "dsa_config", None), num_layers)
    for cut in (first, last + 1):
        if 0 < cut < num_layers and cut not in cuts:
            raise ValueError(
                f"a DeepSeek-V4.1 pipeline stage boundary before layer {cut} would split layers that share "
                f"compressed KV, selections or candidate blocks; boundaries are allowed before layers {cuts} "
                "(AutoPipeline's automatic split uses only those; check module_fqns_per_model_part)"
            )
    engram = engram_layers(model)
    return StagePlan(
        first, last, num_layers, owns_embedding, owns_head,
        ids_in=first > 0 and any(i >= first for i in engram),
        ids_out=last + 1 < num_layers and any(i > last for i in engram),
    )  # fmt: skip


@dataclass(frozen=True)
class StageCall:
    """The positional tensors nemo-automodel hands a stage, passed to the forward as ``input_ids``:
    the token ids (first stage) or ``(streams, pre_mix[, token ids])``."""

    tensors: tuple


@functools.lru_cache(maxsize=None)
def _forward_keywords(forward) -> frozenset[str]:
    params = inspect.signature(forward).parameters
    return frozenset(name for name in params if name not in ("self", "input_ids"))


def stage_call(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of the plugin model: on a pipeline stage, the positional tensors become one
    ``StageCall`` and only the keywords the forward names are kept (the batch's other keys, e.g.
    ``padding_mask``, are not the V4.1 forward's). Anything else passes unchanged."""
    if not module._is_pipeline_parallel_stage() or (args and isinstance(args[0], StageCall)):
        return None
    tensors = tuple(args)
    kwargs = dict(kwargs)
    if not tensors and "input_ids" in kwargs:
        tensors = (kwargs.pop("input_ids"),)
    names = _forward_keywords(type(module).forward)
    return (StageCall(tensors),), {k: v for k, v in kwargs.items() if k in names}


# --------------------------------------------------------------------------------------------
# the stage's forward
# --------------------------------------------------------------------------------------------


def _as_rows(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.unsqueeze(0) if t is not None and t.ndim == 1 else t


def _unpack(model, plan: StagePlan, call: StageCall) -> tuple:
    """``(token ids [B, S] or None, streams [B, S, hc, hidden] or None, pre_mix [B, S, hc] or None)``."""
    text = _text_config(model)
    tensors = call.tensors
    if plan.owns_embedding:
        if len(tensors) != 1 or tensors[0].is_floating_point():
            raise ValueError(
                "the first DeepSeek-V4.1 pipeline stage takes the token ids [B, S] (one integer tensor), got "
                f"{[(t.dtype, tuple(t.shape)) for t in tensors]}"
            )
        return _as_rows(tensors[0]), None, None
    expected = 3 if plan.ids_in else 2
    if len(tensors) != expected:
        raise ValueError(
            f"a DeepSeek-V4.1 pipeline stage starting at layer {plan.first_layer} takes the previous stage's "
            f"{expected} tensors (streams, pre_mix{', token ids' if plan.ids_in else ''}), got {len(tensors)}"
        )
    streams, pre_mix = tensors[0], tensors[1]
    shape = (text.hc_mult, text.hidden_size)
    if streams.ndim != 4 or tuple(streams.shape[2:]) != shape or not streams.is_floating_point():
        raise ValueError(f"stage streams must be [B, S, {shape[0]}, {shape[1]}], got {tuple(streams.shape)}")
    if pre_mix.dtype != torch.float32 or tuple(pre_mix.shape) != tuple(streams.shape[:3]):
        raise ValueError(f"stage pre_mix must be fp32 [B, S, {shape[0]}], got {pre_mix.dtype} {tuple(pre_mix.shape)}")
    ids = tensors[2] if plan.ids_in else None
    if ids is not None and (ids.is_floating_point() or tuple(ids.shape) != tuple(streams.shape[:2])):
        raise ValueError(f"stage token ids must be integer [B, S], got {ids.dtype} {tuple(ids.shape)}")
    return ids, streams, pre_mix


def stage_forward(
    model,
    call: StageCall,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    labels=None,
    pixel_values=None,
    image_grid_hws=None,
    vision_token_types=None,
    logits_to_keep: int | torch.Tensor = 0,
    return_hidden_states: bool = False,
    output_hidden_states: bool = False,
    cp_group=None,
    packed_seq_ids: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    seq_lens_padded: torch.Tensor | None = None,
    qkv_format: str | None = None,
):
    """One stage of ``DeepseekV41ForCausalLM.forward`` (module docstring): the next stage's tensors,
    or on the last stage the logits ``[B, S, vocab]`` (the final hidden state when the loss reads
    hidden states, ``_pp_return_hidden_states``)."""
    plan = stage_plan(model)
    text = _text_config(model)
    if labels is not None:
        raise ValueError("a DeepSeek-V4.1 pipeline stage takes no labels: the pipeline's loss function reads them")
    if pixel_values is not None or image_grid_hws is not None or (
        vision_token_types is not None and bool((vision_token_types >= 0).any())
    ):
        raise ValueError("DeepSeek-V4.1 pipeline stages run the text model (no image inputs)")
    if output_hidden_states:
        raise ValueError("output_hidden_states: a DeepSeek-V4.1 pipeline stage returns only its stage outputs")
    if cp_group is None and getattr(model, "cp_mesh", None) is not None:
        cp_group = model.cp_mesh.get_group()
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        raise ValueError("DeepSeek-V4.1 pipeline stages do not combine with context parallelism (cp_size > 1)")
    if qkv_format not in (None, "thd"):
        raise ValueError("DeepSeek V4.1 qkv_format must be omitted or 'thd'")

    ids, streams, pre_mix = _unpack(model, plan, call)
    shape_ref = ids if ids is not None else streams[..., 0, 0]
    batch, seq = shape_ref.shape[:2]
    device = shape_ref.device
    position_ids, attention_mask = _as_rows(position_ids), _as_rows(attention_mask)
    layout = None
    if seq_lens is not None:
        if packed_seq_ids is not None:
            raise ValueError("Packed text requires seq_lens or prepared packed_seq_ids, not both")
        layout = packed_layout(
            seq_lens, seq_lens_padded=seq_lens_padded, input_shape=(batch, seq), alignment=model._packed_alignment,
            minimum_length=seq,
        )  # fmt: skip
        position_ids = layout.position_ids
        packed_seq_ids = layout.sequence_ids
        attention_mask = packed_seq_ids > 0
    elif seq_lens_padded is not None or (qkv_format == "thd" and packed_seq_ids is None):
        raise ValueError("Packed text requires seq_lens")
    elif packed_seq_ids is not None and (position_ids is None or attention_mask is None):
        raise ValueError("Prepared packed input requires document-local position_ids and a binary attention_mask")
    if position_ids is None:
        position_ids = torch.arange(seq, device=device).expand(batch, seq)

    def pack(t: torch.Tensor, fill=0) -> torch.Tensor:
        return t if layout is None else layout.pack(t, fill=fill)

    def restore(t: torch.Tensor) -> torch.Tensor:
        return t if layout is None else layout.restore(t)

    packed_ids = None if ids is None else pack(ids, fill=text.pad_token_id or 0)
    if any(block.engram is not None for block in model.model.layers.values()):
        check_stage_engram_tables(model)
        if packed_ids is None or getattr(model.model, "engram_hash", None) is None:
            raise ValueError(
                f"the DeepSeek-V4.1 pipeline stage with layers {plan.first_layer}..{plan.last_layer} holds an Engram "
                "layer: it needs the token ids and the model's engram_hash (kept there by the automatic split)"
            )
    layout_inputs = StageLayout(packed_ids, position_ids, attention_mask, packed_seq_ids, cp_group)
    # The backbone module runs the stage's layers, so that hooks on model.model fire as without
    # stages (FSDP2 gathers the parameters it shards as one unit there, e.g. the final norm).
    if plan.owns_embedding:
        out = model.model(packed_ids, None, nemo_dsa_stage=layout_inputs)
    else:
        out = model.model(pack(streams), pack(pre_mix), nemo_dsa_stage=layout_inputs)
    if not plan.owns_head:
        hidden, pre_mix = out
        out = (restore(hidden), restore(pre_mix))
        return (*out, ids.clone()) if plan.ids_out else out
    hidden = restore(out)
    if return_hidden_states or getattr(model, "_pp_return_hidden_states", False) is True:
        return hidden
    with called_with_bf16(model.lm_head, hidden):
        return compute_lm_head_logits(model.lm_head, hidden, logits_to_keep).logits


@dataclass(frozen=True)
class StageLayout:
    """What a stage's backbone reads beside its streams: the token ids in the compression-aligned
    layout (None where no Engram layer needs them and the embedding is elsewhere), its positions,
    token mask, document ids and CP group."""

    token_ids: torch.Tensor | None
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    packed_seq_ids: torch.Tensor | None
    cp_group: Any


class V41StageBackbone(DeepseekV41Model):
    """The built-in's V4.1 backbone (``model.model``), whose forward also runs a pipeline stage's
    part of it (``nemo_dsa_stage``); otherwise the built-in's forward, unchanged. ``adopt`` makes
    the built-in's module this class (it adds no parameters)."""

    @classmethod
    def adopt(cls, backbone: nn.Module) -> nn.Module:
        if type(backbone) is DeepseekV41Model:
            backbone.__class__ = cls
        return backbone

    def forward(self, input_ids=None, *args, nemo_dsa_stage: StageLayout | None = None, **kwargs):
        """Without ``nemo_dsa_stage`` the built-in's forward. With it: ``input_ids`` holds the token
        ids (the first stage) or the streams ``[B, S, hc_mult, hidden]`` and ``args[0]`` the fp32
        ``pre_mix`` (None on the first stage); returns ``(streams, pre_mix)``, or on the stage with
        the final norm the normalised hidden state ``[B, S, hidden]``."""
        if nemo_dsa_stage is None:
            return super().forward(input_ids, *args, **kwargs)
        stage = nemo_dsa_stage
        text = self.config
        if getattr(self, "embed_tokens", None) is not None:
            embedded = self.embed_tokens(input_ids)
            hidden = embedded.unsqueeze(2).expand(-1, -1, text.hc_mult, -1)
            pre_mix = torch.zeros(*input_ids.shape, text.hc_mult, device=embedded.device, dtype=torch.float32)
            pre_mix[..., 0] = 1
        else:
            hidden, pre_mix = input_ids, args[0]
        blocks = list(self.layers.values())
        hashes = None
        if any(block.engram is not None for block in blocks):
            token_mask = None if stage.attention_mask is None else stage.attention_mask.bool()
            hashes = self.engram_hash(stage.token_ids, token_mask=token_mask, sequence_ids=stage.packed_seq_ids)
        state = DeepseekV41AttentionState()  # clean cuts: the stage starts from an empty state
        for block in blocks:
            hidden, pre_mix, state = block(
                hidden, pre_mix, state, position_ids=stage.position_ids, attention_mask=stage.attention_mask,
                image_mask=None, cp_group=stage.cp_group, packed_seq_ids=stage.packed_seq_ids,
                engram_hash_ids=None if block.engram is None else hashes[:, :, block.engram.layer_hash_index],
            )  # fmt: skip
        if getattr(self, "norm", None) is None:
            return hidden, pre_mix
        return self.norm(DeepseekV41HyperConnection.collapse(hidden, pre_mix))


# --------------------------------------------------------------------------------------------
# the model's pipeline hooks
# --------------------------------------------------------------------------------------------


class V41PipelineStages:
    """nemo-automodel's pipeline hooks for the V4.1 plugin (module docstring); a base class of
    ``NemoDsaDeepseekV41ForCausalLM``, whose forward hands a ``StageCall`` to ``stage_forward``."""

    # AutoPipeline keeps the model's own forward on each stage (the V4.1 config nests a
    # text_config, which nemo-automodel otherwise reads as a VLM without a pipeline forward).
    _pp_keep_self_forward = True

    def _init_pipeline_stages(self) -> None:
        V41StageBackbone.adopt(self.model)
        self.register_forward_pre_hook(stage_call, with_kwargs=True)

    def __deepcopy__(self, memo: dict):
        """A copy that shares the process groups its modules hold (the Engram tables' owner
        group): ``AutoPipeline`` deep-copies the model once per stage, and a ``ProcessGroup`` is a
        handle, not data (it cannot be copied)."""
        for module in self.modules():
            for value in vars(module).values():
                if isinstance(value, dist.ProcessGroup):
                    memo.setdefault(id(value), value)
        return copy._reconstruct(self, memo, *self.__reduce_ex__(4))

    def _is_pipeline_parallel_stage(self) -> bool:
        """True on a stage AutoPipeline cut (some of the model set to None or deleted)."""
        if getattr(self, "lm_head", None) is None or getattr(self.model, "embed_tokens", None) is None:
            return True
        return len(self.model.layers) != int(_text_config(self).num_hidden_layers)

    def customize_pipeline_stage_modules(
        self, module_names_per_stage: list[list[str]], *, layers_prefix: str, text_model: nn.Module | None = None
    ) -> list[list[str]]:
        """The automatic split with its layer boundaries moved to clean cuts (module docstring), and
        ``engram_hash`` on every stage holding an Engram layer. Called on every rank before the
        stages are copied: the Engram tables become complete tables of each rank here (their rows
        gathered from the owner group; nothing moves on the meta device), so that a stage can
        own its tables (``_nemo_prepare_model_owned_dtensors``)."""
        backbone = text_model if text_model is not None else self.model
        if getattr(backbone, "vision", None) is not None:
            raise ValueError("DeepSeek-V4.1 pipeline stages run the text model: build it without the vision tower")
        num_layers = len(backbone.layers)
        layer_prefix = f"{layers_prefix}layers."
        counts = [sum(name.startswith(layer_prefix) for name in names) for names in module_names_per_stage]
        default_cuts = [sum(counts[: i + 1]) for i in range(len(counts) - 1)]
        cuts = plan_stage_layers(
            num_layers, len(module_names_per_stage), clean_cuts(getattr(self, "dsa_config", None), num_layers),
            default_cuts,
        )  # fmt: skip
        bounds = [0, *cuts, num_layers]
        for block in backbone.layers.values():  # before the stages are copied: every rank calls this
            if block.engram is not None:
                localize_engram_table(block.engram)
        engram = set(engram_layers(self))
        stages = []
        for i, names in enumerate(module_names_per_stage):
            kept = [name for name in names if not name.startswith(layer_prefix)]
            layers = range(bounds[i], bounds[i + 1])
            kept += [f"{layer_prefix}{j}" for j in layers]
            if engram.intersection(layers) and getattr(backbone, "engram_hash", None) is not None:
                kept.append(f"{layers_prefix}engram_hash")
            stages.append(kept)
        return stages

    def get_pipeline_stage_metas(
        self, *, is_first: bool, microbatch_size: int, seq_len: int, dtype: torch.dtype
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The stage's input and output tensors (module docstring), as meta tensors."""
        plan = stage_plan(self)
        text = _text_config(self)

        def meta(*shape, dt=dtype):
            return torch.empty(*shape, device="meta", dtype=dt)

        rows = (microbatch_size, seq_len)
        ids = meta(*rows, dt=torch.long)
        boundary = (meta(*rows, text.hc_mult, text.hidden_size), meta(*rows, text.hc_mult, dt=torch.float32))
        inputs = (ids,) if is_first else (*boundary, *((ids,) if plan.ids_in else ()))
        if plan.owns_head:
            if getattr(self, "_pp_return_hidden_states", False) is True:
                outputs = (meta(*rows, text.hidden_size),)
            else:
                outputs = (meta(*rows, text.vocab_size, dt=self.lm_head.weight.dtype),)
        else:
            outputs = (*boundary, *((ids,) if plan.ids_out else ()))
        return inputs, outputs

    @torch.no_grad()
    def initialize_weights(
        self, buffer_device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        """The built-in's initialisation; on a stage, of the modules the stage holds (the built-in
        reads the embedding, norm and head of the whole model)."""
        if not self._is_pipeline_parallel_stage():
            return super().initialize_weights(buffer_device=buffer_device, dtype=dtype)

        backbone = self.model
        if buffer_device is None:
            buffer_device = next(p.device for p in self.parameters())
        std = _text_config(self).initializer_range
        for module in (backbone.embed_tokens, self.lm_head):
            if module is not None:
                nn.init.normal_(module.weight, std=std)
        if getattr(backbone, "engram_hash", None) is not None:
            backbone.engram_hash.init_weights()
        for layer in backbone.layers.values():
            layer.ffn.init_weights(buffer_device, init_std=std)
            layer.attn_hc.reset_parameters(std)
            layer.ffn_hc.reset_parameters(std)
            nn.init.ones_(layer.attn_norm.weight)
            nn.init.ones_(layer.ffn_norm.weight)
            if isinstance(layer.ffn.gate, DeepseekV4VisionGate):
                layer.ffn.gate.bias_vl.zero_()
            layer.attn.reset_parameters(std)
            if layer.engram is not None:
                layer.engram.init_weights()
        if getattr(backbone, "norm", None) is not None:
            nn.init.ones_(backbone.norm.weight)
        if not _has_dtensor_params(self):
            cast_model_to_dtype(self, dtype)
        for layer in backbone.layers.values():
            if layer.engram is not None:
                layer.engram.embed.mark_sharding_contract()

    def _nemo_prepare_model_owned_dtensors(self, fsdp_mesh):
        """The built-in's hook (its Engram tables become row-sharded DTensors on ``fsdp_mesh``),
        after moving a stage's tables onto ``fsdp_mesh``'s group (module docstring)."""
        if not self._is_pipeline_parallel_stage():
            return super()._nemo_prepare_model_owned_dtensors(fsdp_mesh)
        engram = [block for block in self.model.layers.values() if block.engram is not None]
        for block in engram:
            rehome_engram_table(block.engram, fsdp_mesh)
        prepared = super()._nemo_prepare_model_owned_dtensors(fsdp_mesh)
        if engram:
            logger.info(
                "DeepSeek-V4.1 pipeline stage: the Engram tables of layers %s are row-sharded DTensors of ranks %s",
                [block.attn.layer_idx for block in engram], _ranks(fsdp_mesh.get_group()),
            )  # fmt: skip
        return prepared


def _ranks(group) -> tuple[int, ...] | None:
    return None if group is None else tuple(dist.get_process_group_ranks(group))


def _table(engram: nn.Module, group, like: torch.Tensor) -> nn.Module:
    """A new table for ``engram``'s logical rows, owned by ``group`` (None: complete and local)."""
    owners = 1 if group is None else dist.get_world_size(group)
    old = engram.embed
    table = Qwen3_8_FlashNextEngramTableConfig(
        num_embeddings=math.ceil(int(engram.num_embeddings) / owners) * owners, embedding_dim=old.embedding_dim,
        initializer_range=old.initializer_range,
    ).build(process_group=group, device=like.device, dtype=like.dtype)  # fmt: skip
    table.weight.requires_grad_(old.weight.requires_grad)
    return table


def localize_engram_table(engram: nn.Module) -> None:
    """Make ``engram.embed`` a complete table of this rank (no owner group): its rows are gathered
    from the owner group, which must be calling too (``customize_pipeline_stage_modules`` runs on
    every rank); a meta table moves nothing."""
    old = engram.embed
    if old.process_group is None:
        return
    if isinstance(old.weight, DTensor):
        raise ValueError("DeepSeek-V4.1 pipeline stages are cut before the Engram tables become DTensors (FSDP2)")
    table = _table(engram, None, old.weight)
    if old.weight.device.type != "meta":
        rows = int(engram.num_embeddings)
        gathered = old.weight.new_empty(old.num_embeddings, old.embedding_dim)
        dist.all_gather_into_tensor(gathered, old.weight.detach().contiguous(), group=old.process_group)
        with torch.no_grad():
            table.weight.copy_(gathered[:rows])
    engram.embed = table


def rehome_engram_table(engram: nn.Module, mesh) -> None:
    """Rebuild ``engram.embed`` with its rows owned by ``mesh``'s group (from a complete table)."""
    old = engram.embed
    group = mesh.get_group()
    if _ranks(old.process_group) == _ranks(group):
        return
    meta = old.weight.device.type == "meta"
    if old.owner_world_size != 1 and not meta:
        raise ValueError(
            f"an Engram table (Engram layer #{engram.layer_hash_index}) is owned by ranks {_ranks(old.process_group)}, "
            f"which hold other pipeline stages too, and this stage's ranks are {_ranks(group)}: let AutoPipeline "
            "split the model (its automatic split makes the tables complete before the stages are copied) or "
            "build it with engram_process_group of one rank"
        )
    table = _table(engram, group, old.weight)
    if not meta:
        with torch.no_grad():
            start, stop = table.global_row_start, min(table.global_row_end, int(engram.num_embeddings))
            table.weight.zero_()
            if stop > start:
                table.weight[: stop - start].copy_(old.weight[start:stop])
    engram.embed = table


def check_stage_engram_tables(model) -> None:
    """Refuse, before any collective, an Engram table whose owners were never matched to the stage
    (a lookup would wait for ranks that run other stages)."""
    for block in model.model.layers.values():
        table = None if block.engram is None else block.engram.embed
        if table is not None and table.process_group is not None and not isinstance(table.weight, DTensor):
            raise ValueError(
                f"the Engram table of layer {block.attn.layer_idx} on this pipeline stage is owned by ranks "
                f"{_ranks(table.process_group)} and is not yet a row-sharded DTensor of the stage's ranks: "
                "nemo-automodel's FSDP2 setup does that (_nemo_prepare_model_owned_dtensors with the stage's "
                "data-parallel mesh); a pipeline without FSDP2 calls that hook itself, or lets AutoPipeline's "
                "automatic split make the tables complete"
            )
