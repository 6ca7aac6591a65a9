"""The DeepSeek-V4 plugin through nemo-automodel's own pipeline stages: 2 gloo ranks, 1F1B, fp32 CPU.

Each rank builds the model, and nemo-automodel's ``AutoPipeline`` cuts it into two stages (the
embedding and layers 0-1 on rank 0; layer 2, the heads and the MTP on rank 1), as ``train_ft``
does with ``pipeline_parallel_size: 2``; the schedule runs two micro-batches with the recipe's
pipeline loss (cross-entropy plus the MTP term). Each stage builds its attention metadata from
the keyword inputs that reach it. The pipelined losses and gradients equal the plugin's own run
without stages, micro-batch by micro-batch, and the built-in's pipelined run on the same weights
(to the bounds of the unpipelined comparisons in ``test_deepseek_v4_plugin``).
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel.components.datasets.utils import packed_sequence_thd_collater
from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy
from nemo_automodel.components.loss.mtp import calculate_mtp_loss
from nemo_automodel.components.loss.utils import calculate_loss
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

from _support.cp_spawn import run_on_ranks
from _support.v4_builtin_and_plugin import (
    ATTENTION_NOISE,
    HC_MIXERS,
    VOCAB,
    assert_gradients_match,
    backend,
    build_plugin,
    randomize_,
    rel,
    tiny_config,
)

pytestmark = pytest.mark.slow

STAGES = 2
SEQ = 160  # 40 ratio-4 groups (top-k 6 of them), one ratio-128 group
IGNORE = -100
# Pipelined and unpipelined runs of one model do the same arithmetic per micro-batch; only the
# order of some fp32 sums differs (gradients accumulate per micro-batch on the stages, in one
# backward unpipelined), which the hyper-connection mixers' gradients amplify: they are bounded by
# the model's own movement under ATTENTION_NOISE (hc_floor), as against the built-in.
SAME_RUN_RTOL = 1e-6
FROZEN = "compressor.indexer."  # nemo-automodel's recipe freezes the V4 indexer (both models)


def build(kind: str, config_overrides: dict, state: dict) -> torch.nn.Module:
    config = tiny_config(**config_overrides)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config, backend=backend()) if kind == "builtin" else build_plugin(config)
    model.load_state_dict(state, strict=True)
    for name, p in model.named_parameters():
        p.requires_grad_(FROZEN not in name)
    return model.train()


def source_state(config_overrides: dict, seed: int) -> dict:
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(tiny_config(**config_overrides), backend=backend())
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    randomize_(model, seed=seed)
    return model.state_dict()


# --------------------------------------------------------------------------------------------
# batches: one row per micro-batch
# --------------------------------------------------------------------------------------------


def row_batch(seed: int) -> tuple[dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (STAGES, SEQ), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE
    labels[0, :7] = IGNORE  # a prompt without targets
    return {"input_ids": ids}, labels


def packed_batch(seed: int) -> tuple[dict, torch.Tensor]:
    """Two packed rows through nemo-automodel's THD collater (documents start on multiples of 4;
    a whole ratio-128 group only in documents starting on a multiple of 128); spans end in padding."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for real, spans in (([128, 28], [128, 32]), ([68, 80, 9], [68, 80, 12])):
        ids, labels, positions = [], [], []
        for length, span in zip(real, spans):
            doc = torch.randint(0, VOCAB, (span,), generator=gen).tolist()
            ids += doc
            labels += doc[1:length] + [IGNORE] * (span - length + 1)
            positions += list(range(span))
        rows.append({"input_ids": ids, "labels": labels, "position_ids": positions, "seq_lens": real,
                     "seq_lens_padded": spans})  # fmt: skip
    batch = packed_sequence_thd_collater(rows)
    labels = batch.pop("labels")
    assert batch["input_ids"].shape == (STAGES, SEQ) and batch["seq_lens"].shape == (STAGES, 3)
    return batch, labels


def micro_batches(batch: dict, labels: torch.Tensor) -> list[tuple[dict, torch.Tensor]]:
    """What the schedule gives each micro-batch: tensors split on dim 0, other values repeated."""
    return [
        ({k: v[i : i + 1] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}, labels[i : i + 1])
        for i in range(labels.shape[0])
    ]


# --------------------------------------------------------------------------------------------
# the pipelined run (each rank) and the unpipelined one (this process)
# --------------------------------------------------------------------------------------------


def _pipelined(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from nemo_automodel.components.distributed.pipelining.autopipeline import AutoPipeline
    from nemo_automodel.components.loss.mtp import MTPLossConfig

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    results = []
    for run in runs:
        model = build(run["kind"], run["config"], run["state"])
        loss_fn = MaskedCrossEntropy()
        pipeline = AutoPipeline(
            world_mesh=mesh, pp_axis_name="pp", dp_axis_names=None, pp_schedule="1f1b", pp_microbatch_size=1,
            pp_batch_size=STAGES, patch_inner_model=False, patch_causal_lm_model=False, device=torch.device("cpu"),
        ).build(model, loss_fn=loss_fn)  # fmt: skip
        (part,) = pipeline.parts
        (stage,) = pipeline.info.stages
        if stage.is_last:  # the loss train_ft gives the last stage: cross-entropy plus MTP
            pipeline.info.schedule._loss_fn = MTPLossConfig().build(loss_fn, part)
        batch = dict(run["batch"])
        input_ids = batch.pop("input_ids")
        pipeline.update_seq_len(input_ids.shape[1])
        losses = [] if stage.is_last else None
        pipeline.step(input_ids, target=run["labels"] if stage.is_last else None, losses=losses, **batch)
        eval_losses = None
        if run.get("eval"):  # train_ft's validation: the schedule's forward-only pass, no MTP term
            part.eval()
            eval_losses = [] if stage.is_last else None
            args = (input_ids,) if stage.is_first else ()
            target = run["labels"] if stage.is_last else None
            pipeline.info.schedule.eval(*args, target=target, losses=eval_losses, **batch)
            eval_losses = None if eval_losses is None else torch.stack([l.detach() for l in eval_losses])
        results.append({
            "eval_losses": eval_losses,
            "layers": sorted(part.model.layers.keys(), key=int),
            "has_mtp": part.mtp is not None,
            "losses": None if losses is None else torch.stack([l.detach() for l in losses]),
            "grads": {n: p.grad.detach().clone() for n, p in part.named_parameters() if p.grad is not None},
        })  # fmt: skip
    return results


def pipelined(runs: list[dict]) -> list[dict]:
    """Per run: the losses of the micro-batches and every parameter's gradient (both stages)."""
    per_rank = run_on_ranks(_pipelined, STAGES, runs)
    merged = []
    for first, last in zip(*per_rank):
        assert first["layers"] == ["0", "1"] and last["layers"] == ["2"]
        assert not first["has_mtp"]  # the MTP lives on the last stage
        assert first["losses"] is None and last["losses"].shape == (STAGES,)
        assert not first["grads"].keys() & last["grads"].keys()
        grads = {**first["grads"], **last["grads"]}
        merged.append({"losses": last["losses"], "eval_losses": last["eval_losses"], "grads": grads})
    return merged


def unpipelined(model, batch: dict, labels: torch.Tensor, attention_noise: float = 0.0, noise_seed: int = 11) -> dict:
    """train_ft's loss without stages, micro-batch by micro-batch, summed in one backward.

    ``attention_noise`` > 0 multiplies every attention output by ``1 + noise * N(0, 1)``: how far
    fp32 rounding in the attention moves the hyper-connection mixers' gradients (their bound)."""
    loss_fn = MaskedCrossEntropy()
    model.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(noise_seed)

    def perturb(module, args, output):
        noise = torch.randn(output[0].shape, generator=gen, dtype=output[0].dtype)
        return (output[0] * (1 + attention_noise * noise), *output[1:])

    blocks = [*model.model.layers.values(), *(model.mtp.layers if model.mtp is not None else ())]
    hooks = [b.self_attn.register_forward_hook(perturb) for b in blocks] if attention_noise else []
    losses = []
    try:
        for mb, mb_labels in micro_batches(batch, labels):
            out = model(**mb)
            loss = calculate_loss(loss_fn, logits=out.logits, labels=mb_labels, model=model)
            if out.mtp_per_depth_h is not None:
                loss = loss + calculate_mtp_loss(
                    loss_fn, mtp_per_depth_h=out.mtp_per_depth_h, labels=mb_labels, model=model,
                    scaling_factor=out.mtp_loss_scaling_factor, ignore_index=IGNORE,
                )  # fmt: skip
            losses.append(loss)
        torch.stack(losses).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return {"losses": torch.stack([l.detach() for l in losses]), "grads": grads}
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)


def unpipelined_eval(model, batch: dict, labels: torch.Tensor) -> torch.Tensor:
    """train_ft's validation loss without stages (no MTP term outside training), per micro-batch."""
    model.eval()
    try:
        with torch.no_grad():
            return torch.stack([
                calculate_loss(MaskedCrossEntropy(), logits=model(**mb).logits, labels=mb_labels, model=model)
                for mb, mb_labels in micro_batches(batch, labels)
            ])  # fmt: skip
    finally:
        model.train()


def hc_floor(model, batch: dict, labels: torch.Tensor, clean: dict) -> float:
    floor = 0.0
    for seed in (11, 12):
        noisy = unpipelined(model, batch, labels, attention_noise=ATTENTION_NOISE, noise_seed=seed)
        for name, g in clean["grads"].items():
            if g.any() and any(m in name for m in HC_MIXERS):
                floor = max(floor, rel(noisy["grads"][name], g))
    return floor


def assert_same_run(pipe: dict, ref: dict, floor: float) -> dict:
    """The pipelined run equals the unpipelined one: every loss and gradient to 1e-6 relative, the
    HC mixers' gradients to max(1e-6, 2 * floor) with ``floor`` the model's ``hc_floor``."""
    assert pipe["grads"].keys() == ref["grads"].keys()
    assert not any(FROZEN in n for n in pipe["grads"]) and pipe["grads"]
    hc_bound = max(SAME_RUN_RTOL, 2 * floor)
    worst = {"loss_max_abs": float((pipe["losses"] - ref["losses"]).abs().max()), "grad_max_abs": 0.0,
             "grad_max_rel": 0.0, "hc_max_rel": 0.0, "hc_bound": hc_bound}  # fmt: skip
    assert rel(pipe["losses"], ref["losses"]) <= SAME_RUN_RTOL, (pipe["losses"], ref["losses"])
    for name, g in ref["grads"].items():
        worst["grad_max_abs"] = max(worst["grad_max_abs"], float((pipe["grads"][name] - g).abs().max()))
        if g.any():
            err = rel(pipe["grads"][name], g)
            hc = any(m in name for m in HC_MIXERS)
            key = "hc_max_rel" if hc else "grad_max_rel"
            worst[key] = max(worst[key], err)
            allowed = hc_bound if hc else SAME_RUN_RTOL
            assert err <= allowed, f"{name}: rel {err:.3g} > {allowed:.3g}"
        else:
            assert not pipe["grads"][name].any(), name
    return worst


def expected_grads(model) -> set:
    return {n for n, p in model.named_parameters() if p.requires_grad}


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


def test_stage_inputs_are_checked():
    state = source_state({}, seed=1)
    plugin = build("plugin", {}, state)
    # A later stage: nemo-automodel sets the parts it does not own to None.
    plugin.model.embed_tokens = None
    del plugin.model.layers["0"]
    streams = torch.randn(1, 8, plugin.config.hc_mult, plugin.config.hidden_size)
    embeds = torch.randn(1, 8, plugin.config.hidden_size)
    with pytest.raises(ValueError, match="streams"):
        plugin(torch.zeros(1, 8, dtype=torch.long), embeds)
    with pytest.raises(ValueError, match="one per MTP depth"):
        plugin(streams, embeds, embeds)
    with pytest.raises(ValueError, match="needs the MTP embeddings"):
        plugin(streams)
    out = plugin(streams, embeds)
    assert isinstance(out, tuple) and [tuple(t.shape) for t in out] == [(1, 8, VOCAB), (1, 8, 64)]
    whole = build("plugin", {}, state)
    with pytest.raises(ValueError, match="owns the embedding"):
        whole(torch.zeros(1, 8, dtype=torch.long), embeds)


def test_pipelined_rows_with_mtp_equal_unpipelined_and_builtin():
    state = source_state({}, seed=1)
    batch, labels = row_batch(seed=2)
    runs = [{"kind": kind, "config": {}, "state": state, "batch": batch, "labels": labels, "eval": True}
            for kind in ("plugin", "builtin")]  # fmt: skip
    plugin_pp, builtin_pp = pipelined(runs)

    plugin = build("plugin", {}, state)
    ref = unpipelined(plugin, batch, labels)
    assert set(ref["grads"]) == expected_grads(plugin) and any(n.startswith("mtp.") for n in ref["grads"])
    same = assert_same_run(plugin_pp, ref, hc_floor(plugin, batch, labels, ref))
    print("rows+mtp: plugin pp losses", plugin_pp["losses"].tolist(), "unpipelined", ref["losses"].tolist(), same)

    builtin = build("builtin", {}, state)
    builtin_ref = unpipelined(builtin, batch, labels)
    floor = hc_floor(builtin, batch, labels, builtin_ref)
    builtin_same = assert_same_run(builtin_pp, builtin_ref, floor)
    loss_rel = rel(plugin_pp["losses"], builtin_pp["losses"])
    worst = assert_gradients_match(builtin_pp["grads"], plugin_pp["grads"], floor)
    print("rows+mtp: builtin pp losses", builtin_pp["losses"].tolist(), builtin_same, "loss rel", loss_rel,
          "grads", worst)  # fmt: skip
    assert loss_rel <= 1e-5

    # Validation through the schedule's forward-only pass (the last stage keeps its MTP outputs'
    # count with placeholders; the loss reads the logits).
    plugin_eval = unpipelined_eval(plugin, batch, labels)
    print("rows eval: plugin pp", plugin_pp["eval_losses"].tolist(), "unpipelined", plugin_eval.tolist(),
          "builtin pp", builtin_pp["eval_losses"].tolist())  # fmt: skip
    assert rel(plugin_pp["eval_losses"], plugin_eval) <= SAME_RUN_RTOL
    assert rel(plugin_pp["eval_losses"], builtin_pp["eval_losses"]) <= 1e-5
    # Without the MTP term the validation loss is below the training loss of the same weights.
    assert (plugin_eval < plugin_pp["losses"]).all()


def test_pipelined_packs_equal_unpipelined_and_builtin():
    # With MTP the plugin's pipelined packs equal its unpipelined ones. Against the built-in the
    # packs run without MTP: the built-in's MTP attends across the pack's documents (one causal
    # row), the plugin's within each document (test_deepseek_v4_plugin).
    mtp_state = source_state({}, seed=3)
    no_mtp = {"num_nextn_predict_layers": 0}
    state = source_state(no_mtp, seed=4)
    batch, labels = packed_batch(seed=5)
    assert batch["qkv_format"] == "thd"
    runs = [
        {"kind": "plugin", "config": {}, "state": mtp_state, "batch": batch, "labels": labels},
        {"kind": "plugin", "config": no_mtp, "state": state, "batch": batch, "labels": labels},
        {"kind": "builtin", "config": no_mtp, "state": state, "batch": batch, "labels": labels},
    ]
    plugin_mtp_pp, plugin_pp, builtin_pp = pipelined(runs)

    plugin_mtp = build("plugin", {}, mtp_state)
    ref = unpipelined(plugin_mtp, batch, labels)
    assert any(n.startswith("mtp.") for n in ref["grads"])
    same = assert_same_run(plugin_mtp_pp, ref, hc_floor(plugin_mtp, batch, labels, ref))
    print("packs+mtp: plugin pp losses", plugin_mtp_pp["losses"].tolist(), "unpipelined", ref["losses"].tolist(), same)

    plugin = build("plugin", no_mtp, state)
    plugin_ref = unpipelined(plugin, batch, labels)
    same = assert_same_run(plugin_pp, plugin_ref, hc_floor(plugin, batch, labels, plugin_ref))
    builtin = build("builtin", no_mtp, state)
    builtin_ref = unpipelined(builtin, batch, labels)
    floor = hc_floor(builtin, batch, labels, builtin_ref)
    assert_same_run(builtin_pp, builtin_ref, floor)
    loss_rel = rel(plugin_pp["losses"], builtin_pp["losses"])
    worst = assert_gradients_match(builtin_pp["grads"], plugin_pp["grads"], floor)
    print("packs: plugin pp losses", plugin_pp["losses"].tolist(), same, "builtin pp", builtin_pp["losses"].tolist(),
          "loss rel", loss_rel, "grads", worst)  # fmt: skip
    assert loss_rel <= 1e-5
