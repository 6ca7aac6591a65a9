"""The V4.1 indexer interface (nemo_dsa.ops.v41_indexer.interface) on CPU: both visibility forms,
no autograd graph, and argument errors."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import ERROR_SIZES, error_v41_inputs, full_visibility, generator, indexer_inputs, random_ks_ke
from nemo_dsa.ops.v41_indexer import indexer_scores

S, B, H, D, K = ERROR_SIZES


def test_v41_allowed_and_ks_ke_agree_and_match_formula():
    g = generator(6)
    q, k, w = indexer_inputs(2, 21, 8, 32, 9, g, w_scale=0.1, w_dtype=torch.bfloat16)
    ks, ke = random_ks_ke(2, 21, 9, g)
    allowed = (torch.arange(9) >= ks[..., None]) & (torch.arange(9) < ke[..., None])
    want = torch.einsum("bshd,btd->bsht", q, k).relu().mul(w[..., None]).sum(2).masked_fill(~allowed, float("-inf"))
    a = indexer_scores(q, k, w, allowed)
    r = indexer_scores(q, k, w, ks=ks, ke=ke, backend="torch")
    assert a.dtype == torch.bfloat16 and torch.equal(a, want) and torch.equal(r, want)


@pytest.mark.parametrize("heads,dim", [(3, 32), (12, 48), (256, 16), (4, 40), (2, 20)])
def test_v41_reference_takes_shapes_the_kernels_do_not(heads, dim):
    """Head counts that are no power of two (or over 128) and index dims that are no multiple of
    16: the reference scores them by the same formula; "auto" runs it wherever the kernels refuse."""
    g = generator(heads * 1000 + dim)
    q, k, w = indexer_inputs(2, 11, heads, dim, 7, g, w_scale=0.1, w_dtype=torch.bfloat16)
    ks, ke = random_ks_ke(2, 11, 7, g)
    visible = (torch.arange(7) >= ks[..., None]) & (torch.arange(7) < ke[..., None])
    want = torch.einsum("bshd,btd->bsht", q, k).relu().mul(w[..., None]).sum(2).masked_fill(~visible, float("-inf"))
    assert torch.equal(indexer_scores(q, k, w, ks=ks, ke=ke), want)


def test_v41_non_contiguous_allowed_is_honoured_elementwise():
    g = generator(7)
    q, k, w = indexer_inputs(1, 13, 4, 16, 10, g, w_scale=0.1, w_dtype=torch.bfloat16)
    allowed = torch.rand(1, 13, 10, generator=g) < 0.5  # holes, not ranges
    out = indexer_scores(q, k, w, allowed)
    full = torch.einsum("bshd,btd->bsht", q, k).relu().mul(w[..., None]).sum(2)
    assert torch.equal(torch.isneginf(out), ~allowed) and torch.equal(out[allowed], full[allowed])


def test_v41_builds_no_graph_and_keeps_inputs():
    g = generator(8)
    q, k, w = indexer_inputs(1, 8, 2, 16, 3, g, w_scale=0.1, w_dtype=torch.bfloat16)
    q.requires_grad_()
    before = q.detach().clone()
    ks = torch.zeros(1, 8, dtype=torch.int32)
    ke = torch.full((1, 8), 3, dtype=torch.int32)
    out = indexer_scores(q, k, w, ks=ks, ke=ke)
    assert not out.requires_grad and out.grad_fn is None and torch.equal(q.detach(), before)


@pytest.mark.parametrize(
    "error,match,args",
    [
        (TypeError, "queries", (torch.randn(B, S, H, D), *error_v41_inputs()[1:])),
        (ValueError, "queries", (torch.randn(B, S, D).bfloat16(), *error_v41_inputs()[1:])),
        (ValueError, "keys", (error_v41_inputs()[0], torch.randn(B + 1, K, D).bfloat16(), error_v41_inputs()[2])),
        (TypeError, "keys", (error_v41_inputs()[0], torch.randn(B, K, D), error_v41_inputs()[2])),
        (ValueError, "keys must be on", (error_v41_inputs()[0], torch.empty(B, K, D, dtype=torch.bfloat16, device="meta"), error_v41_inputs()[2])),
        (TypeError, "weights", (*error_v41_inputs()[:2], torch.randn(B, S, H))),
        (ValueError, "weights", (*error_v41_inputs()[:2], torch.randn(B, S, H * 2).bfloat16())),
    ],
)
def test_v41_tensor_arguments(error, match, args):
    ks, ke = full_visibility(B, S, K)
    with pytest.raises(error, match=match):
        indexer_scores(*args, ks=ks, ke=ke)


def test_v41_visibility_forms():
    args = error_v41_inputs()
    ks, ke = full_visibility(B, S, K)
    allowed = torch.ones(B, S, K, dtype=torch.bool)
    with pytest.raises(ValueError, match="allowed"):
        indexer_scores(*args)
    with pytest.raises(ValueError, match="allowed"):
        indexer_scores(*args, allowed, ks=ks, ke=ke)
    with pytest.raises(TypeError, match="allowed"):
        indexer_scores(*args, allowed.to(torch.uint8))
    with pytest.raises(ValueError, match="allowed"):
        indexer_scores(*args, allowed[..., :-1])
