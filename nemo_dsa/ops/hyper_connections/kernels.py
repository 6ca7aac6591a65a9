"""Fused Triton kernels of the hyper-connection parts (references in ``naive.py``).

Why Triton here: these parts are memory-bound passes over the ``[T, M, D]`` bf16 streams with a
few tiny reductions (over the width for the mix and the gradients of the per-token coefficients);
each is a handful of lines in Triton, and ``TRITON_INTERPRET=1`` runs the very same kernels on the
CPU, so CI checks their arithmetic against the references without a GPU.

What each kernel reads and writes, per token (M streams of width D, K = M * D):
- ``_mix_forward``: the streams once (2K bytes), writes W + 1 fp32 (the mix and 1/RMS). The
  built-in's fp32 copy and normalised copy of the streams (8K bytes each, kept for the backward)
  never exist.
- ``_mix_backward_streams`` / ``_mix_backward_fn``: the streams once each; the gradient of the
  streams from the projection and the RMS in one epilogue (``g @ fn - c * x``).
- ``_collapse_forward`` / ``_collapse_backward``: the streams once.
- ``_expand_forward`` / ``_expand_backward``: the streams and the sublayer output once, the new
  streams (or their gradient) once; the comb product as 4 x 4 FMAs a column, never a batched GEMM.
Every program's offsets are int64 (T * K passes 2^31 at long sequences). Every rounding to bf16
goes through ``_round_bf16`` (round to nearest even on the bits): Triton's interpreter truncates in
``.to(tl.bfloat16)``, and the CPU tests must see the GPU's rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), as fp32 (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mix_forward(x_ptr, fn_t_ptr, mix_ptr, rstd_ptr, T, K, eps,
                 W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """mix[t, :W] = rstd[t] * (x[t] @ fn_t), rstd[t] = 1 / sqrt(mean(x[t]^2) + eps)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    row_ok = rows < T
    cols = tl.arange(0, WP)
    acc = tl.zeros((BT, WP), tl.float32)
    squares = tl.zeros((BT,), tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(fn_t_ptr + ks[:, None].to(tl.int64) * WP + cols[None, :], mask=k_ok[:, None], other=0.0)
        acc += tl.dot(x, w, input_precision="ieee")
        squares += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt_rn(squares / K + eps)
    tl.store(mix_ptr + rows[:, None].to(tl.int64) * W + cols[None, :], acc * rstd[:, None],
             mask=row_ok[:, None] & (cols[None, :] < W))  # fmt: skip
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _mix_backward_streams(g_ptr, fn_ptr, x_ptr, coef_ptr, dx_ptr, T, K,
                          WP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """dx[t, k] = sum_j g[t, j] fn[j, k] - coef[t] x[t, k] (g: the mix's gradient times rstd)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    ks = tl.program_id(1) * BK + tl.arange(0, BK)
    row_ok = rows < T
    k_ok = ks < K
    cols = tl.arange(0, WP)
    g = tl.load(g_ptr + rows[:, None].to(tl.int64) * WP + cols[None, :], mask=row_ok[:, None], other=0.0)
    w = tl.load(fn_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], mask=k_ok[None, :], other=0.0)
    offsets = rows[:, None].to(tl.int64) * K + ks[None, :]
    mask = row_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
    dx = tl.dot(g, w, input_precision="ieee") - coef[:, None] * x
    tl.store(dx_ptr + offsets, _round_bf16(dx).to(tl.bfloat16), mask=mask)


@triton.jit
def _mix_backward_fn(g_ptr, x_ptr, dfn_ptr, T, K, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr):  # fmt: skip
    """dfn[j, k] = sum_t g[t, j] x[t, k]: one program a column block, looping over the tokens."""
    ks = tl.program_id(0) * BK + tl.arange(0, BK)
    k_ok = ks < K
    cols = tl.arange(0, WP)
    acc = tl.zeros((WP, BK), tl.float32)
    for t0 in range(0, T, BT):
        rows = t0 + tl.arange(0, BT)
        row_ok = rows < T
        g_t = tl.load(g_ptr + rows[None, :].to(tl.int64) * WP + cols[:, None], mask=row_ok[None, :], other=0.0)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        acc += tl.dot(g_t, x, input_precision="ieee")
    tl.store(dfn_ptr + cols[:, None].to(tl.int64) * K + ks[None, :], acc, mask=(cols[:, None] < W) & k_ok[None, :])


@triton.jit
def _collapse_forward(x_ptr, pre_ptr, out_ptr, D, M: tl.constexpr, MP: tl.constexpr, BD: tl.constexpr):
    """out[t, d] = sum_m pre[t, m] x[t, m, d], in fp32, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    ms = tl.arange(0, MP)
    mask = (ms[:, None] < M) & (ds[None, :] < D)
    x = tl.load(x_ptr + (t * M + ms[:, None]) * D + ds[None, :], mask=mask, other=0.0).to(tl.float32)
    pre = tl.load(pre_ptr + t * M + ms, mask=ms < M, other=0.0)
    out = tl.sum(pre[:, None] * x, axis=0)
    tl.store(out_ptr + t * D + ds, _round_bf16(out).to(tl.bfloat16), mask=ds < D)


@triton.jit
def _collapse_backward(x_ptr, pre_ptr, dout_ptr, dx_ptr, dpre_ptr, D, M: tl.constexpr, MP: tl.constexpr,
                       BD: tl.constexpr):  # fmt: skip
    """dx[t, m, d] = pre[t, m] dout[t, d]; dpre[t, m] = sum_d dout[t, d] x[t, m, d] (one program a token)."""
    t = tl.program_id(0).to(tl.int64)
    ms = tl.arange(0, MP)
    pre = tl.load(pre_ptr + t * M + ms, mask=ms < M, other=0.0)
    dpre = tl.zeros((MP,), tl.float32)
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        mask = (ms[:, None] < M) & (ds[None, :] < D)
        offsets = (t * M + ms[:, None]) * D + ds[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(dout_ptr + t * D + ds, mask=ds < D, other=0.0).to(tl.float32)
        dpre += tl.sum(dout[None, :] * x, axis=1)
        tl.store(dx_ptr + offsets, _round_bf16(pre[:, None] * dout[None, :]).to(tl.bfloat16), mask=mask)
    tl.store(dpre_ptr + t * M + ms, dpre, mask=ms < M)


@triton.jit
def _expand_forward(a_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, D, M: tl.constexpr, MP: tl.constexpr,
                    BD: tl.constexpr, ROUND_TERMS: tl.constexpr):  # fmt: skip
    """out[t, n, d] = post[t, n] a[t, d] + sum_m comb[t, m, n] x[t, m, d]."""
    t = tl.program_id(0).to(tl.int64)
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    ms = tl.arange(0, MP)
    d_ok = ds < D
    m_ok = ms < M
    mask = m_ok[:, None] & d_ok[None, :]
    x = tl.load(x_ptr + (t * M + ms[:, None]) * D + ds[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + t * D + ds, mask=d_ok, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * M + ms, mask=m_ok, other=0.0)
    comb = tl.load(comb_ptr + t * M * M + ms[:, None] * M + ms[None, :], mask=m_ok[:, None] & m_ok[None, :],
                   other=0.0)  # [source m, target n]  # fmt: skip
    if ROUND_TERMS:
        post = _round_bf16(post)
        comb = _round_bf16(comb)
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [n, BD]
    update = post[:, None] * a[None, :]
    if ROUND_TERMS:
        mixed = _round_bf16(mixed)
        update = _round_bf16(update)
    tl.store(out_ptr + (t * M + ms[:, None]) * D + ds[None, :], _round_bf16(update + mixed).to(tl.bfloat16),
             mask=mask)  # fmt: skip


@triton.jit
def _expand_backward(a_ptr, x_ptr, post_ptr, comb_ptr, dout_ptr, da_ptr, dx_ptr, dpost_ptr, dcomb_ptr, D,
                     M: tl.constexpr, MP: tl.constexpr, BD: tl.constexpr, ROUND_TERMS: tl.constexpr):  # fmt: skip
    """The gradients of ``_expand_forward`` (one program a token): da, dx over the width, dpost and
    dcomb summed over it. With ROUND_TERMS the products autograd rounds to bf16 are rounded too."""
    t = tl.program_id(0).to(tl.int64)
    ms = tl.arange(0, MP)
    m_ok = ms < M
    post = tl.load(post_ptr + t * M + ms, mask=m_ok, other=0.0)
    comb = tl.load(comb_ptr + t * M * M + ms[:, None] * M + ms[None, :], mask=m_ok[:, None] & m_ok[None, :],
                   other=0.0)  # fmt: skip
    if ROUND_TERMS:
        post = _round_bf16(post)
        comb = _round_bf16(comb)
    dpost = tl.zeros((MP,), tl.float32)
    dcomb_t = tl.zeros((MP, MP), tl.float32)  # [target n, source m]
    for d0 in range(0, D, BD):
        ds = d0 + tl.arange(0, BD)
        d_ok = ds < D
        mask = m_ok[:, None] & d_ok[None, :]
        offsets = (t * M + ms[:, None]) * D + ds[None, :]
        dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # [n, BD]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # [m, BD]
        a = tl.load(a_ptr + t * D + ds, mask=d_ok, other=0.0).to(tl.float32)
        scaled = dout * post[:, None]
        by_a = dout * a[None, :]
        if ROUND_TERMS:
            scaled = _round_bf16(scaled)
            by_a = _round_bf16(by_a)
        tl.store(da_ptr + t * D + ds, _round_bf16(tl.sum(scaled, axis=0)).to(tl.bfloat16), mask=d_ok)
        dx = tl.sum(comb[:, :, None] * dout[None, :, :], axis=1)  # [m, BD]
        tl.store(dx_ptr + offsets, _round_bf16(dx).to(tl.bfloat16), mask=mask)
        dpost += tl.sum(by_a, axis=1)
        dcomb_t += tl.sum(dout[:, None, :] * x[None, :, :], axis=2)
    if ROUND_TERMS:
        dpost = _round_bf16(dpost)
        dcomb_t = _round_bf16(dcomb_t)
    tl.store(dpost_ptr + t * M + ms, dpost, mask=m_ok)
    # dcomb[m, n] = dcomb_t[n, m]
    tl.store(dcomb_ptr + t * M * M + ms[None, :] * M + ms[:, None], dcomb_t, mask=m_ok[:, None] & m_ok[None, :])
