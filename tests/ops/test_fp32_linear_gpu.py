"""The exact-product fp32 head on the GPU: cuBLAS's bf16 x bf16 -> fp32 products against the fp32
GEMM (``pytest -m gpu``; the CPU tests emulate the product, tests/ops/test_fp32_linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _support.fp32_linear_emulation import ulp_bf16
from _support.helpers import stable_seed
from nemo_dsa.ops.fp32_linear import fp32_linear_of_bf16, split_applies

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


@pytest.mark.parametrize("layer_idx", [1, 2])  # ratio 4 (overlapping compressor and indexer), ratio 8
def test_the_layers_compressors_on_exact_products_match_their_fp32_gemms(monkeypatch, layer_idx):
    """A V4 layer with its compressors' bf16-token projections on exact products against the same
    layer with the fp32 GEMMs (``split_applies`` off): the same values up to fp32 addition order."""
    from _support.dsa_layer_runs import make_layer, packed_ids, run
    from _support.helpers import tiny_config
    from nemo_dsa.layers import compressor as compressor_module

    cfg = tiny_config(hidden_size=256, num_attention_heads=8, head_dim=128, qk_rope_head_dim=64, q_lora_rank=64,
                      index_head_dim=64, backend="tilelang")  # fmt: skip
    x = torch.randn(2, 192, cfg.hidden_size, generator=torch.Generator().manual_seed(11)).cuda().to(torch.bfloat16)
    ids = packed_ids([[70, 122], [151]], seq=192).cuda()
    results = {}
    for split in (False, True):
        if not split:
            monkeypatch.setattr(compressor_module, "split_applies", lambda *args: False)
        else:
            monkeypatch.undo()
        layer = make_layer(cfg, layer_idx, seed=9).cuda().to(torch.bfloat16)
        assert layer.compressor.wkv.weight.dtype == torch.float32
        inputs = x.clone().requires_grad_()
        out, _ = run(layer, inputs, ids)
        assert not out.isnan().any()
        out.float().square().sum().backward()
        compressors = [m for m in layer.modules() if isinstance(m, compressor_module.Compressor)]
        # the indexer's compressor learns from the indexer loss only: no gradient from ``out``
        weight_grads = [g for c in compressors for g in (c.wkv.weight.grad, c.wgate.weight.grad) if g is not None]
        assert weight_grads
        results[split] = [out.float(), inputs.grad.float(), *weight_grads]
    for fp32_gemm, exact_products in zip(results[False], results[True]):
        assert float((exact_products - fp32_gemm).norm() / fp32_gemm.norm()) < 1e-2
