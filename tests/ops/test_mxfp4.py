"""MXFP4 quantize-dequantize (nemo_dsa.ops.quant.mxfp4) against a scalar oracle of docs/semantics.md's rule."""

from __future__ import annotations

import math

import pytest
import torch

from _support.helpers import generator
from nemo_dsa.ops.quant import mxfp4_quant_dequant

_LEVELS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


_MANTISSA_BIT = [0, 1, 0, 1, 0, 1, 0, 1]  # E2M1 encodings 0b000..0b111 -> low bit


def _oracle_mxfp4_block(values: list[float]) -> list[float]:
    amax = max(max(abs(v) for v in values), 6 * 2.0**-126)
    scale = 2.0**-126
    while 6 * scale < amax:  # smallest power of two with scale >= amax / 6, exactly
        scale *= 2
    out = []
    for v in values:
        x = min(max(v / scale, -6.0), 6.0)
        candidates = [(abs(abs(x) - lv), _MANTISSA_BIT[n], lv) for n, lv in enumerate(_LEVELS)]
        _, _, level = min(candidates)  # nearest, then even mantissa
        out.append(math.copysign(level, x) * scale)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_matches_scalar_oracle(dtype):
    g = generator(500)
    x = torch.randn(3, 5, 96, generator=g) * torch.logspace(-30, 30, 96).view(1, 1, 96).roll(7)
    x[0, 0, :32] = 0.0  # all-zero block: scale clamps at 2^-126
    x[1, 1, 32:64] = torch.randn(32, generator=g) * 1e-40  # subnormal block
    x = x.to(dtype)
    got = mxfp4_quant_dequant(x)
    assert got.dtype == dtype and got.shape == x.shape
    blocks = x.float().reshape(-1, 32).tolist()
    want = torch.tensor([_oracle_mxfp4_block(b) for b in blocks], dtype=torch.float64).view(x.shape).to(dtype)
    assert torch.equal(got, want)


def test_mxfp4_tie_table_and_gradient():
    # Block max 6 -> scale 1, so each value below is x/scale itself.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x = torch.tensor(([6.0] + ties + [-t for t in ties]) + [0.0] * 17)
    got = mxfp4_quant_dequant(x)
    assert got[1:8].tolist() == expect and got[8:15].tolist() == [-e for e in expect]
    assert mxfp4_quant_dequant(torch.tensor([7.0, 0.5, 1.5] + [0.0] * 29))[:3].tolist() == [8.0, 0.0, 2.0]  # scale 2
    # Scale boundary: amax exactly 6 * 2^k keeps 2^k; the next fp32 above it needs 2^(k+1).
    for k in (-100, -3, 0, 20):
        on = torch.tensor([6.0 * 2.0**k, 1.5 * 2.0**k] + [0.0] * 30)
        above = on.clone()
        above[0] = torch.nextafter(on[0], torch.tensor(float("inf")))
        assert mxfp4_quant_dequant(on)[:2].tolist() == [6.0 * 2.0**k, 1.5 * 2.0**k]
        assert mxfp4_quant_dequant(above)[:2].tolist() == [6.0 * 2.0**k, 2.0 * 2.0**k]  # 0.75 -> 1, scale 2^(k+1)
    y = torch.randn(4, 64, requires_grad=True)
    upstream = torch.randn(4, 64)
    mxfp4_quant_dequant(y).backward(upstream)
    assert torch.equal(y.grad, upstream)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_mxfp4_non_finite_block_becomes_nan(bad):
    x = torch.randn(2, 64, generator=generator(7))
    x[1, 40] = bad  # second block of row 1
    y = mxfp4_quant_dequant(x)
    assert torch.isnan(y[1, 32:]).all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[1, :32]).all()


@pytest.mark.parametrize("channels", [1, 20, 48, 80])
def test_mxfp4_short_last_block_counts_as_zero_filled(channels):
    """Channels not a multiple of 32 (the built-in accepts such index head dims): the last block is
    scaled and rounded as if zeros filled it to 32, as the release pads it."""
    x = torch.randn(3, channels, generator=generator(channels)) * 4
    padded = torch.nn.functional.pad(x, (0, -channels % 32))
    want = torch.tensor([_oracle_mxfp4_block(b) for b in padded.reshape(-1, 32).tolist()]).view(padded.shape)
    assert torch.equal(mxfp4_quant_dequant(x), want[:, :channels])


def test_mxfp4_arguments():
    with pytest.raises(ValueError, match="x must have a channel dimension"):
        mxfp4_quant_dequant(torch.tensor(1.0))
    with pytest.raises(TypeError, match="x must"):
        mxfp4_quant_dequant(torch.ones(4, 32, dtype=torch.int32))
