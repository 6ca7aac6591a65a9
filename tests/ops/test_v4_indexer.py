"""The V4 indexer interface (nemo_dsa.ops.v4_indexer.interface) on CPU: the SBHD seed API and its
BSHD entry point, defaults, selection, gradients, the streamed selection and argument errors.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import ERROR_SIZES, error_v4_inputs, generator, indexer_inputs, random_ks_ke
from nemo_dsa.ops.topk import pytorch_extract_topk_scores, select_topk_reference
from nemo_dsa.ops.v4_indexer import v4_indexer_bshd, v4_lighting_indexer, v4_logits, V4IndexerFunction

S, B, H, D, K = ERROR_SIZES


def _replace(args, **changes):
    out = dict(zip(("index_q", "index_k", "weights"), args))
    out.update(changes)
    return out


V4_CASES = [
    (TypeError, "index_q", dict(index_q=[1.0])),
    (ValueError, "index_q", dict(index_q=torch.randn(S, B, H * D).bfloat16())),
    (TypeError, "index_q", dict(index_q=torch.randn(S, B, H, D))),
    (TypeError, "index_k", dict(index_k=torch.randn(K, B, D))),
    (ValueError, "index_k", dict(index_k=torch.randn(K, B + 1, D).bfloat16())),
    (ValueError, "index_k", dict(index_k=torch.randn(K, B, D + 16).bfloat16())),
    (ValueError, "index_k", dict(index_k=torch.empty(K, B, D, dtype=torch.bfloat16, device="meta"))),
    (TypeError, "weights", dict(weights=torch.randn(S, B, H).bfloat16())),
    (ValueError, "weights", dict(weights=torch.randn(S, B, H + 1))),
]


# (11, 2, 3, 24, ...): a head dim that is no multiple of 16 (the kernels' step), run by the reference.
@pytest.mark.parametrize(
    "s,b,h,d,ratio,topk", [(37, 2, 4, 32, 4, 5), (20, 3, 2, 16, 1, 64), (9, 1, 3, 16, 4, 1), (11, 2, 3, 24, 1, 3)]
)
def test_v4_default_causal_rule_and_selection(s, b, h, d, ratio, topk):
    k = s // ratio + (1 if ratio == 1 else 0)  # K may exceed the causal need (unused keys)
    q, key, w = indexer_inputs(b, s, h, d, k, s, seq_first=True)
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
    q, key, w = indexer_inputs(b, s, h, d, k, 1, seq_first=True)
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
    q, key, w = indexer_inputs(b, s, h, d, k, 3, seq_first=True, requires_grad=True)
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
    q, key, w = indexer_inputs(1, 16, 2, 16, 4, 5, seq_first=True, requires_grad=True)
    score, idx = V4IndexerFunction.apply(q, key, w, 4, 3, None, None, None, "torch")
    assert not idx.requires_grad and score.requires_grad
    torch.where(idx >= 0, score, 0.0).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()


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
    g = generator(b * 1000 + s)
    q, key, w = indexer_inputs(b, s, h, d, k, g)
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


@pytest.mark.parametrize("error,name,change", V4_CASES)
def test_v4_tensor_arguments(error, name, change):
    with pytest.raises(error, match=name):
        v4_lighting_indexer(**_replace(error_v4_inputs(), **change), compress_ratio=4, topk=2)


@pytest.mark.parametrize(
    "error,name,kwargs",
    [
        (ValueError, "compress_ratio", dict(compress_ratio=0)),
        (TypeError, "compress_ratio", dict(compress_ratio=4.0)),
        (ValueError, "topk", dict(topk=0)),
        (TypeError, "topk", dict(topk=True)),
        (TypeError, "fused_topk", dict(fused_topk="yes")),
    ],
)
def test_v4_scalar_arguments(error, name, kwargs):
    with pytest.raises(error, match=name):
        v4_lighting_indexer(*error_v4_inputs(), **{"compress_ratio": 4, "topk": 2, **kwargs})


@pytest.mark.parametrize(
    "error,match,indices",
    [
        (TypeError, "topk_indices", torch.zeros(B, S, 2, dtype=torch.int64)),
        (ValueError, "topk_indices", torch.zeros(B, S, 3, dtype=torch.int32)),
        (ValueError, "topk_indices", torch.zeros(B, S, dtype=torch.int32)),
        (ValueError, "topk_indices must lie", torch.full((B, S, 2), K, dtype=torch.int32)),
        (ValueError, "topk_indices must lie", torch.full((B, S, 2), -2, dtype=torch.int32)),
    ],
)
def test_v4_given_topk_indices(error, match, indices):
    with pytest.raises(error, match=match):
        v4_lighting_indexer(*error_v4_inputs(), 4, 2, indices)


def test_v4_lightning_indexer_is_the_seed_function():
    import nemo_dsa
    from nemo_dsa.ops import v4_indexer
    from nemo_dsa.ops.v4_indexer import interface

    assert nemo_dsa.v4_lightning_indexer is nemo_dsa.v4_lighting_indexer is interface.v4_lighting_indexer
    assert v4_indexer.v4_lightning_indexer is interface.v4_lighting_indexer
    assert "v4_lightning_indexer" in nemo_dsa.__all__ and "v4_lightning_indexer" in v4_indexer.__all__
