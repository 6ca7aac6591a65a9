"""FP8 (window KV) and NVFP4 (compressed KV) quantize-dequantize: bitwise the release's rounding.

nemo_dsa's readable references (ops/quant: fp8, nvfp4) against nemo-automodel 0.7.0's DeepSeek-V4.1
``quantize_cache`` on fresh random inputs of many magnitudes, ragged channel counts (partial last
blocks), bf16 and fp32, exact E2M1 half-way ties, saturating blocks; identity gradients; NaN
blocks; argument errors.
"""

from __future__ import annotations

import pytest
import torch

from nemo_dsa.ops.quant import fp8_quant_dequant, nvfp4_quant_dequant

quantization = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.quantization")

CASES = {"fp8": (fp8_quant_dequant, 32), "nvfp4": (nvfp4_quant_dequant, 16)}


def draw(shape, seed, dtype):
    """Normal values times a per-row magnitude from 2^-12 to 2^12 (so scales span many binades)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    magnitude = 2.0 ** torch.randint(-12, 13, (*shape[:-1], 1), generator=g).float()
    return (x * magnitude).to(dtype)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                       b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32))  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 64), (2, 7, 4, 48), (1, 40), (9, 16)])
def test_bitwise_the_release(fmt, dtype, shape):
    op, block = CASES[fmt]
    x = draw(shape, seed=sum(shape) + len(fmt), dtype=dtype)
    assert_bitwise(op(x, block), quantization.quantize_cache(x, format=fmt, block_size=block))


def test_nvfp4_ties_go_to_the_even_code():
    # A block of max 6 has scale e4m3(1) = 1, so each value is its own normalized value: the
    # half-way points between E2M1 levels are exact ties.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0] * 2)
    for sign in (1, -1):
        out = nvfp4_quant_dequant(sign * ties)
        assert torch.equal(out, sign * expected)
        assert torch.equal(out, quantization.quantize_cache(sign * ties, format="nvfp4", block_size=16))


def test_fp8_levels_and_saturation():
    x = torch.tensor([448.0, -448.0, 1.0, 0.0] + [0.0] * 28)  # amax 448: scale 1, codes exact
    assert torch.equal(fp8_quant_dequant(x), x)
    big = torch.full((16,), 1e4)  # nvfp4 scale saturates at e4m3's 448
    assert torch.equal(nvfp4_quant_dequant(big), quantization.quantize_cache(big, format="nvfp4", block_size=16))


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_identity_gradient(fmt):
    op, block = CASES[fmt]
    x = draw((4, 64), seed=3, dtype=torch.float32).requires_grad_()
    grad = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    op(x, block).backward(grad)
    assert torch.equal(x.grad, grad)


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_non_finite_block_is_nan_and_stays_in_its_block(fmt):
    op, block = CASES[fmt]
    x = draw((2, 4 * block), seed=5, dtype=torch.float32)
    clean = op(x, block)
    for bad in (float("nan"), float("inf")):
        dirty = x.clone()
        dirty[1, block + 3] = bad
        out = op(dirty, block)
        assert torch.isnan(out[1, block : 2 * block]).all()
        keep = torch.ones_like(out, dtype=torch.bool)
        keep[1, block : 2 * block] = False
        assert torch.equal(out[keep], clean[keep])


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_argument_errors(fmt):
    op, _ = CASES[fmt]
    with pytest.raises(TypeError, match="x"):
        op([1.0, 2.0])
    with pytest.raises(TypeError, match="x"):
        op(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_size"):
        op(torch.ones(4), 0)
    with pytest.raises(ValueError, match="x"):
        op(torch.tensor(1.0))
