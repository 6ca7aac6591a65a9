"""The public ops' remaining unchecked inputs, each refused (or honoured) where it enters: caller
ranges for ``select_topk``, the logits' dtype of ``pytorch_extract_topk_scores``, a window longer
than ``raw_kv``, an ``allowed`` wider than the keys, a meta-device ``q``."""

from __future__ import annotations

import pytest
import torch

from _support.bounded import PRINT_PEAK, run_python
from _support.helpers import error_v41_inputs, full_visibility
from nemo_dsa.ops.sparse_attention import sparse_window_attention
from nemo_dsa.ops.topk import pytorch_extract_topk_scores, select_topk
from nemo_dsa.ops.v41_indexer import indexer_scores


# ---- select_topk: the caller's ks / ke must lie in the row (the kernel reads [ks, ke)) -----------

@pytest.mark.parametrize("ks, ke, message", [
    (-7, 5, r"ks must be >= 0, got minimum -7"),
    (0, 99, r"ke must be <= the number of keys 5, got maximum 99"),
    (-7, 99, r"ks must be >= 0"),
])
def test_select_topk_refuses_ranges_outside_the_row(ks, ke, message):
    scores = torch.randn(2, 3, 5)
    ks_t = torch.full((2, 3), ks, dtype=torch.int32)
    ke_t = torch.full((2, 3), ke, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        select_topk(scores, 2, ks=ks_t, ke=ke_t)


def test_select_topk_still_takes_an_empty_range():
    scores = torch.randn(1, 2, 5)
    ks = torch.tensor([[3, 0]], dtype=torch.int32)
    ke = torch.tensor([[1, 5]], dtype=torch.int32)  # ks >= ke: the row selects nothing
    out = select_topk(scores, 2, ks=ks, ke=ke)
    assert out[0, 0].tolist() == [-1, -1] and (out[0, 1] >= 0).all()


# ---- pytorch_extract_topk_scores: floating logits only -------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_extract_topk_scores_refuses_non_floating_logits(dtype):
    logits = torch.zeros(2, 5, dtype=dtype)
    with pytest.raises(TypeError, match="logits must have dtype"):
        pytorch_extract_topk_scores(logits, torch.zeros(2, 2, dtype=torch.int32))


# ---- sparse_window_attention: a window past raw_kv allocates nothing for it ----------------------

def test_a_window_longer_than_raw_kv_attends_as_raw_kvs_length():
    g = torch.Generator().manual_seed(0)
    q, raw_kv = torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 6, 8, generator=g)
    start = torch.zeros(1, 4, dtype=torch.int32)
    exact = sparse_window_attention(q, raw_kv, start, 6, scale=0.3)
    huge = sparse_window_attention(q, raw_kv, start, 2**31 - 1, scale=0.3)
    assert torch.equal(exact[0], huge[0]) and torch.equal(exact[1], huge[1])


def test_a_huge_window_stays_under_a_gibibyte():
    code = """
import torch
from nemo_dsa.ops.sparse_attention import sparse_window_attention
q, raw_kv = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 8)
sparse_window_attention(q, raw_kv, torch.zeros(1, 4, dtype=torch.int32), 2**26, scale=0.3)
""" + PRINT_PEAK
    outcome = run_python(code)
    assert outcome.returncode == 0, outcome.stderr[-2000:]
    assert outcome.peak_bytes < 1 << 30, outcome.peak_bytes


# ---- indexer_scores: allowed may be wider than K; a meta q is named as q -------------------------

def test_indexer_scores_takes_an_allowed_wider_than_the_keys():
    queries, keys, weights = error_v41_inputs()
    batch, seq, num_keys = queries.shape[0], queries.shape[1], keys.shape[1]
    allowed = torch.rand(batch, seq, num_keys, generator=torch.Generator().manual_seed(1)) < 0.5
    wider = torch.cat((allowed, torch.ones(batch, seq, 3, dtype=torch.bool)), dim=-1)
    assert torch.equal(indexer_scores(queries, keys, weights, wider), indexer_scores(queries, keys, weights, allowed))


def test_a_meta_q_is_named_as_q():
    queries, keys, weights = error_v41_inputs()
    ks, ke = full_visibility(queries.shape[0], queries.shape[1], keys.shape[1])
    with pytest.raises(ValueError, match="queries must hold data, got a tensor on the meta device"):
        indexer_scores(queries.to("meta"), keys, weights, ks=ks, ke=ke)
