"""The exact-product fp32 head on the GPU: cuBLAS's bf16 x bf16 -> fp32 products against the fp32
GEMM (``pytest -m gpu``; the CPU tests emulate the product, tests/test_fp32_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import stable_seed
from nemo_dsa.ops.fp32_linear import fp32_linear_of_bf16, split_applies
from test_fp32_linear import ulp_bf16

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: cuBLAS's fp32-output bf16 product"),
]


@pytest.mark.parametrize("rows, inner, out", [(1000, 4096, 32768 + 123), (37, 512, 4096)])
def test_matches_the_exact_product_and_its_gradients(rows, inner, out):
    gen = torch.Generator(device="cuda").manual_seed(stable_seed((rows, inner, out)))
    x = torch.randn(rows, inner, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(out, inner, device="cuda", generator=gen) * 0.02).requires_grad_()
    assert split_applies(x, weight)
    grad = torch.randn(rows, out, device="cuda", generator=gen).to(torch.bfloat16)
    got = fp32_linear_of_bf16(x, weight)
    got.backward(grad)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    exact = F.linear(x64, w64)
    exact.backward(grad.double())
    noise = x64.detach().abs() @ w64.detach().abs().T * 2.0**-20
    assert ((got.double() - exact.detach()).abs() <= ulp_bf16(exact.detach()) * 0.5 + noise).all()
    d_noise = grad.double().abs() @ w64.detach().abs() * 2.0**-20
    assert ((x.grad.double() - x64.grad).abs() <= ulp_bf16(x64.grad) * 0.5 + d_noise).all()
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5 * float(w64.grad.abs().max()))
