"""The fp32 LM head of bf16 activations in exact bf16 products (``ops/fp32_linear``), on the CPU.

cuBLAS's bf16 x bf16 -> fp32 products are emulated by float64 products rounded to fp32 (products of
two bf16 numbers are exact in both; only the order and precision of the additions differ). The
GPU test runs the real one (tests/ops/test_fp32_linear_gpu.py)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from _support.fp32_linear_emulation import EMULATED, operands, ulp_bf16
from _support.helpers import stable_seed
from nemo_dsa.ops.fp32_linear import bf16_pieces, fp32_linear_of_bf16, fp32_linear_reference, split_applies
from nemo_dsa.ops.fp32_linear import split


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_three_bf16_pieces_carry_the_fp32_weight(seed):
    _, weight = operands((1,), 64, 333, seed)
    first, second, third = bf16_pieces(weight)
    assert first.dtype == second.dtype == third.dtype == torch.bfloat16
    total = first.double() + second.double() + third.double()
    assert ((total - weight.double()).abs() <= weight.double().abs() * 2.0**-27).all()
    assert (total.float() == weight).float().mean() > 0.999  # 24 significant bits in 3 x 8


@pytest.mark.parametrize("rows, inner, out", [((3, 37), 96, 333), ((1, 5), 64, 4096 + 77), ((129,), 128, 40)])
def test_forward_is_the_fp32_product_rounded_once(monkeypatch, rows, inner, out):
    monkeypatch.setattr(split, "CHUNK_ROWS", 128)  # several chunks and a ragged last one
    x, weight = operands(rows, inner, out, stable_seed((rows, inner, out)))
    got = fp32_linear_of_bf16(x, weight, products=EMULATED)
    assert got.dtype == torch.bfloat16 and got.shape == (*rows, out)
    exact = x.double() @ weight.double().T
    noise = x.double().abs() @ weight.double().abs().T * 2.0**-20  # fp32 additions, any order
    reference = fp32_linear_reference(x, weight)  # the fp32 GEMM (here the CPU's)
    # Both are the exact value rounded to bf16, up to fp32 addition order: equal, except where the
    # exact value lies within that order's noise of a bf16 rounding mid-point (one ulp apart).
    assert ((got.double() - exact).abs() <= ulp_bf16(exact) * 0.5 + noise).all()
    differs = got != reference
    assert differs.float().mean() < 1e-3
    assert ((got.double() - reference.double()).abs()[differs] <= ulp_bf16(exact)[differs] * 1.01).all()


@pytest.mark.parametrize("rows, inner, out", [((3, 37), 96, 333), ((2, 7), 64, 300)])
def test_gradients_equal_fp32_autograd_of_the_reference(monkeypatch, rows, inner, out):
    monkeypatch.setattr(split, "CHUNK_ROWS", 128)
    x, weight = operands(rows, inner, out, stable_seed(("grad", rows, inner, out)))
    grad = torch.randn(*rows, out, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x1, w1 = x.clone().requires_grad_(), weight.clone().requires_grad_()
    fp32_linear_of_bf16(x1, w1, products=EMULATED).backward(grad)
    x2, w2 = x.double().requires_grad_(), weight.double().requires_grad_()
    F.linear(x2, w2).backward(grad.double())  # exact
    assert x1.grad.dtype == torch.bfloat16 and w1.grad.dtype == torch.float32
    # dx: the exact value rounded once to bf16 (up to fp32 addition order).
    noise = grad.double().abs() @ weight.double().abs() * 2.0**-20
    assert ((x1.grad.double() - x2.grad).abs() <= ulp_bf16(x2.grad) * 0.5 + noise).all()
    # dw: exact products added in fp32.
    torch.testing.assert_close(w1.grad.double(), w2.grad, rtol=1e-6, atol=1e-6 * float(w2.grad.abs().max()))


def test_only_x_and_the_weight_are_kept():
    x, weight = operands((4, 9), 32, 50, 3)
    weight.requires_grad_()
    kept = set()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.add(t.untyped_storage().data_ptr()) or t, lambda t: t):
        fp32_linear_of_bf16(x.requires_grad_(), weight, products=EMULATED)
    assert kept == {x.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()}


def test_bad_operands_are_named():
    x, weight = operands((2,), 8, 4, 0)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        fp32_linear_of_bf16(x.float(), weight)
    with pytest.raises(TypeError, match="weight must be a 2-D float32"):
        fp32_linear_of_bf16(x, weight.bfloat16())
    with pytest.raises(ValueError, match="in_features"):
        fp32_linear_of_bf16(x, weight[:, :4])


def test_the_split_is_for_cuda_operands_only():
    x, weight = operands((2,), 8, 4, 0)
    assert not split_applies(x, weight)  # CPU: the module's fp32 F.linear


@pytest.mark.parametrize("rows, inner, out", [((3, 37), 96, 333), ((2, 7), 64, 300)])
def test_fp32_logits_and_their_fp32_gradient(monkeypatch, rows, inner, out):
    """V4.1's head keeps its logits in fp32: no rounding in the forward, and the fp32 gradient goes
    into three pieces (six products for dx, three for dw) with fp32 precision."""
    monkeypatch.setattr(split, "CHUNK_ROWS", 128)
    x, weight = operands(rows, inner, out, stable_seed(("fp32 out", rows, inner, out)))
    grad = torch.randn(*rows, out, generator=torch.Generator().manual_seed(5)) * 1e-3  # not bf16-valued
    x1, w1 = x.clone().requires_grad_(), weight.clone().requires_grad_()
    got = fp32_linear_of_bf16(x1, w1, out_dtype=torch.float32, products=EMULATED)
    got.backward(grad)
    x2, w2 = x.double().requires_grad_(), weight.double().requires_grad_()
    exact = F.linear(x2, w2)
    exact.backward(grad.double())
    assert got.dtype == torch.float32
    noise = x.double().abs() @ weight.double().abs().T * 2.0**-20
    assert ((got.double() - exact.detach()).abs() <= noise).all()
    d_noise = grad.double().abs() @ weight.double().abs() * 2.0**-20
    assert ((x1.grad.double() - x2.grad).abs() <= ulp_bf16(x2.grad) * 0.5 + d_noise).all()
    w_noise = grad.double().abs().flatten(0, -2).T @ x.double().abs().flatten(0, -2) * 2.0**-20
    assert ((w1.grad.double() - w2.grad).abs() <= w_noise).all()


def test_fp32_gradient_pieces_matter():
    """Dropping the gradient's second and third pieces (a bf16 rounding of the gradient) fails the
    bound above: the split of an fp32 gradient is needed, not decoration."""
    x, weight = operands((4, 9), 64, 200, 11)
    grad = torch.randn(4, 9, 200, generator=torch.Generator().manual_seed(2)) * 1e-3
    rounded = grad.to(torch.bfloat16).double()
    exact = grad.double() @ weight.double()
    d_noise = grad.double().abs() @ weight.double().abs() * 2.0**-20
    assert ((rounded @ weight.double() - exact).abs() > ulp_bf16(exact) * 0.5 + d_noise).any()


@pytest.mark.parametrize("ratio, overlap", [(4, True), (128, False), (2, False)])  # V4 ratio 4 / 128, V4.1 ratio 2
def test_a_compressor_on_the_chain_matches_its_fp32_projections(monkeypatch, ratio, overlap):
    """``Compressor`` takes bf16 tokens through the chain on CUDA; here with the emulated product on
    the CPU, against the same module's fp32 ``F.linear`` path: values, token and weight gradients."""
    from nemo_dsa.layers import compressor as compressor_module
    from nemo_dsa.layers.context import LocalContext
    from nemo_dsa.metadata import build_attention_metadata

    torch.manual_seed(ratio)
    module = compressor_module.Compressor(64, 32, ratio, 16, 10000.0, 1e-6, overlap=overlap, ape=ratio != 2)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    seq = 3 * ratio + 5
    ids = torch.cat((torch.ones(2 * ratio + 1), torch.full((ratio + 4,), 2.0))).long()[None]  # two documents
    meta = build_attention_metadata(compress_ratio=ratio, packed_seq_ids=ids)
    x = torch.randn(1, seq, 64).to(torch.bfloat16)
    chained = functools.partial(split.fp32_linear_of_bf16, products=EMULATED)
    results = []
    for on_chain in (False, True):
        monkeypatch.setattr(compressor_module, "split_applies", lambda *args, on=on_chain: on)
        monkeypatch.setattr(compressor_module, "fp32_linear_of_bf16", chained)
        module.zero_grad(set_to_none=True)
        tokens = x.clone().requires_grad_()
        out = module(tokens, meta, LocalContext())
        assert out.dtype == torch.bfloat16 and out.abs().amax(-1).gt(0).sum() >= 2  # valid groups pooled
        out.float().square().sum().backward()
        results.append([out.float(), tokens.grad.float(), module.wkv.weight.grad, module.wgate.weight.grad])
    for fp32_path, chain in zip(*results):
        assert float((chain - fp32_path).norm() / fp32_path.norm()) < 1e-2
    # fp32 values agree to fp32 addition order: the bf16 outputs differ in few elements, by an ulp
    assert (results[0][0] != results[1][0]).float().mean() < 0.05
