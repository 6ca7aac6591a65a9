"""The V4 indexer reference (nemo_dsa.ops.v4_indexer.naive) against float64 formulas and autograd."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import dense_visibility, ERROR_SIZES, error_v4_inputs, full_visibility, generator, indexer_inputs, random_ks_ke, random_topk_indices
from nemo_dsa.ops.v41_indexer import v41_scores, v41_scores_chunk_size
from nemo_dsa.ops.v4_indexer import v4_backward, v4_backward_chunk_size, v4_logits, v4_logits_chunk_size

SHAPES = [(1, 7, 1, 16, 5), (2, 33, 4, 32, 9), (3, 50, 8, 48, 13)]  # B, S, H, D, K (ragged)


def _dense_v4(q, k, w, ks, ke):
    logits = (torch.einsum("bshd,btd->bsht", q, k).relu() * w[..., None]).sum(2)
    return logits.masked_fill(~dense_visibility(ks, ke, k.shape[1]), float("-inf"))


def _autograd_grads(q, k, w, ks, ke, idx, grad):
    q, k, w = (x.detach().requires_grad_() for x in (q, k, w))
    logits = _dense_v4(q, k, w, ks, ke)
    present = idx >= 0
    gathered = logits.gather(-1, torch.where(present, idx, 0).long())
    live = present & torch.isfinite(gathered)
    (torch.where(live, gathered, 0.0) * grad).sum().backward()
    return q.grad, k.grad, w.grad


S, B, H, D, K = ERROR_SIZES


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("budget", [None, 1])
def test_v4_logits_match_float64(shape, budget):
    g = generator(sum(shape))
    q, k, w = indexer_inputs(*shape, g)
    ks, ke = random_ks_ke(shape[0], shape[1], shape[4], g)
    kwargs = {} if budget is None else {"budget_bytes": budget}  # budget 1 -> one query per chunk
    out = v4_logits(q, k, w, ks, ke, **kwargs)
    assert out.dtype == torch.float32
    dots = torch.einsum("bshd,btd->bsht", q.double(), k.double())
    ref = (dots.relu() * w.double()[..., None]).sum(2)
    scale = (dots.abs() * w.double().abs()[..., None]).sum(2)  # condition of the sum
    mask = dense_visibility(ks, ke, shape[4])
    assert torch.equal(torch.isinf(out), ~mask) and bool((out[~mask] < 0).all())
    err = (out.double() - ref).abs()[mask]
    assert bool((err <= 1e-5 * scale[mask] + 1e-30).all()), float((err / scale[mask]).max())


def test_chunk_sizes_bound_the_full_size_intermediates():
    s, k, h, d, t, budget = 16384, 4096, 64, 128, 2048, 256 * 2**20
    chunk = v4_logits_chunk_size(s, h, k, budget)
    assert 1 <= chunk < s and chunk * h * k * 4 <= budget < (chunk + 1) * h * k * 4
    chunk = v4_backward_chunk_size(s, h, t, d, budget)
    assert 1 <= chunk < s and chunk * (2 * t * d + 3 * h * t) * 8 <= budget
    chunk = v41_scores_chunk_size(1, s, h, k, budget)
    assert 1 <= chunk < s and chunk * h * k * 2 * 3 <= budget
    assert v4_logits_chunk_size(5, h, k, 1) == 1  # never below one query
    assert v4_logits_chunk_size(5, 1, 1, budget) == 5  # never above S


@pytest.mark.parametrize("shape", SHAPES)
def test_v4_backward_matches_autograd_float64(shape):
    b, s, h, d, k = shape
    g = generator(100 + s)
    q, keys, w = (x.double() for x in indexer_inputs(b, s, h, d, k, g))
    ks, ke = random_ks_ke(b, s, k, g)
    t = min(4, k)
    idx = random_topk_indices(b, s, t, k, g)
    grad = torch.randn(b, s, t, generator=g, dtype=torch.float64)
    got = v4_backward(q, keys, w, ks, ke, idx, grad, budget_bytes=2000)  # several chunks
    want = _autograd_grads(q, keys, w, ks, ke, idx, grad)
    for a, e in zip(got, want):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    empty = ks == ke
    assert bool((got[0][empty] == 0).all()) and bool((got[2][empty] == 0).all())


def test_v4_backward_dtypes_and_fp32_accuracy():
    b, s, h, d, k = 2, 40, 4, 32, 10
    g = generator(7)
    q, keys, w = indexer_inputs(b, s, h, d, k, g)
    ks, ke = random_ks_ke(b, s, k, g)
    idx = random_topk_indices(b, s, 6, k, g)
    grad = torch.randn(b, s, 6, generator=g)
    dq, dk, dw = v4_backward(q, keys, w, ks, ke, idx, grad)
    assert (dq.dtype, dk.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    want = _autograd_grads(q.double(), keys.double(), w.double(), ks, ke, idx, grad.double())
    torch.testing.assert_close(dw.double(), want[2], rtol=1e-5, atol=1e-6)
    for a, e in ((dq, want[0]), (dk, want[1])):  # one bf16 rounding of an fp32-accurate value
        torch.testing.assert_close(a.double(), e, rtol=2**-8, atol=1e-6)


def test_reference_arguments():
    q, k, w = (x.transpose(0, 1) for x in error_v4_inputs())
    ks, ke = full_visibility(B, S, K)
    with pytest.raises(ValueError, match="k must"):
        v4_logits(q, k[..., :8], w, ks, ke)
    with pytest.raises(ValueError, match="w must"):
        v4_logits(q, k, w[..., :2], ks, ke)
    with pytest.raises(TypeError, match="w must"):
        v41_scores(q, k, w, ks, ke)
    idx = torch.zeros(B, S, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="grad_scores"):
        v4_backward(q, k, w, ks, ke, idx, torch.zeros(B, S, 3))
    with pytest.raises(ValueError, match="topk_indices must lie"):
        v4_backward(q, k, w, ks, ke, idx + K, torch.zeros(B, S, 2))
