"""NemoDsaDeepseekV4ForCausalLM against nemo-automodel's built-in DeepseekV4ForCausalLM (CPU, fp32).

Both models hold the same random weights (the plugin loads the built-in's state dict under the
same names). The tiny config has the release's settings: YaRN on the compressed layers
(compress_rope_theta 160000), a grouped output projection (o_groups 2), hc_mult 4, four routed
experts with a shared one and a hash-routed first layer, ratios 0 / 4 / 128 and one MTP layer.
Index heads and top-k are chosen so no score tie decides a selection; the tests assert it.

What must agree: logits (rel 1e-5) and the ratio-4 top-k sets on unpacked rows and on THD packs
whose documents start on multiples of 4 (and of 128 where a document holds a whole ratio-128
group), every parameter's gradient (rel 1e-5) with the indexer frozen as the built-in trains it.
Where the built-in is wrong (a document starting off a multiple of the ratio), the test shows
its causality leak and that the plugin has none.
"""

from __future__ import annotations

import copy
import importlib.metadata

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel._transformers.registry import ModelRegistry
from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v4 import layers as builtin_layers
from nemo_automodel.components.models.deepseek_v4 import model as builtin_model
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

from _support.v4_builtin_and_plugin import models  # noqa: F401 (a fixture)
from _support.v4_builtin_and_plugin import (RTOL, SEQ, VOCAB, assert_gradients_match, backend, build_plugin, compare,
                                           gradients, hc_floor, randomize_, rel, thd_batch, tiny_config)
from nemo_dsa.integrations.deepseek_v4 import ARCHITECTURE, NemoDsaDeepseekV4ForCausalLM
from nemo_dsa.integrations.deepseek_v4.attention import NemoDsaDeepseekV4Attention


# --------------------------------------------------------------------------------------------
# structure and registration
# --------------------------------------------------------------------------------------------


def test_entry_point_and_registry():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="nemo_automodel.architectures")}
    assert eps[ARCHITECTURE].value == "nemo_dsa.integrations.deepseek_v4:NemoDsaDeepseekV4ForCausalLM"
    assert ModelRegistry.has_custom_model(ARCHITECTURE)  # False would mean the module failed to import
    config = tiny_config(architectures=[ARCHITECTURE])
    assert ModelRegistry.resolve_custom_model_cls(ARCHITECTURE, config) is NemoDsaDeepseekV4ForCausalLM
    assert not NemoDsaDeepseekV4ForCausalLM.supports_config(tiny_config(vision_n_layers=1))


def test_same_parameters_as_the_builtin(models):
    builtin, plugin = models
    assert isinstance(plugin, DeepseekV4ForCausalLM) and plugin.config.architectures == [ARCHITECTURE]
    ref = {k: (v.shape, v.dtype) for k, v in builtin.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in plugin.state_dict().items()} == ref
    attentions = [m for m in plugin.modules() if isinstance(m, builtin_layers.DeepseekV4Attention)]
    assert not attentions, "a built-in attention module survived"
    replaced = [m for m in plugin.modules() if isinstance(m, NemoDsaDeepseekV4Attention)]
    assert len(replaced) == 4  # three main layers and the MTP layer
    # The built-in's parallelizer and state-dict adapter are the plugin's (the adapter's class
    # extended only by the strict loading's check of the tensors it converts).
    assert plugin.parallelizer is builtin.parallelizer
    adapter_class = type(builtin.state_dict_adapter)
    assert type(plugin.state_dict_adapter).__mro__[2:] == adapter_class.__mro__


def test_no_builtin_attention_code_on_the_compute_path(models, monkeypatch):
    _, plugin = models

    def forbidden(*args, **kwargs):
        raise AssertionError("the built-in's attention code ran")

    for module, name in [
        (builtin_layers, "eager_attention_with_sink"), (builtin_layers, "dsv4_indexer_scores"),
        (builtin_layers, "dsv4_sparse_attention"), (builtin_layers, "build_dsv4_sparse_topk_indices"),
        (builtin_layers, "_build_indexer_topk_compressed_mask"), (builtin_layers, "_pool_windows"),
        (builtin_model, "build_causal_padding_mask"), (builtin_model, "build_packed_causal_padding_mask"),
        (builtin_model, "build_packed_seq_ids"),
    ]:  # fmt: skip
        monkeypatch.setattr(module, name, forbidden)
    for cls in (builtin_layers.DeepseekV4Attention, builtin_layers.DeepseekV4Compressor, builtin_layers.DeepseekV4Indexer):
        monkeypatch.setattr(cls, "forward", forbidden)
    batch, _ = thd_batch([100, 92, 96], [100, 92, 96], seed=3)
    plugin.train()
    try:
        out = plugin(**batch)
        (out.logits.sum() + out.mtp_per_depth_h[0].sum()).backward()
    finally:
        plugin.eval()
        plugin.zero_grad(set_to_none=True)


def test_vision_inputs_are_an_error(models):
    _, plugin = models
    with pytest.raises(ValueError, match="vision inputs"):
        plugin(torch.zeros(1, 8, dtype=torch.long), pixel_values=torch.zeros(1))


# --------------------------------------------------------------------------------------------
# forward parity
# --------------------------------------------------------------------------------------------


def test_logits_and_topk_match_on_unpacked_rows(models):
    builtin, plugin = models
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    result = compare(builtin, plugin, {"input_ids": ids}, torch.ones(2, SEQ, dtype=torch.bool))
    print("unpacked", result)
    assert result["decided"] > 0
    assert all(v for k, v in result.items() if k.startswith("topk_equal")), result
    assert result["logits_rel"] <= RTOL, result


def test_logits_and_topk_match_on_aligned_packs(models):
    # Documents start at 0, 256, 356, 420 (multiples of 4); the only ones holding a whole
    # ratio-128 group start on a multiple of 128. The last document's span ends in padding.
    builtin, plugin = models
    batch, valid = thd_batch([256, 100, 64, 80], [256, 100, 64, 92], seed=4)
    result = compare(builtin, plugin, batch, valid)
    print("packed", result)
    assert result["decided"] > 0
    assert all(v for k, v in result.items() if k.startswith("topk_equal")), result
    assert result["logits_rel"] <= RTOL, result


# --------------------------------------------------------------------------------------------
# gradient parity
# --------------------------------------------------------------------------------------------


def test_gradients_match_on_unpacked_rows_with_mtp(models):
    builtin, plugin = models
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    probes = [torch.randn(2, SEQ, VOCAB, generator=gen), torch.randn(2, SEQ, 64, generator=gen)]
    batch = {"input_ids": ids}
    ref = gradients(builtin, batch, probes)
    floor = hc_floor(builtin, batch, probes, ref)
    got = gradients(plugin, batch, probes)
    assert all(ref[n] is None for n in ref if "compressor.indexer." in n)  # frozen in both
    print("unpacked grads worst rel", assert_gradients_match(ref, got, floor))


def test_gradients_match_on_aligned_packs(models):
    # The built-in's MTP ignores the pack's documents (its MTP mask is one causal row), so the
    # packed comparison differentiates the main logits only.
    builtin, plugin = models
    batch, valid = thd_batch([256, 100, 64, 80], [256, 100, 64, 92], seed=6)
    probe = torch.randn(*valid.shape, VOCAB, generator=torch.Generator().manual_seed(7)) * valid.unsqueeze(-1)
    ref = gradients(builtin, batch, [probe])
    floor = hc_floor(builtin, batch, [probe], ref)
    got = gradients(plugin, batch, [probe])
    print("packed grads worst rel", assert_gradients_match(ref, got, floor))


# --------------------------------------------------------------------------------------------
# the documented difference: the built-in's causality leak on unaligned packs
# --------------------------------------------------------------------------------------------


def test_unaligned_documents_leak_in_the_builtin_not_in_the_plugin(models):
    # Document 2 starts at token 10 (not a multiple of 4). The built-in numbers its ratio-4
    # groups from the document-local position, so query 13 (local 3) sees the group of global
    # tokens 12..15: changing token 15 changes its output. The plugin's query 13 sees nothing
    # after itself.
    builtin, plugin = models
    batch, _ = thd_batch([10, 278], [10, 278], seed=8)
    later = 15
    perturbed = {**batch, "input_ids": batch["input_ids"].clone()}
    perturbed["input_ids"][0, later] = (perturbed["input_ids"][0, later] + 1) % VOCAB
    with torch.no_grad():
        ref_change = (builtin(**perturbed).logits - builtin(**batch).logits)[0, :later].abs().amax(-1)
        plugin_change = (plugin(**perturbed).logits - plugin(**batch).logits)[0, :later].abs().amax(-1)
    print("built-in change before the perturbed token", ref_change.tolist())
    assert ref_change[10:later].max() > 1e-3  # the leak: earlier outputs of document 2 moved
    assert plugin_change.max() == 0, plugin_change


# --------------------------------------------------------------------------------------------
# nemo_dsa options
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("through", ["keyword", "config"])
def test_scoring_v41_switches_the_indexer(models, through):
    _, plugin = models
    config = tiny_config(scoring="v41") if through == "config" else tiny_config()
    v41 = build_plugin(config, **({"scoring": "v41"} if through == "keyword" else {}))
    v41.load_state_dict(plugin.state_dict(), strict=True)
    assert v41.dsa_config.scoring == "v41" and plugin.dsa_config.scoring == "v4"
    indexer = {n: p for n, p in v41.named_parameters() if "compressor.indexer." in n}
    assert indexer and not any(p.requires_grad for p in indexer.values())  # V4.1's indexer is frozen
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(9))
    selections = {}
    hooks = [
        m.model.layers["1"].self_attn.core.indexer.register_forward_hook(
            lambda mod, args, out, key=key: selections.__setitem__(key, out.topk_indices)
        )
        for key, m in (("v4", plugin), ("v41", v41))
    ]
    try:
        with torch.no_grad():
            out = v41.eval()(ids).logits
            plugin(ids)
    finally:
        for h in hooks:
            h.remove()
    assert torch.isfinite(out).all()
    v41_rows = selections["v41"][0, -1]
    kept = v41_rows[v41_rows >= 0]
    assert torch.equal(kept, kept.sort().values)  # V4.1 lists its selection by key index
    assert not torch.equal(selections["v41"], selections["v4"])


def test_backend_and_option_keywords():
    model = build_plugin(tiny_config(), indexer_kl_coef=0.5, indexer_straight_through=True)
    assert model.dsa_config.indexer_kl_coef == 0.5 and model.dsa_config.indexer_straight_through
    assert model.dsa_config.backend == "auto"  # backend.attn "sdpa" leaves the indexer kernels on auto
    torch_backend = NemoDsaDeepseekV4ForCausalLM(tiny_config(), backend=BackendConfig(attn="torch", experts="torch_mm",
                                                                                          dispatcher="torch"))  # fmt: skip
    assert torch_backend.dsa_config.backend == "torch"
    assert torch_backend.dsa_config.attention_backend == "torch"  # backend.attn selects both kernels
    assert model.dsa_config.attention_backend is None  # unset: the attention follows the indexer's choice
    split = build_plugin(tiny_config(), indexer_backend="torch", attention_backend="tilelang")
    assert (split.dsa_config.backend, split.dsa_config.attention_backend) == ("torch", "tilelang")
    layer = split.model.layers["1"].self_attn.core
    assert layer.config.attention_backend == "tilelang" and layer.indexer.backend == "torch"
    from_config = build_plugin(tiny_config(attention_backend="torch"))
    assert from_config.dsa_config.attention_backend == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        build_plugin(tiny_config(), attention_backend="cuda")
    with pytest.raises(TypeError, match="DeepseekV4Config"):
        NemoDsaDeepseekV4ForCausalLM({"model_type": "deepseek_v4"})


@pytest.mark.parametrize("loss_reads", ["logits", "hidden_states"])
def test_indexer_kl_loss_reaches_only_the_indexer(models, loss_reads):
    # With indexer_kl_coef the module's KL loss rides on the final hidden state into the backward
    # (zero in the forward) and trains the indexer alone, whether the trainer's loss reads the
    # logits or, as fused linear cross-entropy does, the hidden states.
    builtin, plugin = models
    kl = build_plugin(tiny_config(), indexer_kl_coef=1.0)
    kl.load_state_dict(plugin.state_dict(), strict=True)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(14))
    kl.train()
    out = kl(ids, output_hidden_states=True)
    assert out.indexer_aux_loss is not None and out.indexer_aux_loss > 0
    with torch.no_grad():
        torch.testing.assert_close(out.logits, plugin(ids).logits, rtol=0, atol=0)
    getattr(out, loss_reads).sum().mul(0).backward()  # only the attached KL term has a gradient
    grads = {n: p.grad for n, p in kl.named_parameters()}
    assert any(g is not None and g.any() for n, g in grads.items() if "compressor.indexer." in n)
    assert all(g is None or not g.any() for n, g in grads.items() if "compressor.indexer." not in n)


def test_mtp_loss_runs_in_a_bf16_model_with_the_fp32_lm_head(models):
    """nemo-automodel keeps DeepSeek's lm_head in fp32 (``_keep_in_fp32_modules_strict``) and its
    MTP loss applies that head to ``mtp_per_depth_h`` directly: the plugin hands the MTP states
    over in the head's dtype, so a bf16 model trains with MTP; 0.7.0's built-in stops with a
    dtype mismatch there (shown, so the difference is deliberate)."""
    from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy
    from nemo_automodel.components.loss.mtp import calculate_mtp_loss

    builtin_fp32, plugin_fp32 = models
    batch, _ = thd_batch([60, 44], [64, 48], seed=11)
    labels = torch.roll(batch["input_ids"], shifts=-1, dims=-1)
    for model, fails in ((plugin_fp32, False), (builtin_fp32, True)):
        model = copy.deepcopy(model).to(torch.bfloat16)
        with torch.no_grad():  # bf16 except what nemo-automodel keeps in fp32, as its loader does
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if any(kept in name for kept in model._keep_in_fp32_modules_strict):
                    tensor.data = tensor.data.float()
        model.train()
        out = model(**batch)
        if fails:
            with pytest.raises(RuntimeError, match="same dtype"):
                calculate_mtp_loss(MaskedCrossEntropy(), mtp_per_depth_h=out.mtp_per_depth_h, labels=labels, model=model)
            continue
        assert all(h.dtype == torch.float32 for h in out.mtp_per_depth_h)
        loss = calculate_mtp_loss(MaskedCrossEntropy(), mtp_per_depth_h=out.mtp_per_depth_h, labels=labels, model=model)
        loss.backward()
        assert torch.isfinite(loss) and loss > 0
        assert model.lm_head.weight.grad is not None and torch.isfinite(model.lm_head.weight.grad).all()
        assert model.mtp.layers[0].self_attn.core.wq_b.weight.grad.abs().sum() > 0


def test_tilelang_attention_in_a_fp32_model_is_one_clear_error(models):
    """backend.attn tilelang on an fp32 model: the error names the layer and the config fix
    (model.dtype: bfloat16 or attention_backend auto), raised before any compute; found running
    nemo-automodel's train_ft on the H200, where the op's own message named only q's dtype."""
    builtin, _ = models
    plugin = build_plugin(tiny_config(), attention_backend="tilelang", indexer_backend="torch")
    plugin.load_state_dict(builtin.state_dict(), strict=True)
    batch, _ = thd_batch([40, 24], [40, 24], seed=5)
    with pytest.raises(TypeError, match=r"layer 0: attention_backend 'tilelang'.*model\.dtype: bfloat16.*auto"):
        plugin.eval()(**batch)


def test_yarn_spelled_rope_type_applies_in_the_plugin_only(models):
    """``rope_scaling`` naming YaRN under transformers' key ``rope_type`` (not ``type``): the built-in
    reads only ``type`` and silently rotates without YaRN (its logits are those of
    ``rope_scaling=None``); the plugin applies YaRN (its logits are the built-in's with ``type``)."""
    builtin, _ = models
    yarn = {key: value for key, value in tiny_config().rope_scaling.items() if key != "type"}
    spelled = tiny_config(rope_scaling={"rope_type": "yarn", **yarn})
    weights = builtin.state_dict()

    def built(config, make):
        model = make(config)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
        return model.eval()

    def builtin_model(config):
        model = DeepseekV4ForCausalLM(config, backend=backend())
        model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
        return model

    ids = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        with_yarn = builtin(ids).logits
        builtin_spelled = built(spelled, builtin_model)(ids).logits
        without_yarn = built(tiny_config(rope_scaling=None), builtin_model)(ids).logits
        plugin_spelled = built(spelled, build_plugin)(ids).logits
    assert rel(with_yarn, without_yarn) > 1e-3  # YaRN moves these logits
    assert torch.equal(builtin_spelled, without_yarn)  # the built-in skipped it
    assert rel(plugin_spelled, with_yarn) <= RTOL, rel(plugin_spelled, with_yarn)  # the plugin applied it


def test_configs_beyond_the_kernels_shapes_match_the_builtin():
    """What the built-in accepts runs: an index head dim that is no multiple of 16 (the kernels'
    step) and num_key_value_heads = 2 (the built-in never reads it: one shared KV head). Same
    weights, same logits; the ignored field is said in the log."""
    import logging

    config = tiny_config(index_head_dim=24, index_n_heads=12, num_key_value_heads=2)
    torch.manual_seed(0)
    builtin = DeepseekV4ForCausalLM(config, backend=backend())
    builtin.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    randomize_(builtin, seed=3)
    plugin = build_plugin(config)
    assert plugin.dsa_config.index_head_dim == 24 and plugin.dsa_config.index_n_heads == 12
    plugin.load_state_dict(builtin.state_dict(), strict=True)
    ids = torch.randint(0, VOCAB, (2, 160), generator=torch.Generator().manual_seed(4))
    result = compare(builtin.eval(), plugin.eval(), {"input_ids": ids}, torch.ones(2, 160, dtype=torch.bool))
    assert all(v for k, v in result.items() if k.startswith("topk_equal")), result
    assert result["logits_rel"] <= RTOL, result
