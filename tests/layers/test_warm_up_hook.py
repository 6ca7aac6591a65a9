"""The attention layer asks ``ops.warm_up`` for the builds of its own shapes (on CPU: the warm-up
and the backend choice are replaced by recorders; the GPU side is
tests/models/test_no_compile_after_warm_up_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import tiny_config
from nemo_dsa.layers import sparse_attention
from nemo_dsa.layers.sparse_attention import DSASparseAttention
from nemo_dsa.ops.warm_up import model_builds


def _warmed(monkeypatch, config, layer_idx, *, attention, indexer_backend="tilelang"):
    calls = []
    monkeypatch.setattr(sparse_attention, "warm_up", calls.append)
    monkeypatch.setattr(sparse_attention, "resolve_backend", lambda backend, *tensors, **kw: indexer_backend)
    layer = DSASparseAttention(config, layer_idx)
    q = torch.randn(1, 5, config.num_attention_heads, config.head_dim)
    layer._warm_up_kernels(q, attention=attention)
    return calls


@pytest.mark.parametrize("attention", [True, False])
def test_v4_indexer_layer_warms_its_selection_and_attention(monkeypatch, attention):
    config = tiny_config(index_topk=300)
    calls = _warmed(monkeypatch, config, 1, attention=attention)  # layer 1: ratio 4, an indexer
    assert calls == [model_builds("v4", 300, config.head_dim, attention=attention)]
    assert len(calls[0].selections) == 1 and len(calls[0].attention) == (4 if attention else 0)


def test_v41_masked_layers_warm_both_selects_per_mask(monkeypatch):
    config = tiny_config(scoring="v41", kv_source_layer_ids=(1,), index_source_layer_ids=(1, 3), index_topk=4,
                         candidate_source_layer_id=1, candidate_block_size=2, candidate_topk_blocks=2)
    calls = _warmed(monkeypatch, config, 3, attention=True)
    assert calls == [model_builds("v41", 4, config.head_dim, 2)]
    assert len(calls[0].selections) == 4  # vector and radix select, unmasked and in blocks of 2


def test_layers_without_kernels_warm_nothing(monkeypatch):
    config = tiny_config()
    assert _warmed(monkeypatch, config, 0, attention=False) == []  # window-only layer, reference attention
    assert _warmed(monkeypatch, config, 1, attention=False, indexer_backend="torch") == []
    window_only = _warmed(monkeypatch, config, 0, attention=True)
    assert window_only == [model_builds("v4", config.index_topk, config.head_dim, selections=False)]


def test_a_layer_names_its_builds_once(monkeypatch):
    calls = []
    monkeypatch.setattr(sparse_attention, "warm_up", calls.append)
    monkeypatch.setattr(sparse_attention, "resolve_backend", lambda backend, *tensors, **kw: "tilelang")
    config = tiny_config()
    layer = DSASparseAttention(config, 1)
    q = torch.randn(1, 5, config.num_attention_heads, config.head_dim)
    for _ in range(3):
        layer._warm_up_kernels(q, attention=True)
    layer._warm_up_kernels(q, attention=False)  # another choice of backends: its own set
    assert [bool(b.attention) for b in calls] == [True, False]
