"""The indexer KL loss riding on a model output is scaled as nemo-automodel's trainer scales it.

``train_ft`` backpropagates each micro-batch's main loss (normalised by the step's label tokens)
times the DP x CP size, FSDP averages the gradients over those ranks, and the trainer sets the
gradient of auxiliary losses to ``cp_size / micro-batches`` before the step. Emulated here
exactly (the scale is set the way the trainer sets it, the CP gradients averaged as FSDP does):
two micro-batches of accumulation give the indexer the gradient of one batch of both, and two
gloo CP ranks the gradient of one process. The main loss is zero (``* 0``), so the indexer's
gradient is the KL term's alone.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel.components.moe.megatron.moe_utils import MoEAuxLossAutoScaler

from _support.cp_spawn import run_on_ranks
from nemo_dsa.integrations import automodel as integ
from _support.v4_builtin_and_plugin import SEQ, VOCAB, build_plugin, randomize_, rel, thd_batch, tiny_config

CP = 2
DOCS = [100, 301, 37]  # as the plugin's CP test: the sharder re-pads the row to 768, a document spans both ranks


@pytest.fixture(autouse=True)
def trainer_scale():
    """Set ``MoEAuxLossAutoScaler.main_loss_backward_scale`` as train_ft does; restored afterwards."""
    saved = MoEAuxLossAutoScaler.main_loss_backward_scale

    def set_scale(cp_size: int, micro_batches: int) -> None:
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(cp_size / micro_batches)

    yield set_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = saved


def kl_plugin(seed: int = 31):
    torch.manual_seed(0)
    model = build_plugin(tiny_config(num_nextn_predict_layers=0, compress_ratios=[0, 4, 128]), indexer_kl_coef=1.0)
    model.initialize_weights(dtype=torch.float32)
    randomize_(model, seed=seed)
    return model.train()


def indexer_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if "indexer." in n and p.grad is not None}


def zero_main_loss_backward(out, cp_size: int = 1) -> None:
    """train_ft's backward of the micro-batch loss (times DP x CP), with a zero main loss."""
    (out.logits.float().sum() * 0 * cp_size).backward()


def assert_same_grads(got: dict, want: dict, tol: float = 1e-5) -> None:
    assert want and got.keys() == want.keys()
    for name in want:
        assert want[name].abs().max() > 0, name
        err = rel(got[name], want[name])
        assert err <= tol, (name, err, float(got[name].norm() / want[name].norm()))


def test_plugin_accumulation_equals_one_batch(trainer_scale):
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(32))
    model = kl_plugin()
    trainer_scale(1, 1)
    zero_main_loss_backward(model(ids))
    whole = indexer_grads(model)
    model.zero_grad(set_to_none=True)
    trainer_scale(1, 2)
    for row in range(2):
        zero_main_loss_backward(model(ids[row : row + 1]))
    assert_same_grads(indexer_grads(model), whole)


def _cp_rank_grads(rank: int, world_size: int, state: dict, batch: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.tensor(world_size / 1)  # train_ft: cp / micro-batches
    model = kl_plugin()
    model.load_state_dict(state)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    sharder = model.prepare_model_inputs_for_cp(dict(batch))["cp_sharder"]
    _, shard, _ = sharder.shard_batch(mesh, None, dict(batch))
    shard.pop("labels")
    zero_main_loss_backward(model(**shard), cp_size=world_size)
    grads = indexer_grads(model)
    for grad in grads.values():  # FSDP's gradient average over the DP x CP ranks
        torch.distributed.all_reduce(grad)
        grad /= world_size
    keys = ("input_ids", "position_ids", "packed_seq_ids", "padding_mask")
    return {"grads": grads, **{k: shard[k] for k in keys}}


@pytest.mark.slow
def test_plugin_cp2_equals_one_process(trainer_scale):
    source = kl_plugin()
    batch, _ = thd_batch(DOCS, DOCS, seed=33)
    batch["labels"] = batch["input_ids"].clone()
    ranks = run_on_ranks(_cp_rank_grads, CP, source.state_dict(), batch)
    whole = {k: torch.cat([r[k] for r in ranks], dim=1) for k in ranks[0] if k != "grads"}
    trainer_scale(1, 1)
    out = source(**whole, qkv_format="thd")
    zero_main_loss_backward(out)
    assert_same_grads(ranks[0]["grads"], indexer_grads(source))


def test_automodel_wrapper_trains_the_indexer_without_labels(trainer_scale):
    # nemo-automodel's trainer calls the model without labels and builds its loss from the
    # logits: the KL term must reach the backward through them, at the trainer's scale.
    config = integ.NemoDsaV4Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, head_dim=32,
        qk_rope_head_dim=16, q_lora_rank=32, intermediate_size=96, compress_ratios=[0, 4, 8],
        sliding_window=8, index_n_heads=4, index_head_dim=32, index_topk=3, indexer_kl_coef=1.0,
        indexer_backend="torch",
    )  # fmt: skip
    torch.manual_seed(0)
    model = integ.NemoDsaV4ForCausalLM(config).train()
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(34))
    trainer_scale(1, 1)
    out = model(ids)
    assert out.aux_loss is not None and out.aux_loss > 0
    zero_main_loss_backward(out)
    whole = indexer_grads(model)
    assert all(p.grad is None or not p.grad.any() for n, p in model.named_parameters() if "indexer." not in n)
    model.zero_grad(set_to_none=True)
    trainer_scale(1, 2)
    for row in range(2):
        zero_main_loss_backward(model(ids[row : row + 1]))
    assert_same_grads(indexer_grads(model), whole)
    # With labels the KL term is part of ``loss`` and not attached a second time.
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    (out.logits.sum() * 0).backward()
    assert not indexer_grads(model) or not any(g.any() for g in indexer_grads(model).values())
