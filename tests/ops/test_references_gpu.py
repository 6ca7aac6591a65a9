"""The torch references (every ops/<op>/naive.py) on CUDA tensors equal their CPU results."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import dense_visibility, generator, indexer_inputs, random_ks_ke, random_topk_indices, v41_formula
from nemo_dsa.ops.quant import mxfp4_quant_dequant
from nemo_dsa.ops.topk import candidate_blocks_reference, select_topk_reference
from nemo_dsa.ops.v41_indexer import v41_scores
from nemo_dsa.ops.v4_indexer import v4_backward, v4_logits


@pytest.mark.gpu
def test_references_on_cuda_match_cpu():
    """Same references on CUDA tensors: exact selection/blocks/MXFP4/V4.1, V4 fp32 even with TF32 on."""
    b, s, h, d, k = 2, 300, 8, 64, 77
    g = generator(600)
    q, keys, w = indexer_inputs(b, s, h, d, k, g)
    ks, ke = random_ks_ke(b, s, k, g)
    cuda = [x.cuda() for x in (q, keys, w, ks, ke)]
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # the reference must not use it
    try:
        logits = v4_logits(*cuda).cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert torch.backends.cuda.matmul.allow_tf32 == previous
    dots = torch.einsum("bshd,btd->bsht", q.double(), keys.double())
    ref = (dots.relu() * w.double()[..., None]).sum(2)
    scale = (dots.abs() * w.double().abs()[..., None]).sum(2)
    mask = dense_visibility(ks, ke, k)
    assert torch.equal(torch.isinf(logits), ~mask)
    assert bool(((logits.double() - ref).abs()[mask] <= 1e-5 * scale[mask] + 1e-30).all())
    w16 = w.bfloat16()
    on_gpu = v41_scores(cuda[0], cuda[1], w16.cuda(), cuda[3], cuda[4])
    formula = v41_formula(cuda[0], cuda[1], w16.cuda()).masked_fill(~mask.cuda(), float("-inf"))
    assert torch.equal(on_gpu, formula)
    scores = torch.randint(-3, 4, (b, s, k), generator=g).float().masked_fill(~mask, float("-inf"))
    for order in ("score", "index"):
        assert torch.equal(select_topk_reference(scores.cuda(), 9, order).cpu(), select_topk_reference(scores, 9, order))
    want_blocks = candidate_blocks_reference(scores, ks, ke, 4, 3)
    assert torch.equal(candidate_blocks_reference(scores.cuda(), *cuda[3:], 4, 3).cpu(), want_blocks)
    x = torch.randn(64, 128, generator=g) * 3
    assert torch.equal(mxfp4_quant_dequant(x.cuda()).cpu(), mxfp4_quant_dequant(x))
    idx = random_topk_indices(b, s, 6, k, g)
    grad = torch.randn(b, s, 6, generator=g)
    got = v4_backward(*cuda, idx.cuda(), grad.cuda())
    want = v4_backward(q, keys, w, ks, ke, idx, grad)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.cpu().float(), e.float(), rtol=2**-7, atol=1e-5)
