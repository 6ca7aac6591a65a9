"""The V4.1 plugin under context parallelism: nemo-automodel's own DeepSeek-V4.1 CP sharder, 2 gloo ranks.

Each rank shards the same batch with the built-in's ``prepare_model_inputs_for_cp`` sharder
(documents aligned to multiples of 2, the row padded to ``2 * lcm(ratios) = 4``, contiguous
shards, ``cp_group``) and runs ``NemoDsaDeepseekV41ForCausalLM`` (the built-in forward) on its
shard, then backpropagates its shard's summed cross-entropy. Put back together, the shards' logits
and the summed loss equal one process running the plugin on the same (aligned, padded) layout,
and the ranks' gradients summed equal that process's gradients: the sharder's output reaches
nemo_dsa's metadata as it is, and the compressed KV, the index keys and the window tail cross
the shard boundary in the forward and the backward.

The tiny config is the plugin test's (ratios 0/2/2/2/1/1/1: source / reuse / reindex on ratio 2,
source / reindex / reuse on ratio 1, candidate blocks from layer 4). The test checks that the
boundary is really crossed: a packed document runs across it, and rank 1's queries select
compressed entries and keep candidate blocks built from rank 0's tokens in every selecting layer
(source, reindex) and the reuse layers that inherit them.

Bounds (fp32): per row the two runs do the same arithmetic except the order of a few sums (the
MoE's token grouping, the gradient sums over tokens, which CP splits in two and adds); logits and
loss are held to rel 1e-6 (measured: bitwise equal), selections and candidate blocks identical,
every gradient to rel 1e-5 (measured 6.9e-7 packed, 9.1e-7 rows) except the hyper-connection
mixers' (``attn_hc``, ``ffn_hc``), which sum per-token contributions that nearly cancel, so the
split sum moves them more: held to rel 1e-4 (measured 2.8e-5 packed, 3.2e-5 rows).
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from _support.cp_spawn import run_on_ranks
from _support.tiny_released_v41 import RATIOS, ROLES, rel
from _support.v41_builtin_and_plugin import VOCAB, backend, build_models, config

pytestmark = pytest.mark.slow

CP = 2
# Documents of 50, 61 and 37 tokens: aligned to 50, 62, 38 (starts 0, 50, 112), the row padded to
# 152 (shards of 76), so the second document runs across the boundary at 76.
DOCS = [50, 61, 37]
ROWS = (2, 94, 70)  # rows, length (padded to 96: shards of 48), the second row's real tokens
HC_MIXERS = ("attn_hc.", "ffn_hc.")


def cp_batch(kind: str) -> dict:
    """The trainer's batch: labels already shifted within each document (-100 at its end)."""
    gen = torch.Generator().manual_seed({"packed": 31, "rows": 32}[kind])
    if kind == "packed":
        ids = torch.randint(0, VOCAB, (1, sum(DOCS)), generator=gen)
        labels = torch.full_like(ids, -100)
        start = 0
        for length in DOCS:
            labels[0, start : start + length - 1] = ids[0, start + 1 : start + length]
            start += length
        return {"input_ids": ids, "labels": labels, "seq_lens": torch.tensor([DOCS])}
    rows, length, real = ROWS
    ids = torch.randint(0, VOCAB, (rows, length), generator=gen)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, real:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def plugin_from(state: dict):
    from nemo_dsa.integrations.deepseek_v41 import NemoDsaDeepseekV41ForCausalLM

    model = NemoDsaDeepseekV41ForCausalLM(config(), backend=backend())
    model.load_state_dict(state, strict=True)
    return model


def record_sources(model) -> tuple[list, list]:
    """Forward hooks: per layer, the latest source's (top-k indices, candidate blocks) after it."""
    picked, hooks = [], []

    def hook(module, args, output):
        source = output.state.shared.source
        picked.append(None if source is None else (source.selection.topk_indices, source.candidate_blocks))

    for block in model.model.layers.values():
        hooks.append(block.attn.register_forward_hook(hook))
    return picked, hooks


def run_plugin(model, inputs: dict, labels: torch.Tensor) -> dict:
    """Logits, summed cross-entropy, gradients and per-layer selections of one forward/backward."""
    picked, hooks = record_sources(model)
    try:
        logits = model(**inputs).logits
    finally:
        for hook in hooks:
            hook.remove()
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits.detach(), "loss": loss.detach(), "grads": grads, "picked": picked}


def _shard_and_run(rank: int, world_size: int, state: dict, batch: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = plugin_from(state)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    sharder = model.prepare_model_inputs_for_cp(dict(batch))["cp_sharder"]
    _, shard, _ = sharder.shard_batch(mesh, None, dict(batch))
    assert shard["cp_group"] is not None
    labels = shard.pop("labels")
    shard.pop("loss_mask", None)
    layout = {k: shard[k] for k in ("input_ids", "position_ids", "attention_mask", "packed_seq_ids") if k in shard}
    return {"labels": labels, "layout": layout, **run_plugin(model, shard, labels)}


def first_entry_of(rank_tokens: int, ratio: int) -> int:
    """The first compressed entry built from rank 1's tokens (entries of rank 0 lie below it)."""
    return rank_tokens // ratio


@pytest.fixture(scope="module")
def state() -> dict:
    _, plugin = build_models()
    return plugin.state_dict()


@pytest.mark.parametrize("kind", ["packed", "rows"])
def test_cp_shards_equal_one_process(kind, state):
    batch = cp_batch(kind)
    shards = run_on_ranks(_shard_and_run, CP, state, batch)
    layout = {k: torch.cat([s["layout"][k] for s in shards], dim=1) for k in shards[0]["layout"]}
    labels = torch.cat([s["labels"] for s in shards], dim=1)
    local = shards[0]["labels"].shape[1]
    if kind == "packed":
        ids = layout["packed_seq_ids"]
        assert ids.shape[1] == 152 and shards[1]["layout"]["packed_seq_ids"][0, 0] == ids[0, local - 1] == 2
    else:
        assert layout["input_ids"].shape[1] == 96

    reference = run_plugin(plugin_from(state), layout, labels)  # one process, no cp_group
    logits = torch.cat([s["logits"] for s in shards], dim=1)
    real = layout["attention_mask"].bool()
    loss = sum(s["loss"] for s in shards)
    print(kind, "logits rel", rel(logits[real], reference["logits"][real]), "loss rel", rel(loss, reference["loss"]))
    assert rel(logits[real], reference["logits"][real]) <= 1e-6
    assert rel(loss, reference["loss"]) <= 1e-6

    # Selections: identical on real queries; rank 1 reaches rank 0's entries in every compressed layer.
    for layer_idx, ratio in enumerate(RATIOS):
        if ratio == 0:
            assert reference["picked"][layer_idx] is None
            continue
        indices = torch.cat([s["picked"][layer_idx][0] for s in shards], dim=1)
        ref_indices = reference["picked"][layer_idx][0]
        assert torch.equal(indices.sort(-1).values[real], ref_indices.sort(-1).values[real]), layer_idx
        remote = shards[1]["picked"][layer_idx][0][real[:, local:]]
        assert ((remote >= 0) & (remote < first_entry_of(local, ratio))).any(), (layer_idx, ROLES[layer_idx])
        blocks = [s["picked"][layer_idx][1] for s in shards]
        if layer_idx >= 4:  # from the candidate source on
            ref_blocks = reference["picked"][layer_idx][1]
            blocks = torch.cat(blocks, dim=1)
            assert torch.equal(blocks.sort(-1).values[real], ref_blocks.sort(-1).values[real]), layer_idx
            block_size = 4
            remote_blocks = shards[1]["picked"][layer_idx][1][real[:, local:]]
            assert ((remote_blocks >= 0) & (remote_blocks * block_size < first_entry_of(local, ratio))).any()
        else:
            assert all(b is None for b in blocks)

    worst, worst_hc = 0.0, 0.0
    for name, ref_grad in reference["grads"].items():
        grads = [s["grads"][name] for s in shards]
        if ref_grad is None:
            assert all(g is None or not g.any() for g in grads), name
            continue
        total = sum(g if g is not None else torch.zeros_like(ref_grad) for g in grads)
        err = rel(total, ref_grad)
        if any(m in name for m in HC_MIXERS):
            worst_hc = max(worst_hc, err)
            assert err <= 1e-4, (name, err)
        else:
            worst = max(worst, err)
            assert err <= 1e-5, (name, err)
    print(kind, "gradients rel (worst)", worst, "hyper-connection mixers", worst_hc)
