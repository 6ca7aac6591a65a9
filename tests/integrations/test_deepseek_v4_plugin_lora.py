"""LoRA through nemo-automodel's PEFT on NemoDsaDeepseekV4ForCausalLM, against the built-in (CPU, fp32).

``apply_lora_to_linear_modules`` runs on both models with the same base weights; the adapters
are then given the same random values (``lora_B`` is zero at PEFT's init, which would leave
``lora_A`` without gradient), so logits, top-k selections and every adapter gradient can be
compared on the sparse path. Targets: the attention's ``wq_a``, ``wq_b``, ``wkv``, ``wo_a``,
``wo_b``, the compressors' ``wkv`` / ``wgate``, the indexer's ``wq_b`` / ``weights_proj`` and the
routed experts.

The built-in's grouped ``wo_a`` takes an adapter only with one output group and PEFT's plain
(not memory-efficient) LoRA: with more groups its LoRA linear maps every group through the
whole weight (a shape error in ``wo_b``), and the memory-efficient backward takes 2-D or 3-D
inputs where ``wo_a`` sees 4-D ones. So the comparison that includes ``wo_a`` uses
``o_groups=1`` and ``use_memory_efficient_lora=False``; the release layout (``o_groups=2``) with
PEFT's defaults is compared on every other target, and the plugin's grouped adapter is checked
against the map of its effective weight.
"""

from __future__ import annotations

import os

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from safetensors import safe_open

from _support.helpers import cpu_automodel  # noqa: F401 (a fixture)

from nemo_automodel.components._peft.lora import PeftConfig, apply_lora_to_linear_modules, patch_linear_module
from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
from nemo_automodel.components.checkpoint.config import CheckpointingConfig
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

from nemo_dsa.layers.grouped_linear import GroupedLinear
from _support.lora_adapters import adapter_gradients, adapter_names
from _support.v4_builtin_and_plugin import RTOL, SEQ, VOCAB, backend, build_plugin, compare, randomize_, rel, tiny_config

ATTENTION = ["*.self_attn.wq_a", "*.self_attn.wq_b", "*.self_attn.wkv", "*.self_attn.wo_b"]
COMPRESSORS = ["*.compressor.wkv", "*wgate"]  # the attention's and the indexer's compressors
INDEXER = ["*.indexer.wq_b", "*.indexer.weights_proj"]
EXPERTS = ["*.mlp.experts"]
EVERY_TARGET = ATTENTION + ["*.self_attn.wo_a"] + COMPRESSORS + INDEXER + EXPERTS


def lora_pair(config_overrides: dict, peft: PeftConfig, seed: int):
    """(built-in, plugin) with the same base weights and the same random adapters."""
    torch.manual_seed(seed)
    builtin = DeepseekV4ForCausalLM(tiny_config(**config_overrides), backend=backend())
    builtin.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    randomize_(builtin, seed=seed + 1)
    plugin = build_plugin(tiny_config(**config_overrides))
    plugin.load_state_dict(builtin.state_dict(), strict=True)
    counts = [apply_lora_to_linear_modules(model, peft) for model in (builtin, plugin)]
    assert counts[0] == counts[1] > 0, counts
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in builtin.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    adapters = {k: v for k, v in builtin.state_dict().items() if "lora_" in k}
    missing, unexpected = plugin.load_state_dict(adapters, strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]
    return builtin, plugin


def assert_same_adapter_run(builtin, plugin, seed: int) -> dict:
    assert adapter_names(builtin) == adapter_names(plugin)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    result = compare(builtin.eval(), plugin.eval(), {"input_ids": ids}, torch.ones(2, SEQ, dtype=torch.bool))
    assert result["decided"] > 0
    assert all(v for k, v in result.items() if k.startswith("topk_equal")), result
    assert result["logits_rel"] <= RTOL, result
    probe = torch.randn(2, SEQ, VOCAB, generator=gen)
    ref, got = adapter_gradients(builtin, ids, probe), adapter_gradients(plugin, ids, probe)
    assert ref.keys() == got.keys() == set(adapter_names(builtin))  # nothing else trains
    worst, compared = 0.0, 0
    for name, g in ref.items():
        if g is None or not g.any():  # e.g. the indexer's (selection only) and MTP's (not in the loss)
            assert got[name] is None or not got[name].any(), name
            continue
        compared += 1
        worst = max(worst, rel(got[name], g))
        assert rel(got[name], g) <= RTOL, f"{name}: rel {rel(got[name], g):.3g}"
    return {**result, "adapter_grads_compared": compared, "adapter_grad_worst_rel": worst}


def test_lora_on_every_projection_matches_the_builtin():
    peft = PeftConfig(target_modules=EVERY_TARGET, dim=4, alpha=8, use_memory_efficient_lora=False)
    builtin, plugin = lora_pair({"o_groups": 1}, peft, seed=20)
    names = adapter_names(plugin)
    for target in ("self_attn.wo_a.", "self_attn.compressor.wkv.", "indexer.wgate.", "indexer.weights_proj.",
                   "mlp.experts.lora_"):  # fmt: skip
        assert any(target in n for n in names), target
    result = assert_same_adapter_run(builtin, plugin, seed=21)
    print("every projection", result)
    assert result["adapter_grads_compared"] > 20


def test_lora_with_peft_defaults_matches_the_builtin_on_the_release_layout():
    # o_groups 2 as in the release; PEFT's memory-efficient LoRA; every target but wo_a (see module docstring).
    peft = PeftConfig(target_modules=ATTENTION + COMPRESSORS + INDEXER + EXPERTS, dim=4, alpha=8)
    builtin, plugin = lora_pair({}, peft, seed=30)
    result = assert_same_adapter_run(builtin, plugin, seed=31)
    print("release layout", result)


@pytest.mark.parametrize("dropout_position", ["pre", "post"])
def test_grouped_output_projection_adapter_is_its_effective_weight(dropout_position):
    gen = torch.Generator().manual_seed(40)
    groups, per_group_in, out = 3, 8, 12
    layer = GroupedLinear(per_group_in, out, groups)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
    patch_linear_module(layer, dim=2, alpha=6, dropout=0.0, dropout_position=dropout_position, use_triton=False)
    assert isinstance(layer, GroupedLinear) and layer.lora_A.weight.shape == (2, per_group_in)
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=gen))
    x = torch.randn(2, 5, groups * per_group_in, generator=gen, requires_grad=True)
    twist = torch.randn(groups * per_group_in, generator=gen)

    def transform(t):
        return t * twist

    effective = GroupedLinear(per_group_in, out, groups)
    with torch.no_grad():
        effective.weight.copy_(layer.materialize_effective_weight())
    for fn in (None, transform):
        got = layer(x, fn) if fn is not None else layer(x)
        ref = effective.reference(x if fn is None else fn(x))
        assert rel(got, ref) < 1e-6
        probe = torch.randn(got.shape, generator=gen)
        (g_got,) = torch.autograd.grad((got * probe).sum(), x)
        (g_ref,) = torch.autograd.grad((ref * probe).sum(), x)
        assert rel(g_got, g_ref) < 1e-6
    # Adapter gradients against the same map written with the adapter's tensors directly.
    a, b = layer.lora_A.weight, layer.lora_B.weight
    weight = layer.weight + layer.scale * (b @ a)
    ref = torch.einsum("...gi,goi->...go", x.unflatten(-1, (groups, per_group_in)),
                       weight.view(groups, out // groups, per_group_in)).flatten(-2)  # fmt: skip
    probe = torch.randn(ref.shape, generator=gen)
    ref_grads = torch.autograd.grad((ref * probe).sum(), (a, b))
    got_grads = torch.autograd.grad((layer(x) * probe).sum(), (a, b))
    for g_got, g_ref in zip(got_grads, ref_grads):
        assert rel(g_got, g_ref) < 1e-6


def test_grouped_output_projection_refuses_dora():
    layer = GroupedLinear(4, 6, 2)
    patch_linear_module(layer, dim=2, alpha=4, use_dora=True, use_triton=False)
    with pytest.raises(ValueError, match="DoRA"):
        layer(torch.randn(1, 3, 8))


def test_only_adapters_train_and_the_run_saves_and_reloads_adapters_only(tmp_path):
    peft = PeftConfig(target_modules=EVERY_TARGET, dim=4, alpha=8)
    torch.manual_seed(50)
    plugin = build_plugin(tiny_config())
    plugin.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    randomize_(plugin, seed=51)
    apply_lora_to_linear_modules(plugin, peft)
    trainable = sorted(n for n, p in plugin.named_parameters() if p.requires_grad)
    assert trainable == adapter_names(plugin) and trainable
    before = {k: v.clone() for k, v in plugin.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in plugin.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(52)
    plugin.train()
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 64), generator=gen)
        logits = plugin(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    after = plugin.state_dict()
    changed = sorted(k for k in after if not torch.equal(after[k], before[k]))
    assert changed and all("lora_" in k for k in changed), [k for k in changed if "lora_" not in k]
    # lora_B starts at zero: after two steps every attention adapter moved, also the grouped wo_a's.
    assert any("self_attn.wo_a.lora_B" in k for k in changed)

    # nemo-automodel's own PEFT checkpoint: adapters only, and they come back exactly.
    checkpointer = Checkpointer(
        CheckpointingConfig(checkpoint_dir=str(tmp_path), is_peft=True, model_repo_id="tiny-v4"),
        dp_rank=0, tp_rank=0, pp_rank=0,
    )  # fmt: skip
    checkpointer.save_model(plugin, str(tmp_path / "step_2"), peft_config=peft)
    saved = tmp_path / "step_2" / "model" / "adapter_model.safetensors"
    with safe_open(str(saved), framework="pt") as f:
        keys = list(f.keys())
    assert len(keys) == len(trainable) and all(".lora_" in k for k in keys)
    assert not [f for f in os.listdir(saved.parent) if f.endswith(".safetensors") and f != saved.name]

    torch.manual_seed(53)
    fresh = build_plugin(tiny_config())
    fresh.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    fresh.load_state_dict({k: v for k, v in before.items() if "lora_" not in k}, strict=False)
    apply_lora_to_linear_modules(fresh, peft)
    checkpointer.load_model(fresh, str(saved.parent))
    reloaded = fresh.state_dict()
    assert reloaded.keys() == after.keys()
    for key in after:
        assert torch.equal(reloaded[key], after[key]), key


def test_train_ft_lora_example_trains_and_saves_adapters_only(cpu_automodel, tmp_path):
    """examples/automodel/deepseek_v4_plugin_tiny_lora.yaml through nemo-automodel's train_ft
    recipe on CPU: two steps from the tiny released-layout checkpoint, then its PEFT checkpoint."""
    import json
    import math

    from nemo_automodel.components.config.loader import load_yaml_config
    from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction

    from nemo_dsa.integrations.deepseek_v4 import NemoDsaDeepseekV4ForCausalLM
    from _support.automodel_examples import EXAMPLES, load_writer

    checkpoint = load_writer().write_tiny_v4_checkpoint(tmp_path / "pretrained", seed=3)
    cfg = load_yaml_config(str(EXAMPLES / "deepseek_v4_plugin_tiny_lora.yaml"))
    for key, value in {
        "model.pretrained_model_name_or_path": str(checkpoint), "step_scheduler.max_steps": 2,
        "step_scheduler.val_every_steps": 2, "step_scheduler.ckpt_every_steps": 2,
        "checkpoint.checkpoint_dir": str(tmp_path / "run"), "dist_env.backend": "gloo",
        "dataset.max_examples": 32, "validation_dataset.max_examples": 4,
    }.items():  # fmt: skip
        cfg.set_by_dotted(key, value)
    recipe = TrainFinetuneRecipeForNextTokenPrediction(cfg)
    try:
        recipe.setup()
        model = recipe.model_parts[0]
        assert isinstance(model, NemoDsaDeepseekV4ForCausalLM)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        recipe.run_train_validation_loop()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    records = [json.loads(line) for line in (tmp_path / "run" / "training.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and all(math.isfinite(r["loss"]) for r in records)
    moved = sorted(n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach()))
    assert moved and all("lora_" in n for n in moved), [n for n in moved if "lora_" not in n]
    for target in ("self_attn.wq_a.lora_", "self_attn.wo_a.lora_", "mlp.experts.lora_"):
        assert any(target in n for n in moved), target
    (saved,) = (tmp_path / "run").glob("epoch_*_step_1/model/adapter_model.safetensors")
    with safe_open(str(saved), framework="pt") as f:
        keys = list(f.keys())
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(keys) == len(adapters) and all(".lora_" in k for k in keys)
    assert not [f for f in saved.parent.rglob("*.safetensors") if f != saved]
