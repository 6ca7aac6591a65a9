"""nemo-automodel integration: entry points, AutoConfig, registry build path, train_ft on CPU.

nemo-automodel is a CI dependency (scripts/install.sh installs it lean), so on a CPU machine its
absence is an error, not a skip. The only things patched are nemo-automodel's CUDA-only calls
(``cpu_automodel`` fixture); everything else is the real recipe code.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from pathlib import Path

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
    import transformers  # noqa: F401
    from nemo_automodel._transformers import auto_model  # noqa: F401 (needs torchao, not in the GPU bundle)
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel._transformers.model_capabilities import query_capabilities
from nemo_automodel._transformers.model_init import _resolve_custom_model_cls_for_config
from nemo_automodel._transformers.registry import ModelRegistry
from nemo_automodel.components.datasets.llm.packed_sequence import pack_dataset
from nemo_automodel.components.datasets.utils import default_collater, packed_sequence_thd_collater
from nemo_automodel.components.models.common.utils import BackendConfig
from transformers import AutoConfig

from _support.helpers import cpu_automodel  # noqa: F401 (a fixture)
from nemo_dsa.data import BOS_ID, EOS_ID, ByteTokenizer, split_documents, stdlib_documents
from nemo_dsa.integrations import automodel as integ
from nemo_dsa.integrations.automodel.data import document_examples, stdlib_docstring_dataset
from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig
from nemo_dsa.models.dsa_lm.modeling import DSAForCausalLM

REPO = Path(__file__).resolve().parents[2]
ARCHS = {
    "NemoDsaV4ForCausalLM": (integ.NemoDsaV4Config, integ.NemoDsaV4ForCausalLM, "v4"),
    "NemoDsaV41ForCausalLM": (integ.NemoDsaV41Config, integ.NemoDsaV41ForCausalLM, "v41"),
}
# Small enough for CPU; ratios cover window-only, indexed (4) and dense-compressed (8) layers.
TINY = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=2, head_dim=32, qk_rope_head_dim=16,
    q_lora_rank=32, intermediate_size=96, compress_ratios=[0, 4, 8], sliding_window=8,
    index_n_heads=4, index_head_dim=32, index_topk=3,
)

def packed_batch(max_length: int = 24, pack: int = 64, examples: int = 12) -> dict:
    """A THD batch exactly as train_ft makes it: nemo-automodel's packer + THD collater."""
    rows = pack_dataset(stdlib_docstring_dataset(max_length=max_length, max_examples=examples), split=None,
                        packed_sequence_size=pack)
    return packed_sequence_thd_collater([rows[i] for i in range(min(3, len(rows)))])


# --------------------------------------------------------------------------------------------
# Discovery: entry points, registry, AutoConfig
# --------------------------------------------------------------------------------------------


def test_entry_points_point_at_the_model_classes():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="nemo_automodel.architectures")}
    for name, (_, model_cls, _) in ARCHS.items():
        assert eps[name].value == f"nemo_dsa.integrations.automodel:{name}"
        assert eps[name].load() is model_cls


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_real_registry_discovers_architecture(name):
    # has_custom_model imports the entry point's module: False would mean it failed to import.
    assert ModelRegistry.has_custom_model(name)
    assert ModelRegistry.get_model_cls_from_model_arch(name) is ARCHS[name][1]


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_autoconfig_round_trip(name, tmp_path):
    config_cls, _, scoring = ARCHS[name]
    config = AutoConfig.for_model(config_cls.model_type, **TINY)
    assert type(config) is config_cls and config.architectures == [name]
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is config_cls
    dsa = loaded.to_dsa_config()
    assert dsa == DSAModelConfig(scoring=scoring, **{**TINY, "compress_ratios": tuple(TINY["compress_ratios"])})
    # every DSAModelConfig field is readable under its own name, backend included
    for field in DSAModelConfig.__dataclass_fields__:
        assert getattr(loaded, field) == getattr(dsa, field), field


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="index_topk"):
        integ.NemoDsaV4Config(index_topk=0)
    assert integ.NemoDsaV41Config(index_n_heads=3).index_n_heads == 3  # the reference takes any count
    with pytest.raises(ValueError, match="index_n_heads"):  # the kernels do not: asked by name, an error
        integ.NemoDsaV41Config(index_n_heads=3, backend="tilelang")
    with pytest.raises(ValueError, match="scoring"):
        integ.NemoDsaV4Config(scoring="v41")
    with pytest.raises(TypeError, match="DSAModelConfig"):
        integ.NemoDsaV4Config.from_dsa_config({"scoring": "v4"})
    with pytest.raises(TypeError, match="NemoDsaV41Config"):
        integ.NemoDsaV41ForCausalLM(integ.NemoDsaV4Config(**TINY))


def test_from_dsa_config_and_supports_config():
    dsa = DSAModelConfig(scoring="v41", **{**TINY, "backend": "torch"})
    config = integ.NemoDsaV41Config.from_dsa_config(dsa)
    assert config.indexer_backend == "torch" and config.to_dsa_config() == dsa
    assert integ.NemoDsaV41ForCausalLM.supports_config(config)
    assert not integ.NemoDsaV4ForCausalLM.supports_config(config)
    with pytest.raises(ValueError, match="scoring"):
        integ.NemoDsaV4Config.from_dsa_config(dsa)


def test_capabilities_declared():
    caps = query_capabilities(integ.NemoDsaV41Config(**TINY))
    assert caps.supports_thd and caps.supports_cp and not caps.supports_tp and not caps.supports_pp


def test_cp_hook_returns_a_contiguous_sharder():
    from nemo_automodel.components.distributed.context_parallel.sharder import ContextParallelSharder

    model = integ.NemoDsaV41ForCausalLM(integ.NemoDsaV41Config(**TINY))
    assert model._owns_cp_attention
    hook = model.prepare_model_inputs_for_cp({}, num_chunks=1)
    assert isinstance(hook["cp_sharder"], ContextParallelSharder)
    with pytest.raises(ValueError, match="num_chunks"):
        model.prepare_model_inputs_for_cp({}, num_chunks=2)


@pytest.mark.parametrize(
    "backend, expected",
    [(None, "auto"), (BackendConfig(attn="torch"), "torch"), ({"attn": "tilelang"}, "tilelang"),
     (BackendConfig(), "auto")],  # BackendConfig's default attn (sdpa) keeps the config's choice
)
def test_backend_maps_only_attn(backend, expected):
    model = integ.NemoDsaV4ForCausalLM(integ.NemoDsaV4Config(**TINY), backend=backend, moe_config=object())
    assert model.dsa_config.backend == expected
    assert model.config.indexer_backend == "auto"  # the transformers config is left alone


# --------------------------------------------------------------------------------------------
# Building through nemo-automodel (registry -> model_init -> meta device -> initialize_weights)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_from_config_builds_and_matches_plain_model(name, cpu_automodel):
    from nemo_automodel import NeMoAutoModelForCausalLM

    config_cls, model_cls, _ = ARCHS[name]
    config = config_cls(**TINY)
    assert _resolve_custom_model_cls_for_config(config) is model_cls  # the path from_config takes
    torch.manual_seed(0)
    model = NeMoAutoModelForCausalLM.from_config(config, dtype=torch.float32, backend={"attn": "torch"})
    assert isinstance(model, model_cls) and model.supports.is_custom_model
    assert model.supports.supports_sequence_packing
    # `backend` reached the constructor (as a BackendConfig), not the transformers config
    assert isinstance(model.backend, BackendConfig) and model.config.indexer_backend == "auto"
    assert model.dsa_config.backend == "torch"
    params = dict(model.named_parameters())
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params.values())
    assert all(torch.isfinite(p).all() for p in params.values())

    # Same weights in nemo_dsa's own class give the same logits: the wrapper adds nothing.
    plain = DSAForCausalLM(model.dsa_config)
    plain.load_state_dict(model.state_dict())
    for batch in (packed_batch(), default_collater(stdlib_docstring_dataset(max_length=24, max_examples=3))):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = model(**inputs)
        assert out.logits.shape == (*batch["input_ids"].shape, config.vocab_size)
        assert torch.isfinite(out.logits).all()
        torch.testing.assert_close(out.logits, plain(**inputs).logits, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_initialize_weights_rewrites_poisoned_parameters(name):
    config_cls, model_cls, _ = ARCHS[name]
    model = model_cls(config_cls(**TINY))
    results = []
    for seed in (3, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))  # what to_empty() may hand out
        torch.manual_seed(seed)
        model.initialize_weights(dtype=torch.float32)
        results.append({k: v.clone() for k, v in model.state_dict().items()})
        assert all(torch.isfinite(v).all() for v in results[-1].values())
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=0, atol=0)
    model.initialize_weights(dtype=torch.bfloat16)
    # Everything is bf16 except what the release keeps fp32 (sinks, compressors' wkv/wgate/ape).
    from nemo_dsa.layers.fp32_parameters import fp32_parameter_names

    keep = fp32_parameter_names(model)
    assert keep and any(".compressor.ape" in n for n in keep) and any(n.endswith("attn_sink") for n in keep)
    assert {n for n, p in model.named_parameters() if p.dtype == torch.float32} == keep
    assert {p.dtype for n, p in model.named_parameters() if n not in keep} == {torch.bfloat16}


def test_initialize_weights_recomputes_buffers(monkeypatch):
    # The layers register no buffer today; give RMSNorm one to check that materialised garbage
    # in any buffer (RoPE tables tomorrow) is replaced by the value a fresh build computes.
    from nemo_dsa.layers import norm

    original_init = norm.RMSNorm.__init__

    def init_with_buffer(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.register_buffer("probe", torch.arange(4.0) + 0.5, persistent=False)

    monkeypatch.setattr(norm.RMSNorm, "__init__", init_with_buffer)
    model = integ.NemoDsaV4ForCausalLM(integ.NemoDsaV4Config(**TINY))
    buffers = dict(model.named_buffers())
    assert buffers
    for buf in buffers.values():
        buf.fill_(float("nan"))
    model.initialize_weights()
    for buf in model.buffers():
        torch.testing.assert_close(buf, torch.arange(4.0) + 0.5, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Dataset for train_ft
# --------------------------------------------------------------------------------------------


def test_document_examples_shift_and_chunk():
    ids = list(range(10, 33))  # 23 tokens -> chunks of 10, 10, 3
    examples = document_examples(ids, max_length=10)
    assert [len(e["input_ids"]) for e in examples] == [10, 10, 3]
    assert sum((e["input_ids"] for e in examples), []) == ids
    for e in examples:
        assert e["labels"] == e["input_ids"][1:] + [-100]
        assert e["attention_mask"] == [1] * len(e["input_ids"])
    assert len(document_examples(list(range(11)), max_length=10)) == 1  # 1-token tail dropped
    with pytest.raises(ValueError, match="max_length"):
        document_examples(ids, max_length=1)


def test_stdlib_dataset_splits_and_limits():
    train = stdlib_docstring_dataset("train", max_length=32, max_examples=50)
    val = stdlib_docstring_dataset("validation", max_length=32)
    assert len(train) == 50 and len(val) > 0
    assert train[0]["input_ids"][0] == BOS_ID
    assert all(2 <= len(e["input_ids"]) <= 32 for e in train + val)
    assert any(e["input_ids"][-1] == EOS_ID for e in train)
    # exactly the validation documents of nemo_dsa.data's split, in order, cut into examples
    _, val_docs = split_documents(stdlib_documents(), 5)
    expected = []
    for doc in val_docs:
        ids = ByteTokenizer().encode(doc.text)
        expected += ids[:-1] if len(ids) % 32 == 1 else ids  # a 1-token tail has no label
    assert sum((e["input_ids"] for e in val), []) == expected
    with pytest.raises(ValueError, match="split"):
        stdlib_docstring_dataset("test")


# --------------------------------------------------------------------------------------------
# The train_ft recipe, two steps on CPU, with the example YAML
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "yaml_name, arch",
    [("nemo_dsa_v41_tiny.yaml", "NemoDsaV41ForCausalLM"), ("nemo_dsa_v4_tiny.yaml", "NemoDsaV4ForCausalLM")],
)
def test_train_ft_two_steps_on_cpu(yaml_name, arch, cpu_automodel, tmp_path):
    from nemo_automodel.components.config.loader import load_yaml_config
    from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction

    cfg = load_yaml_config(str(REPO / "examples" / "automodel" / yaml_name))
    for key, value in {
        "step_scheduler.max_steps": 2, "step_scheduler.val_every_steps": 2,
        "checkpoint.enabled": True, "step_scheduler.ckpt_every_steps": 2,
        "checkpoint.checkpoint_dir": str(tmp_path), "dist_env.backend": "gloo",
        "dataset.max_examples": 32, "validation_dataset.max_examples": 4,
    }.items():
        cfg.set_by_dotted(key, value)
    if arch == "NemoDsaV4ForCausalLM":
        # The recipe's loss is its own CE on the logits (no KL term), and the V4 indexer gets no LM
        # gradient by default (as in the release): the opt-in straight-through term trains it here.
        cfg.set_by_dotted("model.config.indexer_straight_through", True)
    recipe = TrainFinetuneRecipeForNextTokenPrediction(cfg)
    try:
        recipe.setup()
        model = recipe.model_parts[0]
        assert isinstance(model, ARCHS[arch][1])
        batch = next(iter(recipe.dataloader))
        assert batch["qkv_format"] == "thd" and (batch["seq_lens"] > 0).sum() > batch["input_ids"].shape[0]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        recipe.run_train_validation_loop()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    records = [json.loads(line) for line in (tmp_path / "training.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    assert abs(records[0]["loss"] - math.log(259)) < 0.3  # per-token mean CE of a fresh model: ~uniform
    val = [json.loads(line) for line in (tmp_path / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in val] == [1] and math.isfinite(val[0]["val_loss"])  # padded (non-THD) batches
    for name, p in model.named_parameters():
        changed = not torch.equal(before[name], p.detach())
        assert changed == p.requires_grad, name  # trained params moved, frozen ones (V4.1 indexer) did not

    # The consolidated HF checkpoint the recipe wrote (DeepSeek-V4 key names, config.json with
    # our model_type) loads back through nemo-automodel's from_pretrained into the same weights.
    from nemo_automodel import NeMoAutoModelForCausalLM

    (consolidated,) = tmp_path.glob("epoch_*_step_1/model/consolidated")
    assert json.loads((consolidated / "config.json").read_text())["architectures"] == [arch]
    reloaded = NeMoAutoModelForCausalLM.from_pretrained(str(consolidated), dtype=torch.float32)
    assert isinstance(reloaded, ARCHS[arch][1])
    trained = model.state_dict()
    assert "layers.1.attn.indexer.wq_b.weight" in trained and set(reloaded.state_dict()) == set(trained)
    for key, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)
