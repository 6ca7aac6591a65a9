"""The public seed APIs on CPU: layouts, defaults, selection, gradients and the backend seam."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import nemo_dsa
from causal_layouts import random_ks_ke
from nemo_dsa.ops.topk import select_topk_reference
from nemo_dsa.ops.v4_indexer import V4IndexerFunction, pytorch_extract_topk_scores, v4_indexer_bshd, v4_lighting_indexer, v4_logits
from nemo_dsa.ops.v41_indexer import indexer_scores


def _v4_inputs(s, b, h, d, k, seed, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, h, d, generator=g).bfloat16()
    key = torch.randn(k, b, d, generator=g).bfloat16()
    w = torch.randn(s, b, h, generator=g) * h**-0.5
    return tuple(x.requires_grad_(grad) for x in (q, key, w))


def test_lazy_exports_resolve_to_the_interfaces():
    assert nemo_dsa.v4_lighting_indexer is v4_lighting_indexer
    assert nemo_dsa.V4IndexerFunction is V4IndexerFunction
    assert nemo_dsa.pytorch_extract_topk_scores is pytorch_extract_topk_scores
    assert nemo_dsa.indexer_scores is indexer_scores


def test_interfaces_import_no_tilelang():
    code = (
        "import sys, nemo_dsa.ops.v4_indexer.interface, nemo_dsa.ops.v41_indexer.interface, nemo_dsa.ops.mxfp4.naive;"
        "bad = [m for m in ('tilelang', 'nemo_automodel', 'transformers') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("s,b,h,d,ratio,topk", [(37, 2, 4, 32, 4, 5), (20, 3, 2, 16, 1, 64), (9, 1, 3, 16, 4, 1)])
def test_v4_default_causal_rule_and_selection(s, b, h, d, ratio, topk):
    k = s // ratio + (1 if ratio == 1 else 0)  # K may exceed the causal need (unused keys)
    q, key, w = _v4_inputs(s, b, h, d, k, seed=s)
    score, idx = v4_lighting_indexer(q, key, w, ratio, topk)
    t = min(topk, k)
    assert score.shape == idx.shape == (b, s, t) and score.dtype == torch.float32 and idx.dtype == torch.int32
    i = torch.arange(s)
    ks = torch.zeros(b, s, dtype=torch.int32)
    ke = torch.clamp((i + 1) // ratio, max=k).to(torch.int32).expand(b, s).contiguous()
    logits = v4_logits(q.transpose(0, 1), key.transpose(0, 1), w.transpose(0, 1), ks, ke)
    assert torch.equal(idx, select_topk_reference(logits, topk, order="score"))
    assert torch.equal(score, pytorch_extract_topk_scores(logits, idx))
    seen = (ke - ks).clamp(max=t)  # exactly min(visible, T) entries are real
    assert torch.equal((idx >= 0).sum(-1), seen) and torch.equal(torch.isfinite(score), idx >= 0)
    finite = torch.where(idx >= 0, score, float("-inf"))
    assert bool((finite[..., :-1] >= finite[..., 1:]).all())


def test_v4_explicit_ks_ke_and_given_indices_skip_selection():
    s, b, h, d, k = 24, 2, 4, 32, 11
    q, key, w = _v4_inputs(s, b, h, d, k, seed=1)
    g = torch.Generator().manual_seed(2)
    ks, ke = random_ks_ke(b, s, k, g)
    score, idx = v4_lighting_indexer(q, key, w, 4, 6, ks=ks, ke=ke, backend="torch")
    logits = v4_logits(q.transpose(0, 1), key.transpose(0, 1), w.transpose(0, 1), ks, ke)
    assert torch.equal(idx, select_topk_reference(logits, 6))
    given = torch.randint(-1, k, (b, s, 6), generator=g, dtype=torch.int32)
    score2, idx2 = v4_lighting_indexer(q, key, w, 4, 6, given, ks=ks, ke=ke)
    assert idx2 is given or torch.equal(idx2, given)
    assert torch.equal(score2, pytorch_extract_topk_scores(logits, given))


def test_v4_gradients_match_autograd_on_fp32_formula():
    s, b, h, d, k, ratio, topk = 30, 2, 4, 32, 7, 4, 4
    q, key, w = _v4_inputs(s, b, h, d, k, seed=3, grad=True)
    score, idx = v4_lighting_indexer(q, key, w, ratio, topk)
    upstream = torch.randn(score.shape, generator=torch.Generator().manual_seed(4))
    torch.where(idx >= 0, score, 0.0).mul(upstream).sum().backward()
    assert (q.grad.dtype, key.grad.dtype, w.grad.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    # Dense fp32 formula in SBHD, differentiated by autograd at the same indices.
    q2, k2, w2 = (x.detach().float().requires_grad_() for x in (q, key, w))
    logits = (torch.einsum("sbhd,tbd->bsht", q2, k2).relu() * w2.transpose(0, 1)[..., None]).sum(2)
    gathered = logits.gather(-1, idx.clamp(min=0).long())
    torch.where(idx >= 0, gathered, 0.0).mul(upstream).sum().backward()
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q.grad.float(), q2.grad, rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(key.grad.float(), k2.grad, rtol=2**-8, atol=1e-5)
    blind = torch.arange(s) < ratio - 1  # queries before the first full group see nothing
    assert bool((q.grad[blind] == 0).all()) and bool((w.grad[blind] == 0).all())
    assert bool((idx[:, blind] == -1).all()) and bool(torch.isneginf(score[:, blind]).all())


def test_v4_function_apply_positional():
    q, key, w = _v4_inputs(16, 1, 2, 16, 4, seed=5, grad=True)
    score, idx = V4IndexerFunction.apply(q, key, w, 4, 3, None, None, None, "torch")
    assert not idx.requires_grad and score.requires_grad
    torch.where(idx >= 0, score, 0.0).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()


def test_extract_topk_scores_gathers_with_minus_one():
    logits = torch.randn(2, 3, 5)
    idx = torch.tensor([[[4, -1], [0, 2], [-1, -1]], [[1, 1], [3, 0], [2, -1]]])
    out = pytorch_extract_topk_scores(logits, idx)
    want = torch.where(idx >= 0, logits.gather(-1, idx.clamp(min=0)), float("-inf"))
    assert torch.equal(out, want)
    out1 = pytorch_extract_topk_scores(logits.transpose(1, 2), idx.transpose(1, 2), dim=1)
    assert torch.equal(out1, want.transpose(1, 2))


def _v41_inputs(b, s, h, d, k, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, s, h, d, generator=g).bfloat16(),
        torch.randn(b, k, d, generator=g).bfloat16(),
        (torch.randn(b, s, h, generator=g) * 0.1).bfloat16(),
        g,
    )


def test_v41_allowed_and_ks_ke_agree_and_match_formula():
    q, k, w, g = _v41_inputs(2, 21, 8, 32, 9, seed=6)
    ks, ke = random_ks_ke(2, 21, 9, g)
    allowed = (torch.arange(9) >= ks[..., None]) & (torch.arange(9) < ke[..., None])
    want = torch.einsum("bshd,btd->bsht", q, k).relu().mul(w[..., None]).sum(2).masked_fill(~allowed, float("-inf"))
    a = indexer_scores(q, k, w, allowed)
    r = indexer_scores(q, k, w, ks=ks, ke=ke, backend="torch")
    assert a.dtype == torch.bfloat16 and torch.equal(a, want) and torch.equal(r, want)


def test_v41_non_contiguous_allowed_is_honoured_elementwise():
    q, k, w, g = _v41_inputs(1, 13, 4, 16, 10, seed=7)
    allowed = torch.rand(1, 13, 10, generator=g) < 0.5  # holes, not ranges
    out = indexer_scores(q, k, w, allowed)
    full = torch.einsum("bshd,btd->bsht", q, k).relu().mul(w[..., None]).sum(2)
    assert torch.equal(torch.isneginf(out), ~allowed) and torch.equal(out[allowed], full[allowed])


def test_v41_builds_no_graph_and_keeps_inputs():
    q, k, w, g = _v41_inputs(1, 8, 2, 16, 3, seed=8)
    q.requires_grad_()
    before = q.detach().clone()
    ks = torch.zeros(1, 8, dtype=torch.int32)
    ke = torch.full((1, 8), 3, dtype=torch.int32)
    out = indexer_scores(q, k, w, ks=ks, ke=ke)
    assert not out.requires_grad and out.grad_fn is None and torch.equal(q.detach(), before)


def test_backend_seam_on_cpu():
    q, key, w = _v4_inputs(8, 1, 2, 16, 2, seed=9)
    with pytest.raises(ValueError, match="backend"):
        v4_lighting_indexer(q, key, w, 4, 2, backend="tilelang")
    with pytest.raises(ValueError, match="backend"):
        v4_lighting_indexer(q, key, w, 4, 2, backend="cuda")
    q1, k1, w1, _ = _v41_inputs(1, 8, 2, 16, 2, seed=9)
    with pytest.raises(ValueError, match="backend"):
        indexer_scores(q1, k1, w1, torch.ones(1, 8, 2, dtype=torch.bool), backend="tilelang")


@pytest.mark.parametrize("b, s, h, d, k, topk", [(2, 37, 4, 32, 9, 4), (1, 70, 8, 16, 17, 32)])
def test_v4_streamed_selection_equals_materialised(b, s, h, d, k, topk):
    """fused_topk streams query chunks; on exactly computable inputs it picks the same keys and
    returns the same scores and gradients as the materialising path."""
    g = torch.Generator().manual_seed(b * 100 + s)
    q = torch.randint(-3, 4, (s, b, h, d), generator=g).to(torch.bfloat16)
    kk = torch.randint(-3, 4, (k, b, d), generator=g).to(torch.bfloat16)
    w = torch.randint(-2, 3, (s, b, h), generator=g).float()
    ks, ke = random_ks_ke(b, s, k, g)
    results = []
    for fused in (False, True):
        qg, kg, wg = (t.clone().requires_grad_(True) for t in (q, kk, w))
        score, idx = v4_lighting_indexer(qg, kg, wg, 4, topk, ks=ks, ke=ke, backend="torch", fused_topk=fused)
        upstream = torch.where(idx >= 0, torch.linspace(0.5, 1.5, idx.shape[-1]), 0.0).expand_as(score)
        score.masked_fill(idx < 0, 0).mul(upstream).sum().backward()
        results.append((score, idx, qg.grad, kg.grad, wg.grad))
    for a, c in zip(*results):
        assert torch.equal(a, c)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("b, s, h, d, k, topk, explicit", [(2, 29, 4, 32, 8, 5, True), (3, 17, 2, 16, 5, 8, False)])
def test_v4_bshd_entry_point_equals_sbhd_seed_api(b, s, h, d, k, topk, explicit, fused):
    """v4_indexer_bshd on BSHD tensors returns what the SBHD seed API returns on their transposes,
    and the same gradients (in each caller's layout)."""
    g = torch.Generator().manual_seed(b * 1000 + s)
    q = torch.randn(b, s, h, d, generator=g).bfloat16()
    key = torch.randn(b, k, d, generator=g).bfloat16()
    w = torch.randn(b, s, h, generator=g) * h**-0.5
    ks, ke = random_ks_ke(b, s, k, g) if explicit else (None, None)
    upstream = torch.randn(b, s, min(topk, k), generator=g)
    outputs = []
    for bshd in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, key, w)]
        if bshd:
            score, idx = v4_indexer_bshd(*leaves, 4, topk, ks=ks, ke=ke, backend="torch", fused_topk=fused)
            grads = lambda: [x.grad for x in leaves]  # noqa: E731
        else:
            sbhd = [x.detach().transpose(0, 1).contiguous().requires_grad_() for x in leaves]
            score, idx = v4_lighting_indexer(*sbhd, 4, topk, ks=ks, ke=ke, backend="torch", fused_topk=fused)
            grads = lambda: [x.grad.transpose(0, 1) for x in sbhd]  # noqa: E731
        torch.where(idx >= 0, score, 0.0).mul(upstream).sum().backward()
        outputs.append((score, idx, *grads()))
    for a, c in zip(*outputs):
        assert torch.equal(a, c)
    given = outputs[0][1]
    score, idx = v4_indexer_bshd(q, key, w, 4, topk, topk_indices=given, ks=ks, ke=ke)
    assert torch.equal(score, outputs[0][0]) and torch.equal(idx, given)
