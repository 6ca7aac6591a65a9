"""The V4.1 plugin attention's public contract, checked against the built-in on the same weights.

A layer of ``NemoDsaDeepseekV41Attention`` built from the built-in's ``(config, layer_idx,
backend)`` and called on its own reads like ``DeepseekV41Attention``: ``rotary_emb`` gives the
same angles; the state it hands on exposes ``compressed_kv``, ``index_keys``, ``topk_indices``,
``compressed_valid``, ``candidates`` and ``compression_ratio`` with the built-in's values; a layer
with nothing new to hand on returns the state it received; and the mistakes the built-in refuses
are refused with messages the built-in's callers match.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel.components.models.deepseek_v41.attention import DeepseekV41Attention, DeepseekV41AttentionState
from _support.tiny_released_v41 import RATIOS, ROLES, backend, hf_config

from nemo_dsa.integrations.deepseek_v41.attention import NemoDsaDeepseekV41Attention


def stacks(config=None):
    """Every layer of ``config`` twice, the built-in's and the plugin's, holding the same random weights."""
    config = config or hf_config()
    builtins, plugins = [], []
    for layer_idx in range(len(RATIOS)):
        builtin = DeepseekV41Attention(config, layer_idx, backend())
        gen = torch.Generator().manual_seed(300 + layer_idx)
        with torch.no_grad():
            for name, p in builtin.named_parameters():
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * (0.5 if p.ndim == 1 else 0.2))
        plugin = NemoDsaDeepseekV41Attention(config, layer_idx, backend())
        plugin.load_state_dict(builtin.state_dict(), strict=True)
        builtins.append(builtin)
        plugins.append(plugin)
    return builtins, plugins


def run(layers, hidden, mask):
    """Each layer on the previous one's state (not its output: every layer sees ``hidden``)."""
    state, outs, states = DeepseekV41AttentionState(), [], []
    for layer in layers:
        out = layer(hidden, position_ids=torch.arange(hidden.shape[1])[None], state=state, attention_mask=mask)
        state = out.state
        outs.append(out.hidden_states)
        states.append(state)
    return outs, states


@pytest.mark.parametrize("rows,length,real", [(2, 40, 29), (3, 23, 17), (1, 9, 9)])
def test_state_fields_and_outputs_match_the_builtin(rows, length, real):
    builtins, plugins = stacks()
    gen = torch.Generator().manual_seed(rows * 100 + length)
    hidden = torch.randn(rows, length, hidden_size := hf_config().hidden_size, generator=gen)
    assert hidden_size == 64
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[-1, real:] = 0
    expected, expected_states = run(builtins, hidden, mask)
    actual, states = run(plugins, hidden, mask)
    for layer_idx, (mine, ref, state, ref_state) in enumerate(zip(actual, expected, states, expected_states)):
        role = ROLES[layer_idx]
        torch.testing.assert_close(mine, ref, atol=2e-5, rtol=2e-4, msg=lambda m: f"layer {layer_idx} ({role}): {m}")
        assert state.compression_ratio == ref_state.compression_ratio, layer_idx
        for name in ("compressed_kv", "compressed_valid", "index_keys", "topk_indices", "candidates"):
            mine_field, ref_field = getattr(state, name), getattr(ref_state, name)
            if ref_field is None or (name == "candidates" and ref_field.numel() == 0):
                continue
            assert mine_field is not None, (layer_idx, name)
            # Groups holding padding are never attended: their values are free.
            if name in ("compressed_kv", "index_keys"):
                valid = ref_state.compressed_valid
                torch.testing.assert_close(state.compressed_valid, valid, atol=0, rtol=0)
                mine_field, ref_field = mine_field[valid], ref_field[valid]
            if name in ("topk_indices", "candidates"):  # padding queries attend nothing: what they select is free
                mine_field, ref_field = mine_field[mask.bool()], ref_field[mask.bool()]
            tol = dict(atol=0, rtol=0) if mine_field.dtype in (torch.bool, torch.int64) else dict(atol=2e-5, rtol=2e-4)
            torch.testing.assert_close(mine_field, ref_field, **tol, msg=lambda m: f"layer {layer_idx} {name}: {m}")


def test_layers_with_nothing_new_hand_on_the_state_they_received():
    _, plugins = stacks()
    hidden = torch.randn(1, 16, 64)
    _, states = run(plugins, hidden, None)
    for layer_idx, role in enumerate(ROLES):
        if role in ("window", "reuse") and layer_idx > 0:
            assert states[layer_idx] is states[layer_idx - 1], (layer_idx, role)
        elif role == "reindex":
            assert states[layer_idx].compressed_kv is states[layer_idx - 1].compressed_kv
            assert states[layer_idx].topk_indices is not states[layer_idx - 1].topk_indices
    reindex_after_candidates = [i for i, r in enumerate(ROLES) if r == "reindex" and RATIOS[i] == 1]
    for i in reindex_after_candidates:  # one candidates tensor per forward, read through any later state
        assert states[i].candidates is states[i - 1].candidates


@pytest.mark.parametrize("layer_idx", [0, 1, 4])
def test_rotary_emb_gives_the_builtin_angles(layer_idx):
    config = hf_config()
    builtin = DeepseekV41Attention(config, layer_idx, backend())
    plugin = NemoDsaDeepseekV41Attention(config, layer_idx, backend())
    assert (plugin.rotary_emb.dim, plugin.rotary_emb.theta) == (builtin.rotary_emb.dim, builtin.rotary_emb.theta)
    positions = torch.tensor([[0, 1, 7, 63, 64, 255], [3, 5, 8, 100, 200, 250]])
    # One fp32 rounding apart at most: nemo_dsa forms the frequencies in fp64, the built-in in fp32.
    torch.testing.assert_close(plugin.rotary_emb(positions), builtin.rotary_emb(positions), atol=0, rtol=4e-7)
    assert not list(plugin.rotary_emb.parameters()) and not list(plugin.rotary_emb.buffers())


BOTH = pytest.mark.parametrize("cls", [DeepseekV41Attention, NemoDsaDeepseekV41Attention], ids=["builtin", "plugin"])


@BOTH
def test_a_consumer_without_its_source_is_refused(cls):
    config = hf_config()
    reuse = cls(config, ROLES.index("reuse"), backend())
    with pytest.raises(ValueError, match="preceding Full layer with the same compression ratio"):
        reuse(torch.randn(1, 8, 64), position_ids=torch.arange(8)[None], state=DeepseekV41AttentionState())


@BOTH
@pytest.mark.parametrize("rows,length", [(2, 12), (1, 10)])
def test_a_state_from_another_batch_or_ratio_is_refused(cls, rows, length):
    config = hf_config()
    source, reuse = cls(config, 1, backend()), cls(config, 2, backend())
    out = source(torch.randn(1, 12, 64), position_ids=torch.arange(12)[None], state=DeepseekV41AttentionState())
    with pytest.raises(ValueError, match="different batch or sequence"):
        reuse(torch.randn(rows, length, 64), position_ids=torch.arange(length)[None], state=out.state)
    with pytest.raises(ValueError, match="same compression ratio"):
        reuse(torch.randn(1, 12, 64), position_ids=torch.arange(12)[None],
              state=dataclasses.replace(out.state, compression_ratio=1))  # fmt: skip


@BOTH
@pytest.mark.parametrize(
    "positions,mask,words",
    [
        ([[0, 1, 2, 0, 1, 2]], None, "zero-based"),
        ([[1, 2, 3, 4, 5, 6]], None, "zero-based"),
        ([[0, 1, 2, 3, 4, 5]], [[0, 1, 1, 1, 1, 1]], "right padding"),
        ([[0, 1, 2, 3, 4, 5]], [[1, 1, 2, 1, 0, 0]], "zero and one"),
        ([[0, 1, 2, 3, 4, 5]], [[1, 1, 1]], "attention_mask must have shape"),
    ],
)
def test_layouts_the_builtin_refuses_are_refused(cls, positions, mask, words):
    layer = cls(hf_config(), 1, backend())
    kwargs = {} if mask is None else {"attention_mask": torch.tensor(mask)}
    with pytest.raises(ValueError, match=words):
        layer(torch.randn(1, 6, 64), position_ids=torch.tensor(positions), state=DeepseekV41AttentionState(), **kwargs)


@BOTH
@pytest.mark.parametrize(
    "change,dropout,words",
    [
        ({"attn": "te"}, 0.0, "eager.*sdpa"),
        ({"attn": "tilelang"}, 0.25, "attention_dropout=0"),
        ({"linear": "te"}, 0.0, "torch linear"),
        ({"rms_norm": "torch"}, 0.0, "torch_fp32"),
    ],
)
def test_backends_the_builtin_refuses_are_refused(cls, change, dropout, words):
    config = hf_config()
    config.attention_dropout = dropout
    with pytest.raises(ValueError, match=words):
        cls(config, 1, dataclasses.replace(backend(), **change))
