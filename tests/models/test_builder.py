"""Hydra composition of every model x scoring option, the scoring switch, config errors."""

from __future__ import annotations

import shutil

import pytest
import torch
from hydra.errors import HydraException
from hydra.utils import instantiate

from nemo_dsa.builder import build_model, build_model_config, config_dir, load_config_node
from nemo_dsa.layers.indexer import Indexer
from nemo_dsa.models.dsa_lm.layer_roles import derive_v41_layer_roles, indexer_layers
from nemo_dsa.train import load_config

MODELS = ("tiny", "small", "v4_flash")
SCORINGS = ("v4", "v41")


def _roles(model) -> dict[int, str]:
    return {i: layer.attn.role for i, layer in enumerate(model.layers)}


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("model_name", MODELS)
def test_every_model_and_scoring_composes_and_builds(model_name, scoring):
    cfg = load_config([f"model={model_name}", f"scoring={scoring}", "model.device=meta"])
    model = instantiate(cfg.model)
    config = model.config
    assert config.scoring == scoring and model.preset_name == model_name
    assert all(p.device.type == "meta" for p in model.parameters())
    ratio4 = indexer_layers(config.compress_ratios)
    assert ratio4, "every preset has indexer layers"
    indexers = [m for m in model.modules() if isinstance(m, Indexer)]
    assert indexers and all(ix.scoring == scoring for ix in indexers)
    roles = _roles(model)
    if scoring == "v4":  # every indexer layer owns its keys and selects
        assert [i for i, r in roles.items() if r == "source"] == ratio4 and len(indexers) == len(ratio4)
    else:  # configs/scoring/v41.yaml: every 2nd indexer layer owns keys, every one selects
        assert config.kv_source_layer_ids == tuple(ratio4[::2])
        assert config.index_source_layer_ids == tuple(ratio4)
        assert config.candidate_source_layer_id == ratio4[0]
        assert {roles[i] for i in ratio4} <= {"source", "reindex"} and len(indexers) == len(ratio4)
        h = config.index_n_heads
        assert h & (h - 1) == 0 and config.index_head_dim % 32 == 0


def test_v4_flash_shapes_follow_deepseek_v4():
    cfg = load_config(["model=v4_flash"]).model.config
    assert (cfg.sliding_window, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (128, 64, 128, 512)
    assert (cfg.qk_rope_head_dim, cfg.head_dim, cfg.q_lora_rank) == (64, 512, 1024)
    assert cfg.num_hidden_layers == len(cfg.compress_ratios) == 43
    assert (cfg.o_lora_rank, cfg.o_groups, cfg.rope_theta, cfg.compress_rope_theta) == (1024, 8, 10000.0, 160000.0)
    assert cfg.rope_scaling == {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                "beta_fast": 32, "beta_slow": 1}


def test_scoring_override_flips_every_indexer_layer_of_a_real_model():
    v4 = instantiate(load_config([]).model)
    v41 = instantiate(load_config(["scoring=v41"]).model)
    assert {ix.scoring for ix in v4.modules() if isinstance(ix, Indexer)} == {"v4"}
    assert {ix.scoring for ix in v41.modules() if isinstance(ix, Indexer)} == {"v41"}
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    for model in (v4, v41):
        logits = model(input_ids=ids).logits
        assert logits.shape == (2, 24, 259) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.config.index_topk=0"], "index_topk"),
        (["model.config.compress_ratios=[0,4]"], "compress_ratios"),
        (["+model.config.index_topk_typo=3"], "index_topk_typo"),
        (["scoring.scoring=v5"], "scoring.scoring"),
        (["+scoring.bogus=1"], "bogus"),
        (["scoring=v41", "scoring.layer_roles.kv_source_every=0"], "scoring.layer_roles.kv_source_every"),
        (["scoring=v41", "scoring.layer_roles.candidate_source=last"], "candidate_source"),
        (["scoring=v41", "scoring.candidate_block_size=0"], "scoring.candidate_block_size"),
        (["scoring=v41", "+model.config.kv_source_layer_ids=[3]"], "kv_source_layer_ids"),
        (["model.dtype=float16"], "model.dtype"),
        (["model.config.hidden_size=0"], "hidden_size"),
        (["model.config.num_attention_heads=0"], "num_attention_heads"),
        (["+model.config.scoring=v41"], "scoring"),  # the scoring group decides; a clash is an error
    ],
)
def test_config_errors_name_the_key(overrides, match):
    cfg = load_config(["model.device=meta", *overrides])
    with pytest.raises((ValueError, TypeError, HydraException), match=match):
        instantiate(cfg.model)


def test_unknown_scoring_option_fails_at_composition():
    with pytest.raises(HydraException, match="scoring"):
        load_config(["scoring=v5"])


def test_config_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_DSA_CONFIG_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="NEMO_DSA_CONFIG_DIR"):
        config_dir()
    monkeypatch.delenv("NEMO_DSA_CONFIG_DIR")
    copy = tmp_path / "configs"
    shutil.copytree(config_dir(), copy)
    tiny = copy / "model" / "tiny.yaml"
    tiny.write_text(tiny.read_text().replace("index_topk: 8", "index_topk: 5"))
    monkeypatch.setenv("NEMO_DSA_CONFIG_DIR", str(copy))
    assert config_dir() == copy
    assert load_config([]).model.config.index_topk == 5


def test_derive_v41_layer_roles():
    ratios = (0, 4, 16, 4, 0, 4, 4, 128, 4)
    assert derive_v41_layer_roles(ratios, kv_source_every=2, index_source_every=1, candidate_source="first") == (
        (1, 5, 8), (1, 3, 5, 6, 8), 1)
    assert derive_v41_layer_roles(ratios, kv_source_every=3, index_source_every=2, candidate_source="none") == (
        (1, 6), (1, 5, 6, 8), -1)
    # Explicit ids in the model config win over the derived schedule.
    cfg = build_model_config({"kv_source_layer_ids": [1, 3]}, {"scoring": "v41", "layer_roles": {"kv_source_every": 2}})
    assert cfg.kv_source_layer_ids == (1, 3) and cfg.index_source_layer_ids is None


def test_build_model_seed_is_reproducible_and_keeps_global_rng():
    torch.manual_seed(7)
    before = torch.get_rng_state()
    a = build_model({}, "v4", seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    b = build_model({}, "v4", seed=3)
    c = build_model({}, "v4", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_load_config_node():
    assert load_config_node("scoring", "v41")["scoring"] == "v41"
    with pytest.raises(ValueError, match=r"model='huge'.*tiny"):
        load_config_node("model", "huge")


def _indexer_selections(model, batch) -> dict[int, tuple[torch.Tensor, object]]:
    """``{layer: (topk_indices [B,S,T], metadata)}`` of every indexer layer of one forward."""
    found, hooks = {}, []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.attn.indexer, Indexer):
            def hook(module, args, output, i=i):
                found[i] = (output.topk_indices, args[3])  # args: x, query_latent, angles, meta, keys
            hooks.append(layer.attn.indexer.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(**{k: batch[k] for k in ("input_ids", "position_ids", "seq_lens", "seq_lens_padded",
                                           "packed_seq_ids", "attention_mask")})  # fmt: skip
    finally:
        for h in hooks:
            h.remove()
    return found


def test_v4_and_v41_scoring_on_the_same_weights_select_visible_groups():
    """One set of weights, scored the V4 way and the V4.1 way (every indexer layer its own keys):
    both select exactly the visible groups' top-k, and mostly the same ones."""
    from nemo_dsa.data import build_streams

    config = load_config_node("model", "tiny")["config"]
    v41_scoring = {"scoring": "v41", "layer_roles": {"kv_source_every": 1, "candidate_source": "none"}}
    v4, v41 = build_model(config, "v4", seed=1).eval(), build_model(config, v41_scoring, seed=1).eval()
    v41.load_state_dict(v4.state_dict())
    batch = next(build_streams(seq_len=96, batch_size=2, seed=1, val_batches=0, modules=("json",))[0])
    sel4, sel41 = _indexer_selections(v4, batch), _indexer_selections(v41, batch)
    assert sorted(sel4) == sorted(sel41) == indexer_layers(v4.config.compress_ratios)
    overlaps = []
    for layer in sel4:
        (idx4, meta), (idx41, _) = sel4[layer], sel41[layer]
        for b in range(2):
            for i in range(96):
                ks, ke = int(meta.ks[b, i]), int(meta.ke[b, i])
                a = {int(j) for j in idx4[b, i] if j >= 0}
                c = {int(j) for j in idx41[b, i] if j >= 0}
                want = min(v4.config.index_topk, ke - ks)
                assert len(a) == len(c) == want and all(ks <= j < ke for j in a | c)
                if ke - ks > v4.config.index_topk:
                    overlaps.append(len(a & c) / want)
    assert overlaps and sum(overlaps) / len(overlaps) > 0.5  # rounding changes a few picks, not most
