"""V4 TileLang kernels against the float64 references (H200 only: ``pytest -m gpu``).

Forward: rel 1e-5 of sum|terms| on visible entries and the exact -inf pattern, with the output
poisoned (NaN) before the kernel writes it. Backward: bf16 tolerance against torch autograd
through the float64 reference logits.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from _support.helpers import KERNEL_LAYOUTS, indexer_inputs, kernel_layout_ks_ke
from _support.helpers import KERNEL_RATIO as RATIO

from nemo_dsa.visibility import causal_ks_ke
from nemo_dsa.ops.v4_indexer.naive import v4_logits

pytestmark = pytest.mark.gpu

# (heads, index_dim): every head count the issue names, both head dims, few compiles in all.
HEAD_CONFIGS = [(8, 64), (16, 128), (32, 64), (64, 128), (128, 64)]


@pytest.mark.parametrize("heads,dim", HEAD_CONFIGS)
@pytest.mark.parametrize("layout,batch,queries,num_keys", KERNEL_LAYOUTS)
def test_forward_matches_float64_reference(heads, dim, layout, batch, queries, num_keys):
    from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang

    gen = torch.Generator().manual_seed(zlib.crc32(f"{heads}-{dim}-{layout}".encode()))
    ks, ke, num_keys = kernel_layout_ks_ke(layout, batch, queries, num_keys, "cuda", gen)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, gen, w_scale="fan_in", device="cuda")
    out = torch.full((batch, queries, num_keys), float("nan"), device="cuda")
    got = v4_logits_tilelang(q, k, w, ks, ke, out=out)
    assert got.data_ptr() == out.data_ptr()

    ref = v4_logits(q.double(), k.double(), w.double(), ks, ke)
    # sum over h and d of |w_h q_hd k_d|: the size of every term the fp32 sums add up.
    scale = v4_logits(q.double().abs(), k.double().abs(), w.double().abs(), ks, ke)
    visible = torch.isfinite(ref)
    assert not torch.isnan(got).any(), "kernel left poisoned (NaN) entries"
    assert torch.equal(torch.isneginf(got), ~visible), "-inf pattern differs from [ks, ke)"
    err = (got.double() - ref).abs()[visible]
    bound = 1e-5 * scale[visible] + 1e-30
    assert bool((err <= bound).all()), f"max err/bound {float((err / bound).max()):.3g}"
    assert visible.any(), "test case sees no key at all"


def _gathered_loss_reference(q, k, w, ks, ke, idx, grad):
    """Torch autograd of sum(grad * logits.gather(idx)) through dense float64 logits."""
    q64, k64, w64 = (t.double().requires_grad_() for t in (q, k, w))
    products = torch.einsum("bshd,bkd->bshk", q64, k64)
    dense = (products.relu() * w64.unsqueeze(-1)).sum(2)
    keys = torch.arange(k.shape[1], device=q.device)
    visible = (keys >= ks.unsqueeze(-1)) & (keys < ke.unsqueeze(-1))
    logits = torch.where(visible, dense, float("-inf"))
    present = idx >= 0
    scores = torch.gather(logits, -1, torch.where(present, idx, 0).long())
    live = present & torch.isfinite(scores)
    loss = torch.where(live, scores * grad.double(), 0.0).sum()
    loss.backward()
    return q64.grad, k64.grad, w64.grad


def _assert_bf16_close(name, got, ref):
    ref = ref.double()
    diff = (got.double() - ref).abs()
    tol = 1.6e-2 * ref.abs() + 1e-2 * ref.abs().max() + 1e-12
    assert bool((diff <= tol).all()), f"{name}: max excess {float((diff - tol).max()):.3g}"
    rel = float(diff.norm() / ref.norm().clamp_min(1e-30))
    assert rel < 8e-3, f"{name}: relative L2 error {rel:.3g}"


@pytest.mark.parametrize("heads,dim", HEAD_CONFIGS)
@pytest.mark.parametrize("layout,batch,queries,num_keys", [KERNEL_LAYOUTS[i] for i in (0, 2, 3, 5)])
def test_backward_matches_autograd(heads, dim, layout, batch, queries, num_keys):
    from nemo_dsa.ops.v4_indexer.kernels import v4_topk_backward_tilelang

    gen = torch.Generator().manual_seed(zlib.crc32(f"{heads}-{dim}-{layout}-bwd".encode()))
    ks, ke, num_keys = kernel_layout_ks_ke(layout, batch, queries, num_keys, "cuda", gen)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, gen, w_scale="fan_in", device="cuda")
    count = min(77, num_keys)  # ragged: not a multiple of the 64-key step
    # Distinct random keys per query, some visible and some not, plus -1 padding.
    idx = torch.rand(batch, queries, num_keys, generator=gen).argsort(-1)[..., :count].int()
    idx[torch.rand(batch, queries, count, generator=gen) < 0.1] = -1
    idx = idx.cuda()
    grad = torch.randn(batch, queries, count, generator=gen).cuda()

    dq, dk, dw = v4_topk_backward_tilelang(q, k, w, idx, grad, ks, ke)
    rq, rk, rw = _gathered_loss_reference(q, k, w, ks, ke, idx, grad)
    assert dq.dtype == torch.bfloat16 and dk.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert rk.abs().max() > 0, "test case sends no gradient"
    _assert_bf16_close("dq", dq, rq)
    _assert_bf16_close("dk", dk, rk)
    # dw only sums fp32 products of exact values: far tighter than bf16.
    torch.testing.assert_close(dw.double(), rw, rtol=1e-4, atol=1e-5 * float(rw.abs().max()))


@pytest.mark.parametrize("heads,dim", [(3, 48), (24, 80)])
def test_shapes_outside_the_table_run_zero_padded(heads, dim):
    from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang, v4_topk_backward_tilelang

    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    ks, ke, num_keys = kernel_layout_ks_ke("packed", 2, 299, None, "cuda", gen)
    q, k, w = indexer_inputs(2, 299, heads, dim, num_keys, gen, w_scale="fan_in", device="cuda")
    got = v4_logits_tilelang(q, k, w, ks, ke)
    ref = v4_logits(q.double(), k.double(), w.double(), ks, ke)
    scale = v4_logits(q.double().abs(), k.double().abs(), w.double().abs(), ks, ke)
    visible = torch.isfinite(ref)
    assert torch.equal(torch.isneginf(got), ~visible)
    assert bool(((got.double() - ref).abs()[visible] <= 1e-5 * scale[visible] + 1e-30).all())

    idx = torch.rand(2, 299, num_keys, generator=gen).argsort(-1)[..., :40].int().cuda()
    grad = torch.randn(2, 299, 40, generator=gen).cuda()
    dq, dk, dw = v4_topk_backward_tilelang(q, k, w, idx, grad, ks, ke)
    assert dq.shape == q.shape and dk.shape == k.shape and dw.shape == w.shape
    rq, rk, rw = _gathered_loss_reference(q, k, w, ks, ke, idx, grad)
    _assert_bf16_close("dq", dq, rq)
    _assert_bf16_close("dk", dk, rk)
    torch.testing.assert_close(dw.double(), rw, rtol=1e-4, atol=1e-5 * float(rw.abs().max()))


def test_backward_without_ranges_uses_every_index():
    from nemo_dsa.ops.v4_indexer.kernels import v4_topk_backward_tilelang

    gen = torch.Generator().manual_seed(7)
    q, k, w = indexer_inputs(1, 70, 64, 128, 45, gen, w_scale="fan_in", device="cuda")
    idx = torch.randint(-1, 45, (1, 70, 45), generator=gen).int().cuda()
    grad = torch.randn(1, 70, 45, generator=gen).cuda()
    ks = torch.zeros(1, 70, dtype=torch.int32, device="cuda")
    ke = torch.full((1, 70), 45, dtype=torch.int32, device="cuda")
    got = v4_topk_backward_tilelang(q, k, w, idx, grad)
    want = v4_topk_backward_tilelang(q, k, w, idx, grad, ks, ke)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_wrappers_reject_bad_inputs():
    from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang, v4_topk_backward_tilelang

    gen = torch.Generator().manual_seed(3)
    q, k, w = indexer_inputs(1, 16, 8, 64, 4, gen, w_scale="fan_in", device="cuda")
    ks, ke = causal_ks_ke(1, 16, 4, RATIO, "cuda")
    with pytest.raises(TypeError, match="w must have dtype float32"):
        v4_logits_tilelang(q, k, w.bfloat16(), ks, ke)
    with pytest.raises(ValueError, match="multiple of 16"):
        v4_logits_tilelang(q[..., :40], k[..., :40], w, ks, ke)
    with pytest.raises(ValueError, match="CUDA"):
        v4_logits_tilelang(q.cpu(), k.cpu(), w.cpu(), ks.cpu(), ke.cpu())
    idx = torch.full((1, 16, 4), 4, dtype=torch.int32, device="cuda")  # K = 4: past every key
    dq, dk, dw = v4_topk_backward_tilelang(q, k, w, idx, torch.ones(1, 16, 4, device="cuda"))
    assert not dq.any() and not dk.any() and not dw.any()  # never read, no gradient
