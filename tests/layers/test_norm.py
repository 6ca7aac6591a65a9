"""The RMS norms' own backward: the plain formula's forward bit for bit, its gradients, and the
memory it keeps for the backward (``x`` and one fp32 number a row, not ``x``'s fp32 copy)."""

from __future__ import annotations

import pytest
import torch

from nemo_dsa.layers.norm import RMSNorm, rms_normalize
from _support.helpers import stable_seed

EPS = 1e-6
# Ragged leading shapes, and a width that is no power of two.
SHAPES = [(3, 37, 4, 64), (1, 5, 2, 512), (2, 11, 96)]


def plain(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """The formula as autograd would differentiate it."""
    xf = x.float()
    normalized = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    if weight is not None:
        normalized = normalized * weight.float()
    return normalized.to(x.dtype)


def inputs(shape, dtype, with_weight, seed):
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different scales, so the rms matters.
    scale = torch.exp(torch.randn(*shape[:-1], 1, generator=gen, dtype=torch.float64) * 2)
    x = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    weight = None
    if with_weight:
        weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen, dtype=torch.float64)).float().requires_grad_()
    grad = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    return x, weight, grad


def apply(x, weight):
    """(nemo_dsa's norm of ``x``, the RMSNorm's own weight parameter or None)."""
    if weight is None:
        return rms_normalize(x, EPS), None
    norm = RMSNorm(x.shape[-1], EPS)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x), norm.weight


def backward_through_norm(x, weight, grad):
    """Backpropagates ``grad`` through nemo_dsa's norm of ``x``; returns its weight parameter (or None)."""
    out, param = apply(x, weight)
    out.backward(grad)
    return param


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_weight", [False, True])
def test_forward_is_the_plain_formula_bit_for_bit(shape, dtype, with_weight):
    x, weight, _ = inputs(shape, dtype, with_weight, stable_seed((shape, str(dtype), with_weight)))
    got, _ = apply(x, weight)
    assert got.dtype == dtype
    assert torch.equal(got, plain(x, weight))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_weight", [False, True])
def test_fp32_gradients_equal_float64_autograd_of_the_formula(shape, with_weight):
    x, weight, grad = inputs(shape, torch.float32, with_weight, stable_seed((shape, with_weight, "fp32")))
    param = backward_through_norm(x, weight, grad)
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_() if with_weight else None
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    (ref * w64 if with_weight else ref).backward(grad.double())
    # fp32 arithmetic against the exact gradient: a few fp32 ulps of the row's scale.
    scale = x64.grad.abs().amax(-1, keepdim=True)
    assert ((x.grad.double() - x64.grad).abs() <= scale * 1e-5).all()
    if with_weight:
        torch.testing.assert_close(param.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_weight", [False, True])
def test_bf16_gradients_match_autograd_of_the_formula(shape, with_weight):
    """In bf16 the two backwards round differently inside fp32; both end in one bf16 rounding."""
    x, weight, grad = inputs(shape, torch.bfloat16, with_weight, stable_seed((shape, with_weight, "bf16")))
    param = backward_through_norm(x, weight, grad)
    got_dx = x.grad.clone()
    x.grad = None
    plain(x, weight).backward(grad)
    # One bf16 ulp (at most 2^-7 relative) of autograd's value, per element.
    assert ((got_dx.float() - x.grad.float()).abs() <= x.grad.float().abs() * 2**-7 + 1e-30).all()
    if with_weight:
        torch.testing.assert_close(param.grad, weight.grad, rtol=1e-5, atol=1e-5)


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of ``fn()``."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_keeps_x_and_one_fp32_number_a_row_not_an_fp32_copy():
    shape = (1, 64, 8, 512)  # rows of V4's per-head q norm
    x, _, _ = inputs(shape, torch.bfloat16, False, stable_seed("memory"))
    rows = x.numel() // shape[-1]
    kept = saved_bytes(lambda: rms_normalize(x, EPS))
    assert kept == x.numel() * 2 + rows * 4
    assert saved_bytes(lambda: plain(x, None)) >= x.numel() * 4  # what autograd would keep
