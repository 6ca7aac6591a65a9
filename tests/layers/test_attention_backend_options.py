"""The attention's kernel choice (``attention_backend``) through nemo-automodel's wrapper config."""

from __future__ import annotations

import pytest

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel.components.models.common.utils import BackendConfig

from nemo_dsa.integrations import automodel as integ

TINY = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=2, head_dim=32, qk_rope_head_dim=16,
    q_lora_rank=32, intermediate_size=96, compress_ratios=[0, 4, 8], sliding_window=8,
    index_n_heads=4, index_head_dim=32, index_topk=3,
)  # fmt: skip


@pytest.mark.parametrize(
    "config_value, backend, expected",
    [
        (None, None, None),  # unset: follows the indexer's backend
        ("torch", None, "torch"),
        ("tilelang", BackendConfig(), "tilelang"),  # BackendConfig's default attn (sdpa) keeps the config's choice
        (None, BackendConfig(attn="torch"), "torch"),  # backend.attn names the attention kernels
        ("auto", {"attn": "tilelang"}, "tilelang"),
    ],
)
def test_wrapper_attention_backend(config_value, backend, expected):
    config = integ.NemoDsaV4Config(**TINY, attention_backend=config_value)
    model = integ.NemoDsaV4ForCausalLM(config, backend=backend)
    assert model.dsa_config.attention_backend == expected
    assert model.layers[1].attn.config.attention_backend == expected
    assert config.attention_backend == config_value  # the transformers config is left alone


def test_wrapper_attention_backend_is_checked():
    with pytest.raises(ValueError, match="attention_backend"):
        integ.NemoDsaV4Config(**TINY, attention_backend="flash")
