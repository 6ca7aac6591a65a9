"""The DeepSeek-V4.1 plugin through nemo-automodel's own pipeline stages: gloo ranks, fp32 CPU.

nemo-automodel 0.7.0 builds no stages for its V4.1 model (``supports_pp`` False); the plugin's come
from the same ``AutoPipeline`` ``train_ft`` uses (``deepseek_v41/pipeline.py``). The tiny config
has every layer role: window-only (0, 4), ratio-2 kv source (1, 5), reuse (2, 6), reindex (3), the
ratio-1 candidate source (7), a reindex masked to its candidate blocks (8), reuse (9); Engram on
layers 0 and 6 (with a word-level tokenizer whose ids merge pairwise under Engram's
normalisation). Cuts are allowed only before layers 1, 4, 5 and 7, so nemo-automodel's even split
moves: 2 stages cut before 5 (its own choice), 4 stages before 1, 4 and 7 (instead of 3, 6 and 8).

Each rank builds the model with the built-in's default Engram owners (every rank), and
``AutoPipeline`` cuts it, as ``train_ft`` does; the schedule runs one micro-batch per row with the
recipe's pipeline loss. The losses and every gradient equal the plugin's own run without stages,
micro-batch by micro-batch: the losses to 1e-6 relative (measured: bitwise equal; each stage
computes what the whole model computes there, and THD packs cross a boundary in the caller's
token order, exactly), every gradient to 1e-6 relative, except the hyper-connection mixers'
(Sinkhorn-normalised mixing summed over every token), held to max(1e-6, 4 x) their own movement
when the backward's gradients move by one fp32 rounding (1e-7 relative at every block input and
at the logits, the larger of two draws; four times, as test_deepseek_v41_plugin holds the mixers;
measured: at most 0.56 of that bound, 3.8e-5 relative): the pipelined backward sums in another
order (the received streams' several uses at a boundary, the micro-batches' contributions one at
a time). The V4 pipeline test perturbs the attention outputs instead; on V4.1 that moves fp8 /
NVFP4 / MXFP4 codes and selections, and the mixers' gradients by up to 5 %: no bound at all.

Covered: rows (one right-padded, with the default collater's masks) and THD packs (nemo-automodel's
collater, documents of odd lengths inside padded spans); 1F1B on 2 and 4 ranks and
Interleaved1F1B (two stages per rank) on 2; validation through the schedule's forward-only pass;
a stage's Engram tables both as complete tables and as row-sharded DTensors of the stage's ranks
(the hook nemo-automodel's MoE parallelizer calls).
"""

from __future__ import annotations

import io

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel.components.datasets.utils import packed_sequence_thd_collater
from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy
from nemo_automodel.components.loss.utils import calculate_loss
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config, DeepseekV41TextConfig
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from nemo_automodel.components.utils.model_utils import filter_forward_kwargs

from _support.cp_spawn import run_on_ranks
from nemo_dsa.integrations import NemoDsaDeepseekV41ForCausalLM
from nemo_dsa.integrations.deepseek_v41.pipeline import clean_cuts, plan_stage_layers

VOCAB = 64
SEQ = 64
IGNORE = -100
RATIOS = [0, 2, 2, 2, 0, 2, 2, 1, 1, 1]
ROLES = ["window", "source", "reuse", "reindex", "window", "source", "reuse", "source", "reindex", "reuse"]
CUTS = [1, 4, 5, 7]
ENGRAM = [0, 6]
SAME_RUN_RTOL = 1e-6
GRAD_NOISE = 1e-7  # about one fp32 rounding (2^-23 = 1.2e-7)
HC_FLOOR_FACTOR = 4
HC_MIXERS = ("attn_hc.", "ffn_hc.")


def tokenizer():
    """64 word-level ids; ``w<k>`` and ``W<k>`` normalise to one Engram id (32 of them)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {(f"w{i // 2}" if i % 2 == 0 else f"W{i // 2}"): i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")), unk_token="w0")


def text_config(**overrides) -> DeepseekV41TextConfig:
    args = dict(
        vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(RATIOS),
        num_attention_heads=4, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=16, o_groups=2,
        compress_ratios=list(RATIOS), kv_source_layer_ids=[1, 5, 7], index_source_layer_ids=[1, 3, 5, 7, 8],
        candidate_source_layer_id=7, candidate_topk_blocks=3, candidate_block_size=4, sliding_window=8,
        index_n_heads=8, index_head_dim=32, index_topk=6, max_position_embeddings=256,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                      "beta_slow": 1},
        engram_layer_ids=list(ENGRAM), engram_num_embeddings=[61, 127], engram_max_ngram_size=3,
        engram_vocab_size=11, engram_n_heads=2, engram_head_dim=8, engram_pad_token_id=2,
        engram_compressed_vocab_size=VOCAB // 2, num_nextn_predict_layers=0, n_routed_experts=2,
        num_experts_per_tok=1, dspark_noise_token_id=3, rms_norm_eps=1e-6, dtype="float32", pad_token_id=2,
    )  # fmt: skip
    args.update(overrides)
    return DeepseekV41TextConfig(**args)


def config() -> DeepseekV41Config:
    text = text_config().to_dict()
    return DeepseekV41Config(text_config=text, vision_config={"num_hidden_layers": 0}, dtype="float32")


def backend() -> BackendConfig:
    return BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                         enable_hf_state_dict_adapter=True, dispatcher="torch", experts="torch_mm")  # fmt: skip


def build(state: dict | None = None) -> NemoDsaDeepseekV41ForCausalLM:
    """The plugin holding ``state``. Under torch.distributed each Engram table's rows are spread
    over every rank (the built-in's default owners): each rank loads its own rows."""
    torch.manual_seed(0)
    model = NemoDsaDeepseekV41ForCausalLM(config(), backend=backend(), tokenizer=tokenizer())
    if state is not None:
        state = dict(state)
        for block in model.model.layers.values():
            table = None if block.engram is None else block.engram.embed
            if table is not None and table.process_group is not None:
                key = f"model.layers.{block.attn.layer_idx}.engram.embed.weight"
                rows = torch.zeros(table.num_embeddings, table.embedding_dim)
                rows[: state[key].shape[0]] = state[key]
                state[key] = rows[table.global_row_start : table.global_row_end]
        model.load_state_dict(state, strict=True)
    return model.train()


def source_state(seed: int) -> dict:
    """Random weights (one process, complete Engram tables); the attention's large enough that it
    decides the logits (as in test_deepseek_v41_plugin)."""
    model = build()
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".attn." in name:
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * (0.5 if p.ndim == 1 else 0.15))
    return model.state_dict()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# --------------------------------------------------------------------------------------------
# batches: one row per micro-batch
# --------------------------------------------------------------------------------------------


def row_batch(seed: int, rows: int, padded: bool = False) -> tuple[dict, torch.Tensor]:
    """Rows; ``padded``: the last row right-padded, with the masks nemo-automodel's default
    collater writes (``attention_mask``, and ``padding_mask``, which the V4.1 forward does not take)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = IGNORE
    labels[0, :5] = IGNORE  # a prompt without targets
    if not padded:
        return {"input_ids": ids}, labels
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    mask[-1, SEQ - 13 :] = 0
    labels[-1, SEQ - 14 :] = IGNORE
    return {"input_ids": ids.masked_fill(mask == 0, 2), "attention_mask": mask, "padding_mask": mask == 0}, labels


def packed_batch(seed: int, rows: int) -> tuple[dict, torch.Tensor]:
    """Rows through nemo-automodel's THD collater: documents of odd lengths (the stages align them
    to the ratio-2 groups themselves), spans ending in padding."""
    gen = torch.Generator().manual_seed(seed)
    layouts = [([37, 20], [37, 27]), ([13, 30, 15], [13, 32, 19])]
    examples = []
    for row in range(rows):
        real, spans = layouts[row % 2]
        ids, labels, positions = [], [], []
        for length, span in zip(real, spans):
            doc = torch.randint(0, VOCAB, (span,), generator=gen).tolist()
            ids += doc
            labels += doc[1:length] + [IGNORE] * (span - length + 1)
            positions += list(range(span))
        examples.append({"input_ids": ids, "labels": labels, "position_ids": positions, "seq_lens": real,
                         "seq_lens_padded": spans})  # fmt: skip
    batch = packed_sequence_thd_collater(examples)
    labels = batch.pop("labels")
    assert batch["qkv_format"] == "thd" and batch["input_ids"].shape == (rows, SEQ)
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


def _pipelined(rank: int, world_size: int, payload: bytes) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from nemo_automodel.components.distributed.pipelining.autopipeline import AutoPipeline
    from nemo_automodel.components.loss.mtp import MTPLossConfig

    runs = torch.load(io.BytesIO(payload), weights_only=False)
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("pp", "dp"))
    results = []
    for run in runs:
        model = build(run["state"])  # Engram tables owned by every rank (the built-in's default)
        loss_fn = MaskedCrossEntropy()
        n = run["labels"].shape[0]
        pipeline = AutoPipeline(
            world_mesh=mesh, pp_axis_name="pp", dp_axis_names=None, pp_schedule=run["schedule"],
            pp_microbatch_size=1, pp_batch_size=n, patch_inner_model=False, patch_causal_lm_model=False,
            device=torch.device("cpu"),
        ).build(model, loss_fn=loss_fn)  # fmt: skip
        if run["fsdp_hook"]:  # what nemo-automodel's FSDP2 setup calls with each stage's mesh
            for part in pipeline.parts:
                part._nemo_prepare_model_owned_dtensors(mesh["dp"])
        stages = pipeline.info.stages
        last = [part for part, stage in zip(pipeline.parts, stages) if stage.is_last]
        if last:  # the loss train_ft gives the last stage
            pipeline.info.schedule._loss_fn = MTPLossConfig().build(loss_fn, last[0])
        batch = dict(run["batch"])
        input_ids = batch.pop("input_ids")
        pipeline.update_seq_len(input_ids.shape[1])
        losses = [] if pipeline.info.has_last_stage else None
        target = run["labels"] if pipeline.info.has_last_stage else None
        pipeline.step(input_ids, target=target, losses=losses, **batch)
        eval_losses = None
        if run.get("eval"):  # train_ft's validation: the schedule's forward-only pass
            for part in pipeline.parts:
                part.eval()
            eval_losses = [] if pipeline.info.has_last_stage else None
            args = (input_ids,) if pipeline.info.has_first_stage else ()
            pipeline.info.schedule.eval(*args, target=target, losses=eval_losses, **batch)
            eval_losses = None if eval_losses is None else torch.stack([loss.detach() for loss in eval_losses])
        grads, tables = {}, {}
        for part in pipeline.parts:
            for name, p in part.named_parameters():
                if p.grad is not None:
                    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    grads[name] = grad.detach().clone()
                if name.endswith("engram.embed.weight"):
                    tables[name] = type(p).__name__
        results.append({
            "stages": [(stage.stage_index, sorted(map(int, part.model.layers.keys())))
                       for part, stage in zip(pipeline.parts, stages)],
            "losses": None if losses is None else torch.stack([loss.detach() for loss in losses]),
            "eval_losses": eval_losses, "grads": grads, "tables": tables,
        })  # fmt: skip
    return results


def pipelined(runs: list[dict], world_size: int) -> list[dict]:
    """Per run: the stages' layers, the micro-batches' losses and every parameter's gradient."""
    buffer = io.BytesIO()
    torch.save(runs, buffer)  # one payload: a state dict's tensors would each need a descriptor
    per_rank = run_on_ranks(_pipelined, world_size, buffer.getvalue())
    merged = []
    for per_run in zip(*per_rank):
        grads, tables, stages = {}, {}, []
        for result in per_run:
            assert not grads.keys() & result["grads"].keys()
            grads.update(result["grads"])
            tables.update(result["tables"])
            stages += result["stages"]
        losses = [r["losses"] for r in per_run if r["losses"] is not None]
        assert len(losses) == 1
        eval_losses = [r["eval_losses"] for r in per_run if r["eval_losses"] is not None]
        merged.append({"stages": [layers for _, layers in sorted(stages)], "losses": losses[0], "grads": grads,
                       "tables": tables, "eval_losses": eval_losses[0] if eval_losses else None})  # fmt: skip
    return merged


def unpipelined(model, batch: dict, labels: torch.Tensor, grad_noise: float = 0.0, noise_seed: int = 11) -> dict:
    """train_ft's loss without stages, micro-batch by micro-batch, summed in one backward. With
    ``grad_noise`` the gradient reaching every block's input streams and every micro-batch's logits
    is multiplied by ``1 + grad_noise * N(0, 1)``: fp32 rounding of the backward's sums, where the
    pipelined run sums in another order (at a boundary, across micro-batches); the forward, and so
    every fp8 / NVFP4 / MXFP4 code and selection, is unchanged."""
    loss_fn = MaskedCrossEntropy()
    model.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(noise_seed)

    def perturb(grad):
        return grad * (1 + grad_noise * torch.randn(grad.shape, generator=gen))

    def block_input(module, args, kwargs):
        if args[0].requires_grad:
            args[0].register_hook(perturb)

    blocks = model.model.layers.values()
    hooks = [b.register_forward_pre_hook(block_input, with_kwargs=True) for b in blocks] if grad_noise else []
    try:
        losses = []
        for mb, mb_labels in micro_batches(batch, labels):
            logits = model(**filter_forward_kwargs(model, mb)).logits  # as train_ft without stages
            if grad_noise:
                logits.register_hook(perturb)
            losses.append(calculate_loss(loss_fn, logits=logits, labels=mb_labels, model=model))
        torch.stack(losses).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return {"losses": torch.stack([loss.detach() for loss in losses]), "grads": grads}
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)


def unpipelined_eval(model, batch: dict, labels: torch.Tensor) -> torch.Tensor:
    model.eval()
    try:
        with torch.no_grad():
            return torch.stack([
                calculate_loss(MaskedCrossEntropy(), logits=model(**filter_forward_kwargs(model, mb)).logits,
                               labels=mb_labels, model=model)
                for mb, mb_labels in micro_batches(batch, labels)
            ])  # fmt: skip
    finally:
        model.train()


def hc_floors(model, batch: dict, labels: torch.Tensor, clean: dict) -> dict:
    """Per hyper-connection mixer parameter: the largest relative movement of its gradient under
    GRAD_NOISE in the backward (two draws)."""
    floors: dict = {}
    for seed in (11, 12):
        noisy = unpipelined(model, batch, labels, grad_noise=GRAD_NOISE, noise_seed=seed)
        for name, g in clean["grads"].items():
            if g.any() and any(m in name for m in HC_MIXERS):
                floors[name] = max(floors.get(name, 0.0), rel(noisy["grads"][name], g))
    return floors


def assert_same_run(pipe: dict, ref: dict, floors: dict) -> dict:
    """Every loss and gradient to 1e-6 relative, each HC mixer's to max(1e-6, 4 x its floor)."""
    assert pipe["grads"].keys() == ref["grads"].keys()
    worst = {"loss_rel": rel(pipe["losses"], ref["losses"]), "grad_max_rel": 0.0, "hc_max_rel": 0.0,
             "hc_max_over_bound": 0.0}  # fmt: skip
    assert worst["loss_rel"] <= SAME_RUN_RTOL, (pipe["losses"], ref["losses"])
    for name, g in ref["grads"].items():
        if not g.any():
            assert not pipe["grads"][name].any(), name
            continue
        err = rel(pipe["grads"][name], g)
        if name in floors:
            allowed = max(SAME_RUN_RTOL, HC_FLOOR_FACTOR * floors[name])
            worst["hc_max_rel"] = max(worst["hc_max_rel"], err)
            worst["hc_max_over_bound"] = max(worst["hc_max_over_bound"], err / allowed)
        else:
            allowed = SAME_RUN_RTOL
            worst["grad_max_rel"] = max(worst["grad_max_rel"], err)
        assert err <= allowed, f"{name}: rel {err:.3g} > {allowed:.3g}"
    return worst


def check_against_unpipelined(pipe: dict, state: dict, batch: dict, labels: torch.Tensor, what: str) -> None:
    model = build(state)
    ref = unpipelined(model, batch, labels)
    trained = {n for n, p in model.named_parameters() if p.requires_grad and ".indexer." not in n}
    assert set(ref["grads"]) == trained  # the V4.1 indexer is frozen: no gradient, as without stages
    assert any(".engram.embed." in n for n in ref["grads"])
    worst = assert_same_run(pipe, ref, hc_floors(model, batch, labels, ref))
    print(what, "pp losses", pipe["losses"].tolist(), "unpipelined", ref["losses"].tolist(), worst)
    if pipe["eval_losses"] is not None:
        expected = unpipelined_eval(model, batch, labels)
        print(what, "eval pp", pipe["eval_losses"].tolist(), "unpipelined", expected.tolist())
        assert rel(pipe["eval_losses"], expected) <= SAME_RUN_RTOL


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


def test_cuts_follow_the_layer_roles():
    model = build()
    assert [model.dsa_config.attention_role(i) for i in range(len(RATIOS))] == ROLES
    assert clean_cuts(model.dsa_config, len(RATIOS)) == CUTS
    assert plan_stage_layers(10, 2, CUTS, [5]) == [5]
    assert plan_stage_layers(10, 4, CUTS, [3, 6, 8]) == [1, 4, 7]  # the largest stage: 3 layers
    assert plan_stage_layers(10, 5, CUTS, [2, 4, 6, 8]) == CUTS
    with pytest.raises(ValueError, match=r"boundary only before layers \[1, 4, 5, 7\]"):
        plan_stage_layers(10, 6, CUTS, [2, 4, 6, 8, 9])
    # The released V4.1 schedule: kv sources 2, 8, 14, 20 (20 the candidate source), ratio-1 layers
    # 20..39 reindex or reuse layer 20's keys, so 2 stages split it evenly before layer 20.
    released = DeepseekV41Config(vision_config={"num_hidden_layers": 0})
    from nemo_dsa.integrations.deepseek_v41.configuration import dsa_config_from_deepseek_v41

    dsa = dsa_config_from_deepseek_v41(released)
    assert clean_cuts(dsa, 40) == [1, 2, 8, 14, 20]
    assert plan_stage_layers(40, 2, clean_cuts(dsa, 40), [20]) == [20]
    assert plan_stage_layers(40, 4, clean_cuts(dsa, 40), [10, 20, 30]) == [8, 14, 20]


def test_supports_pp_and_the_builtin_still_refuses():
    assert NemoDsaDeepseekV41ForCausalLM.ModelCapabilities().supports_pp is True
    assert DeepseekV41ForCausalLM.ModelCapabilities().supports_pp is False
    assert NemoDsaDeepseekV41ForCausalLM._pp_keep_self_forward is True


def test_stage_inputs_and_boundaries_are_checked():
    state = source_state(seed=5)
    last = build(state)  # the last of two stages: layers 5..9, the norm and the head
    last.model.embed_tokens = None
    for i in range(5):
        del last.model.layers[str(i)]
    inputs, outputs = last.get_pipeline_stage_metas(is_first=False, microbatch_size=2, seq_len=SEQ, dtype=torch.float32)
    assert [(tuple(t.shape), t.dtype) for t in inputs] == [
        ((2, SEQ, 4, 64), torch.float32), ((2, SEQ, 4), torch.float32), ((2, SEQ), torch.int64)]  # fmt: skip
    assert [(tuple(t.shape), t.dtype) for t in outputs] == [((2, SEQ, VOCAB), torch.float32)]
    streams, pre_mix = torch.randn(1, SEQ, 4, 64), torch.rand(1, SEQ, 4)
    ids = torch.randint(0, VOCAB, (1, SEQ))
    assert last(streams, pre_mix, ids, padding_mask=torch.zeros(1, SEQ, dtype=torch.bool)).shape == (1, SEQ, VOCAB)
    with pytest.raises(ValueError, match="takes the previous stage's 3 tensors"):
        last(streams, pre_mix)  # layer 6 is an Engram layer: the token ids come along
    with pytest.raises(ValueError, match="pre_mix must be fp32"):
        last(streams, pre_mix.double(), ids)
    with pytest.raises(ValueError, match="takes no labels"):
        last(streams, pre_mix, ids, labels=ids)

    first = build(state)  # the first stage: the embedding and layers 0..4
    first.lm_head, first.model.norm = None, None
    for i in range(5, 10):
        del first.model.layers[str(i)]
    inputs, outputs = first.get_pipeline_stage_metas(is_first=True, microbatch_size=1, seq_len=SEQ, dtype=torch.float32)
    assert [tuple(t.shape) for t in inputs] == [(1, SEQ)] and len(outputs) == 3
    out = first(ids)
    assert isinstance(out, tuple) and [tuple(t.shape) for t in out] == [(1, SEQ, 4, 64), (1, SEQ, 4), (1, SEQ)]
    assert torch.equal(out[2], ids) and out[1].dtype == torch.float32

    split = build(state)  # a stage cut between a kv source (1) and the layer reusing it (2)
    split.model.embed_tokens = None
    for i in range(2):
        del split.model.layers[str(i)]
    with pytest.raises(ValueError, match=r"boundary before layer 2 .* allowed before layers \[1, 4, 5, 7\]"):
        split(streams, pre_mix, ids)
    whole = build(state)  # the whole model keeps the built-in's forward
    assert whole(ids).logits.shape == (1, SEQ, VOCAB)


pipeline_run = pytest.mark.slow


@pipeline_run
def test_two_stages_1f1b_rows_and_packs_equal_unpipelined():
    state = source_state(seed=5)
    rows, row_labels = row_batch(seed=1, rows=2, padded=True)
    packs, pack_labels = packed_batch(seed=2, rows=2)
    runs = [
        {"state": state, "schedule": "1F1B", "batch": rows, "labels": row_labels, "fsdp_hook": True, "eval": True},
        {"state": state, "schedule": "1F1B", "batch": packs, "labels": pack_labels, "fsdp_hook": False},
    ]
    rows_pp, packs_pp = pipelined(runs, world_size=2)
    for run in (rows_pp, packs_pp):
        assert run["stages"] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # nemo-automodel's even split: a clean cut
    # Stage tables: row-sharded DTensors of the stage's rank after the FSDP2 hook, else complete.
    assert set(rows_pp["tables"].values()) == {"DTensor"} and set(packs_pp["tables"].values()) == {"Parameter"}
    check_against_unpipelined(rows_pp, state, rows, row_labels, "2 stages 1F1B rows")
    check_against_unpipelined(packs_pp, state, packs, pack_labels, "2 stages 1F1B packs")


@pipeline_run
def test_four_stages_1f1b_equal_unpipelined():
    state = source_state(seed=6)
    packs, labels = packed_batch(seed=3, rows=4)
    (pipe,) = pipelined([{"state": state, "schedule": "1F1B", "batch": packs, "labels": labels, "fsdp_hook": True}], 4)
    # Moved from nemo-automodel's 3 / 6 / 8 to the clean cuts: layer 6's Engram token ids pass through stage 1.
    assert pipe["stages"] == [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    check_against_unpipelined(pipe, state, packs, labels, "4 stages 1F1B packs")


@pipeline_run
def test_interleaved_two_stages_per_rank_equal_unpipelined():
    state = source_state(seed=7)
    rows, row_labels = row_batch(seed=4, rows=4)
    packs, pack_labels = packed_batch(seed=5, rows=4)
    runs = [
        {"state": state, "schedule": "Interleaved1F1B", "batch": rows, "labels": row_labels, "fsdp_hook": False,
         "eval": True},
        {"state": state, "schedule": "Interleaved1F1B", "batch": packs, "labels": pack_labels, "fsdp_hook": True},
    ]  # fmt: skip
    rows_pp, packs_pp = pipelined(runs, world_size=2)
    for run in (rows_pp, packs_pp):
        assert run["stages"] == [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]  # stages 0 and 2 on rank 0
    check_against_unpipelined(rows_pp, state, rows, row_labels, "interleaved rows")
    check_against_unpipelined(packs_pp, state, packs, pack_labels, "interleaved packs")
