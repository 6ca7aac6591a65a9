"""The plugins' attention weights (HF's ``output_attentions``) against nemo-automodel's built-in.

The built-in V4 attention returns its dense probabilities ``[B, H, S, S + K]`` on every backend but
TileLang (its eager path: the sequence's tokens, then the pooled keys; the sink's share left out).
A plugin layer called on its own returns the same, from nemo_dsa's reference attention, and
``output_attentions`` decides when given; inside the plugin model no probabilities are computed
(the blocks drop them). Checked on the same weights (fp32, CPU): a window, a ratio-4 (every
visible group selected, so no top-k tie can differ) and a ratio-128 layer on rows, weights and
outputs within fp32 order; the V4.1 layer returns them only when asked, zero outside each
query's window and selection, and the same output as without them.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
from nemo_automodel.components.models.deepseek_v4.layers import (
    DeepseekV4Attention,
    DeepseekV4RotaryEmbedding,
    build_causal_padding_mask,
)
from nemo_automodel.components.models.deepseek_v41.attention import DeepseekV41AttentionState

from nemo_dsa.integrations import NemoDsaDeepseekV4Attention, NemoDsaDeepseekV4ForCausalLM
from nemo_dsa.integrations.deepseek_v41.attention import NemoDsaDeepseekV41Attention
from nemo_dsa.layers.sparse_attention import DSASparseAttention

RATIOS = [0, 4, 128]
ROWS, SEQ = 2, 136  # 34 ratio-4 groups, one ratio-128 group
WINDOW = 8


def v4_config() -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(RATIOS),
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32,
        o_lora_rank=16, o_groups=2, compress_ratios=list(RATIOS), sliding_window=WINDOW, index_n_heads=4,
        index_head_dim=32, index_topk=64, rope_theta=10000.0, compress_rope_theta=160000.0,
        max_position_embeddings=256, num_hash_layers=0, num_nextn_predict_layers=0, n_routed_experts=2, num_experts_per_tok=1,
        torch_dtype="float32",
    )  # fmt: skip


def backend(attn: str = "eager") -> BackendConfig:
    return BackendConfig(attn=attn, linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                         enable_hf_state_dict_adapter=False, dispatcher="torch", experts="torch_mm")  # fmt: skip


def randomize_(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # fresh values everywhere, sinks and position biases included
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * (0.5 if p.ndim == 1 else 0.15))


def builtin_inputs(config, hidden):
    factor = config.qk_rope_head_dim / config.head_dim
    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    main = DeepseekV4RotaryEmbedding(config.rope_theta, config.head_dim, factor)
    compress = DeepseekV4RotaryEmbedding(config.compress_rope_theta, config.head_dim, factor,
                                         rope_scaling=config.rope_scaling)  # fmt: skip
    mask = build_causal_padding_mask(None, hidden.shape[1], hidden.dtype, hidden.device, batch_size=hidden.shape[0],
                                     sliding_window=config.sliding_window)  # fmt: skip
    return {"position_embeddings": main(hidden, positions), "position_embeddings_compress": compress(hidden, positions),
            "rotary_compress": compress, "attention_mask": mask}  # fmt: skip


@pytest.mark.parametrize("layer_idx", range(len(RATIOS)), ids=[f"ratio{r}" for r in RATIOS])
def test_v4_layer_returns_the_builtins_weights(layer_idx):
    config = v4_config()
    builtin = DeepseekV4Attention(config, layer_idx, backend()).eval()
    randomize_(builtin, 10 + layer_idx)
    plugin = NemoDsaDeepseekV4Attention(config, layer_idx, backend()).eval()
    plugin.load_state_dict(builtin.state_dict(), strict=True)
    hidden = torch.randn(ROWS, SEQ, config.hidden_size, generator=torch.Generator().manual_seed(layer_idx))
    kwargs = builtin_inputs(config, hidden)
    with torch.no_grad():
        ref_out, ref_weights = builtin(hidden, **kwargs)
        out, weights = plugin(hidden, **kwargs)
        out_asked, weights_asked = plugin(hidden, **kwargs, output_attentions=True)
        out_declined, weights_declined = plugin(hidden, **kwargs, output_attentions=False)
    pooled = SEQ // RATIOS[layer_idx] if RATIOS[layer_idx] else 0
    assert ref_weights.shape == weights.shape == (ROWS, config.num_attention_heads, SEQ, SEQ + pooled)
    assert weights.dtype == ref_weights.dtype
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=2e-6)
    assert torch.equal(weights[ref_weights == 0], torch.zeros_like(weights[ref_weights == 0]))  # the same keys seen
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    assert torch.equal(weights_asked, weights) and torch.equal(out_asked, out)
    assert weights_declined is None and torch.equal(out_declined, out)  # the default path's output


def test_no_probabilities_on_tilelang_or_inside_the_model(monkeypatch):
    """The built-in's TileLang path returns none, and the plugin model's forward computes none."""
    def refuse(*args, **kwargs):
        raise AssertionError("probabilities computed without being asked for")

    config = v4_config()
    assert not NemoDsaDeepseekV4Attention(config, 1, backend("tilelang"))._wants_weights(None, standalone=True)
    assert NemoDsaDeepseekV4Attention(config, 1, backend("tilelang"))._wants_weights(True, standalone=False)
    monkeypatch.setattr(DSASparseAttention, "_attend_with_probabilities", refuse)
    torch.manual_seed(0)
    model = NemoDsaDeepseekV4ForCausalLM(config, backend=backend())
    ids = torch.randint(0, config.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert model(ids).logits.shape == (ROWS, SEQ, config.vocab_size)


def test_v41_layer_returns_weights_only_when_asked():
    from _support.tiny_released_v41 import backend as v41_backend, hf_config

    config = hf_config()
    layer = NemoDsaDeepseekV41Attention(config, 1, v41_backend()).eval()  # ratio-2 kv and index source
    randomize_(layer, 7)
    seq, real = 48, 40
    hidden = torch.randn(2, seq, config.hidden_size, generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[1, real:] = 0
    inputs = {"position_ids": torch.arange(seq).expand(2, -1), "attention_mask": mask}
    with torch.no_grad():
        plain = layer(hidden, state=DeepseekV41AttentionState(), **inputs)
        asked = layer(hidden, state=DeepseekV41AttentionState(), output_attentions=True, **inputs)
    assert plain.attentions is None
    torch.testing.assert_close(asked.hidden_states, plain.hidden_states, rtol=1e-6, atol=1e-7)
    weights = asked.attentions
    groups = seq // 2
    assert weights.shape == (2, config.num_attention_heads, seq, seq + groups)
    token = torch.arange(seq)
    window = (token[None] <= token[:, None]) & (token[None] > token[:, None] - config.sliding_window)
    assert not weights[..., :seq][:, :, ~window].any()  # no key outside the causal window
    assert not weights[1, :, :, real:seq].any() and not weights[1, :, real:].any()  # padding: never seen, sees nothing
    topk = asked.state.topk_indices
    chosen = torch.zeros(2, seq, groups + 1, dtype=torch.bool).scatter_(-1, torch.where(topk >= 0, topk, groups), True)
    chosen = chosen[..., :groups]  # (-1 slots went to the spare column)
    assert not weights[..., seq:][~chosen.unsqueeze(1).expand_as(weights[..., seq:])].any()  # only selected groups
    sums = weights.sum(-1)[0]
    assert ((sums > 0) & (sums < 1)).all()  # the sink keeps the rest
