"""The fused quantize-dequantize kernels equal their torch references bit for bit.

On CPU the kernels run in Triton's interpreter (tests/conftest.py). Inputs: random values over
many magnitudes (subnormal scales to saturation), ragged channel counts with partial last blocks,
values placed exactly on rounding ties of E2M1 and E4M3, blocks holding NaN or inf, signed zeros,
fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from nemo_dsa.ops.quant import fp8_quant_dequant, mxfp4_quant_dequant, nvfp4_quant_dequant
from nemo_dsa.ops.quant.fused import _kernels

pytestmark = pytest.mark.skipif(_kernels() is None, reason="Triton is not installed (scripts/install.sh installs it)")

FORMATS = {
    "fp8": lambda x, backend: fp8_quant_dequant(x, backend=backend),
    "fp8-block16": lambda x, backend: fp8_quant_dequant(x, 16, backend=backend),
    "nvfp4": lambda x, backend: nvfp4_quant_dequant(x, backend=backend),
    "mxfp4": lambda x, backend: mxfp4_quant_dequant(x, backend=backend),
}
E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(channels: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for exponent in (-40, -20, -9, -3, 0, 3, 8, 12):
        rows.append(torch.randn(3, channels, generator=g) * 2.0**exponent)
    ties = torch.tensor(E2M1_TIES * (channels // len(E2M1_TIES) + 1))[:channels]
    rows.append((ties * torch.where(torch.rand(channels, generator=g) < 0.5, -1.0, 1.0))[None])
    # Each block's max 6 * 2^k (a power-of-two scale of 2^k), so the ties above land exactly.
    scaled = ties.clone()
    scaled[::16] = 6.0
    rows.append(scaled[None] * 2.0**-5)
    # E4M3 ties: 1 + 1/16 between 1 and 1.125, and subnormal ties (k + 1/2) * 2^-9, with max 448.
    e4m3 = torch.tensor([1.0625, 1.1875, 2.5 * 2.0**-9, 0.5 * 2.0**-9, 1.5 * 2.0**-9, 448.0] * channels)[:channels]
    e4m3[::32] = 448.0
    rows.append(e4m3[None])
    special = torch.randn(4, channels, generator=g)
    special[0, 0] = float("nan")
    special[1, -1] = float("inf")
    special[2, channels // 2] = float("-inf")
    special[3, :] = -0.0
    rows.append(special)
    return torch.cat(rows).to(_device())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a.masked_fill(nan, 0).view(view), b.masked_fill(nan, 0).view(view))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels", [5, 16, 70, 128, 512])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_kernel_equals_reference_bitwise(fmt, channels, dtype):
    x = _inputs(channels, seed=channels).to(dtype)
    ref = FORMATS[fmt](x, "torch")
    out = FORMATS[fmt](x, "triton")
    assert out.dtype == x.dtype and out.shape == x.shape
    assert _same_bits(out, ref), (out - ref).abs().nan_to_num().max()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_kernel_keeps_leading_dims_and_identity_gradient(fmt):
    x = torch.randn(2, 3, 5, 64, device=_device(), requires_grad=True)
    out = FORMATS[fmt](x, "triton")
    assert out.shape == x.shape
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad, torch.ones_like(x))


def test_empty_inputs_and_bad_backend():
    x = torch.zeros(0, 32, device=_device())
    assert FORMATS["mxfp4"](x, "triton").shape == (0, 32)
    with pytest.raises(ValueError, match="backend"):
        fp8_quant_dequant(torch.ones(2, 32), backend="cuda")
    with pytest.raises(ValueError, match="power-of-two"):
        fp8_quant_dequant(torch.ones(2, 30), 30, backend="triton")
