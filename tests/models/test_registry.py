"""nemo_dsa.registry: names, lookup, registration."""

from __future__ import annotations

import pytest
import torch

import nemo_dsa.registry as registry
from nemo_dsa.layers.indexer import Indexer

ARCHITECTURES = {"NemoDsaV4ForCausalLM": "v4", "NemoDsaV41ForCausalLM": "v41"}


def test_list_holds_presets_and_architectures():
    names = registry.list()
    assert names == sorted(names)
    for scoring in ("v4", "v41"):
        for size in ("tiny", "small", "flash"):
            assert f"dsa-{scoring}-{size}" in names
    assert set(ARCHITECTURES) <= set(names)


@pytest.mark.parametrize("name,scoring", [*ARCHITECTURES.items(), ("dsa-v41-flash", "v41"), ("dsa-v4-small", "v4")])
def test_get_builds_the_named_model(name, scoring):
    model = registry.get(name)(device="meta")
    assert model.config.scoring == scoring
    assert {ix.scoring for ix in model.modules() if isinstance(ix, Indexer)} == {scoring}


def test_overrides_and_seed_reach_the_model():
    a = registry.build("dsa-v4-tiny", index_topk=3, num_hidden_layers=2, compress_ratios=[4, 0], seed=1)
    b = registry.build("dsa-v4-tiny", index_topk=3, num_hidden_layers=2, compress_ratios=[4, 0], seed=1)
    assert a.config.index_topk == 3 and len(a.layers) == 2
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="index_topk"):
        registry.build("dsa-v4-tiny", device="meta", index_topk=0)


def test_unknown_name_and_duplicate_registration():
    with pytest.raises(ValueError, match="dsa-v5-tiny.*registered names"):
        registry.get("dsa-v5-tiny")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("dsa-v4-tiny")(lambda **kw: None)
    with pytest.raises(TypeError, match="name"):
        registry.register("")


def test_register_custom_builder():
    name = "test-custom-linear"
    try:
        @registry.register(name)
        def build(*, device="cpu", **kwargs):
            return torch.nn.Linear(2, 3, device=device)

        assert name in registry.list() and registry.get(name) is build
        assert registry.build(name, device="meta").weight.device.type == "meta"
        registry.register(name, exist_ok=True)(build)  # replacing is explicit
    finally:
        registry._REGISTRY.pop(name, None)
    assert name not in registry.list()
