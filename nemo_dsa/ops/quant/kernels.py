"""Fused Triton kernels of the block quantize-dequantize formats: one read and one write of ``x``.

The torch references (``fp8.py``, ``nvfp4.py``, ``mxfp4.py``) build the result in a chain of
fp32 tensors (the padded blocks, their absolute values, the quotient, the E2M1 distances to all 8
levels, the codes): about twenty passes over ``x`` and an 8x wider intermediate. Each kernel here
takes ``BR`` rows of ``x [rows, C]`` in registers as ``[BR, blocks, block]``, finds every block's
maximum, scale and codes, and writes ``code * scale`` in ``x``'s dtype, equal bit for bit to the
reference (tests/ops/test_quant_kernels.py, on CPU through Triton's interpreter).

Every rounding is spelled out on the fp32 bits or with the add-and-subtract of a power of two
(round to nearest even in fp32 arithmetic), not left to a cast: Triton's interpreter truncates in
its float8 casts, and the CPU tests must see the GPU's arithmetic. Division is ``div_rn`` (the
default fp32 division on the GPU is approximate).
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8 = 0
NVFP4 = 1
MXFP4 = 2


@triton.jit
def _round_even(y):
    """``y >= 0`` (< 2^22) rounded to the nearest integer, ties to even, in fp32 arithmetic."""
    return (y + 8388608.0) - 8388608.0


@triton.jit
def _pow2_ceil(v):
    """The smallest power of two >= each positive normal ``v``, from its fp32 bits."""
    bits = v.to(tl.uint32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.uint32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(v):
    """``v >= 0`` rounded to float8 e4m3fn (nearest, ties to even; 448 at most): normals keep 3
    mantissa bits, values under 2^-6 round to a multiple of 2^-9."""
    bits = v.to(tl.uint32, bitcast=True)
    normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = _round_even(v * 512.0) * (1.0 / 512.0)
    return tl.minimum(tl.where(v < 0.015625, subnormal, normal), 448.0)


@triton.jit
def _round_e2m1(m):
    """``m`` in [0, 6] rounded to the nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, a tie going to the
    level of even code (the spacing is .5 below 2, 1 below 4, 2 above: rounding to even multiples
    of the spacing gives exactly those ties)."""
    return tl.where(m < 2.0, _round_even(m * 2.0) * 0.5, tl.where(m < 4.0, _round_even(m), _round_even(m * 0.5) * 2.0))


@triton.jit
def _quant_dequant(x_ptr, out_ptr, R, C, FORMAT: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                   BR: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, NB * BLOCK)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    offsets = rows[:, None].to(tl.int64) * C + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    blocks = tl.reshape(x, (BR, NB, BLOCK))
    magnitude = tl.abs(blocks)
    amax = tl.max(magnitude, axis=2)
    finite = tl.min((magnitude < float("inf")).to(tl.int32), axis=2)  # NaN and inf compare False
    if FORMAT == 0:  # fp8 e4m3, power-of-two scale from max(amax, 1e-4) * fp32(1 / 448)
        scale = _pow2_ceil(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
        q = tl.minimum(tl.div_rn(magnitude, scale[:, :, None]), 448.0)
        level = _round_e4m3(q)
    elif FORMAT == 1:  # nvfp4: e4m3 scale of max(amax, 6 * 2^-9) / 6
        scale = _round_e4m3(tl.div_rn(tl.maximum(amax, 6.0 * 0.001953125), 6.0))
        q = tl.minimum(tl.div_rn(magnitude, scale[:, :, None]), 6.0)
        level = _round_e2m1(q)
    else:  # mxfp4: power-of-two scale of max(amax, 6 * 2^-126) / 6
        scale = _pow2_ceil(tl.div_rn(tl.maximum(amax, 6.0 * 1.1754943508222875e-38), 6.0))
        q = tl.minimum(tl.div_rn(magnitude, scale[:, :, None]), 6.0)
        level = _round_e2m1(q)
    # x's sign bit onto the level (a negation would be 0 - level, turning -0.0 into +0.0)
    sign = blocks.to(tl.uint32, bitcast=True) & 0x80000000
    value = (level.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True) * scale[:, :, None]
    value = tl.where(finite[:, :, None] != 0, value, float("nan"))
    tl.store(out_ptr + offsets, tl.reshape(value, (BR, NB * BLOCK)).to(out_ptr.dtype.element_ty), mask=mask)
