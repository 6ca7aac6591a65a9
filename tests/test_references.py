"""The torch references against independent formulas and brute-force oracles (CPU)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from causal_layouts import random_ks_ke
from nemo_dsa.ops.mxfp4 import mxfp4_quant_dequant
from nemo_dsa.ops.topk import blocks_to_mask, candidate_block_mask, candidate_blocks, select_topk_reference
from nemo_dsa.ops.v4_indexer import v4_backward, v4_backward_chunk_size, v4_logits, v4_logits_chunk_size
from nemo_dsa.ops.v41_indexer import v41_scores, v41_scores_chunk_size

SHAPES = [(1, 7, 1, 16, 5), (2, 33, 4, 32, 9), (3, 50, 8, 48, 13)]  # B, S, H, D, K (ragged)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(b, s, h, d, k, g, w_dtype=torch.float32):
    q = torch.randn(b, s, h, d, generator=g).bfloat16()
    keys = torch.randn(b, k, d, generator=g).bfloat16()
    w = (torch.randn(b, s, h, generator=g) * h**-0.5).to(w_dtype)
    return q, keys, w


def _dense_mask(ks, ke, k):
    j = torch.arange(k)
    return (j >= ks[..., None]) & (j < ke[..., None])


# ---------------------------------------------------------------------------- V4 forward
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("budget", [None, 1])
def test_v4_logits_match_float64(shape, budget):
    g = _gen(sum(shape))
    q, k, w = _inputs(*shape, g)
    ks, ke = random_ks_ke(shape[0], shape[1], shape[4], g)
    kwargs = {} if budget is None else {"budget_bytes": budget}  # budget 1 -> one query per chunk
    out = v4_logits(q, k, w, ks, ke, **kwargs)
    assert out.dtype == torch.float32
    dots = torch.einsum("bshd,btd->bsht", q.double(), k.double())
    ref = (dots.relu() * w.double()[..., None]).sum(2)
    scale = (dots.abs() * w.double().abs()[..., None]).sum(2)  # condition of the sum
    mask = _dense_mask(ks, ke, shape[4])
    assert torch.equal(torch.isinf(out), ~mask) and bool((out[~mask] < 0).all())
    err = (out.double() - ref).abs()[mask]
    assert bool((err <= 1e-5 * scale[mask] + 1e-30).all()), float((err / scale[mask]).max())


def test_chunk_sizes_bound_the_full_size_intermediates():
    s, k, h, d, t, budget = 16384, 4096, 64, 128, 2048, 256 * 2**20
    chunk = v4_logits_chunk_size(s, h, k, budget)
    assert 1 <= chunk < s and chunk * h * k * 4 <= budget < (chunk + 1) * h * k * 4
    chunk = v4_backward_chunk_size(s, h, t, d, budget)
    assert 1 <= chunk < s and chunk * (2 * t * d + 3 * h * t) * 8 <= budget
    chunk = v41_scores_chunk_size(1, s, h, k, budget)
    assert 1 <= chunk < s and chunk * h * k * 2 * 3 <= budget
    assert v4_logits_chunk_size(5, h, k, 1) == 1  # never below one query
    assert v4_logits_chunk_size(5, 1, 1, budget) == 5  # never above S


# ---------------------------------------------------------------------------- V4 backward
def _dense_v4(q, k, w, ks, ke):
    logits = (torch.einsum("bshd,btd->bsht", q, k).relu() * w[..., None]).sum(2)
    return logits.masked_fill(~_dense_mask(ks, ke, k.shape[1]), float("-inf"))


def _random_indices(b, s, t, k, g):
    """Distinct random keys per query, some -1 and some possibly invisible (they carry no gradient)."""
    idx = torch.stack([torch.randperm(k, generator=g)[:t] for _ in range(b * s)]).view(b, s, t)
    idx[torch.rand(b, s, t, generator=g) < 0.2] = -1
    return idx.to(torch.int32)


def _autograd_grads(q, k, w, ks, ke, idx, grad):
    q, k, w = (x.detach().requires_grad_() for x in (q, k, w))
    logits = _dense_v4(q, k, w, ks, ke)
    present = idx >= 0
    gathered = logits.gather(-1, torch.where(present, idx, 0).long())
    live = present & torch.isfinite(gathered)
    (torch.where(live, gathered, 0.0) * grad).sum().backward()
    return q.grad, k.grad, w.grad


@pytest.mark.parametrize("shape", SHAPES)
def test_v4_backward_matches_autograd_float64(shape):
    b, s, h, d, k = shape
    g = _gen(100 + s)
    q, keys, w = (x.double() for x in _inputs(b, s, h, d, k, g))
    ks, ke = random_ks_ke(b, s, k, g)
    t = min(4, k)
    idx = _random_indices(b, s, t, k, g)
    grad = torch.randn(b, s, t, generator=g, dtype=torch.float64)
    got = v4_backward(q, keys, w, ks, ke, idx, grad, budget_bytes=2000)  # several chunks
    want = _autograd_grads(q, keys, w, ks, ke, idx, grad)
    for a, e in zip(got, want):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    empty = ks == ke
    assert bool((got[0][empty] == 0).all()) and bool((got[2][empty] == 0).all())


def test_v4_backward_dtypes_and_fp32_accuracy():
    b, s, h, d, k = 2, 40, 4, 32, 10
    g = _gen(7)
    q, keys, w = _inputs(b, s, h, d, k, g)
    ks, ke = random_ks_ke(b, s, k, g)
    idx = _random_indices(b, s, 6, k, g)
    grad = torch.randn(b, s, 6, generator=g)
    dq, dk, dw = v4_backward(q, keys, w, ks, ke, idx, grad)
    assert (dq.dtype, dk.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    want = _autograd_grads(q.double(), keys.double(), w.double(), ks, ke, idx, grad.double())
    torch.testing.assert_close(dw.double(), want[2], rtol=1e-5, atol=1e-6)
    for a, e in ((dq, want[0]), (dk, want[1])):  # one bf16 rounding of an fp32-accurate value
        torch.testing.assert_close(a.double(), e, rtol=2**-8, atol=1e-6)


# ---------------------------------------------------------------------------- V4.1
def _v41_formula(q, k, w):
    return torch.einsum("bshd,btd->bsht", q, k).relu().mul(w[..., None]).sum(2)


@pytest.mark.parametrize("shape", SHAPES + [(2, 64, 16, 64, 32)])
def test_v41_scores_bitwise_formula(shape):
    g = _gen(200 + sum(shape))
    q, k, w = _inputs(*shape, g, w_dtype=torch.bfloat16)
    ks, ke = random_ks_ke(shape[0], shape[1], shape[4], g)
    want = _v41_formula(q, k, w).masked_fill(~_dense_mask(ks, ke, shape[4]), float("-inf"))
    with torch.no_grad():
        for budget in (None, 1, 3 * shape[0] * shape[2] * shape[4] * 2 * 5):  # unchunked, 1, 5 rows
            got = v41_scores(q, k, w, ks, ke, **({} if budget is None else {"budget_bytes": budget}))
            assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not v41_scores(q.requires_grad_(), k, w, ks, ke).requires_grad


# ---------------------------------------------------------------------------- top-k
def _brute_topk(row: list[float], t: int, order: str) -> list[int]:
    finite = [j for j, v in enumerate(row) if math.isfinite(v)]
    best = sorted(finite, key=lambda j: (-row[j], j))[:t]
    if order == "index":
        best.sort()
    return best + [-1] * (t - len(best))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["score", "index"])
@pytest.mark.parametrize("quantised", [False, True])
def test_select_topk_brute_force(dtype, order, quantised):
    g = _gen(300)
    for b, s, k, topk in [(2, 9, 17, 5), (1, 6, 4, 7), (3, 5, 33, 33)]:
        scores = torch.randint(-3, 4, (b, s, k), generator=g).float() if quantised else torch.randn(b, s, k, generator=g)
        scores = scores.to(dtype)
        scores[torch.rand(b, s, k, generator=g) < 0.3] = float("-inf")
        scores[:, 0] = float("-inf")  # a query that sees nothing
        got = select_topk_reference(scores, topk, order=order, budget_bytes=24 * k * 2)  # two rows per chunk
        t = min(topk, k)
        assert got.dtype == torch.int32 and got.shape == (b, s, t)
        rows = scores.float().reshape(-1, k).tolist()
        want = torch.tensor([_brute_topk(r, t, order) for r in rows], dtype=torch.int32).view(b, s, t)
        assert torch.equal(got, want)
        # Same score multiset as torch.topk over the finite entries.
        ref = torch.topk(scores.float(), t, dim=-1).values
        mine = torch.where(got >= 0, scores.float().gather(-1, got.clamp(min=0).long()), float("-inf"))
        assert torch.equal(mine.sort(-1).values, ref.sort(-1).values)


@pytest.mark.parametrize("order", ["score", "index"])
def test_select_topk_redoes_only_rows_its_candidates_cannot_decide(order, monkeypatch):
    """Ties inside the T + TIE_MARGIN candidates are decided by their keys; a run of more ties at
    the cut than the margin holds, or NaN/+inf in the row, sends the row through full-row keys.
    All rows match the brute force either way."""
    from nemo_dsa.ops.topk import rows

    g = _gen(301)
    width = 3 * rows.TIE_MARGIN
    scores = torch.randn(6, width, generator=g)
    scores[1, [3, 9, 17, 30]] = 5.0  # four-way tie at the top, cut at T=2: within the margin
    scores[2, : rows.TIE_MARGIN + 5] = 7.0  # more copies of the T-th score than the margin
    scores[3, 11] = float("nan")
    scores[4, 12] = float("inf")
    scores[5, ::2] = float("-inf")
    redone = []
    exact = rows.select_rows_by_keys
    monkeypatch.setattr(rows, "select_rows_by_keys", lambda x, c, o: redone.append(x.shape[0]) or exact(x, c, o))
    got = select_topk_reference(scores, 2, order=order)
    assert redone == [3]  # rows 2, 3 and 4
    want = torch.tensor([_brute_topk(r, 2, order) for r in scores.tolist()], dtype=torch.int32)
    assert torch.equal(got, want)


def test_select_topk_zero_signs_nan_and_inf_rules():
    scores = torch.tensor([[0.0, -0.0, float("nan"), float("inf"), -1.0, -0.0]])
    assert select_topk_reference(scores, 4).tolist() == [[0, 1, 5, 4]]  # -0 ties +0 by index; nan/inf unselected
    assert select_topk_reference(scores, 6, order="index").tolist() == [[0, 1, 4, 5, -1, -1]]
    assert select_topk_reference(torch.empty(2, 3, 0), 4).shape == (2, 3, 0)


def _brute_candidates(scores, ks, ke, c, nb_keep):
    b, s, k = scores.shape
    nb = -(-k // c)
    out = torch.full((b, s, min(nb_keep, nb)), -1, dtype=torch.int32)
    mask = torch.zeros(b, s, k, dtype=torch.bool)
    for bi, si in itertools.product(range(b), range(s)):
        lo, hi = int(ks[bi, si]), int(ke[bi, si])
        if hi == lo:
            continue
        blocks = {}
        for j in range(lo, hi):
            v = float(scores[bi, si, j])
            n = (j - lo) // c
            blocks.setdefault(n, float("-inf"))
            if math.isfinite(v):
                blocks[n] = max(blocks[n], v)
        last = (hi - 1 - lo) // c
        others = sorted((n for n in blocks if n != last and math.isfinite(blocks[n])), key=lambda n: (-blocks[n], n))
        kept = sorted([last] + others[: nb_keep - 1])
        out[bi, si, : len(kept)] = torch.tensor(kept, dtype=torch.int32)
        for j in range(lo, hi):
            mask[bi, si, j] = (j - lo) // c in kept
    return out, mask


@pytest.mark.parametrize("c,nb_keep", [(3, 2), (4, 1), (2, 5), (16, 3)])
def test_candidate_blocks_brute_force(c, nb_keep):
    g = _gen(400 + c)
    b, s, k = 2, 20, 23
    scores = torch.randint(-4, 5, (b, s, k), generator=g).float().bfloat16()  # ties across blocks
    ks, ke = random_ks_ke(b, s, k, g)
    scores = scores.masked_fill(~_dense_mask(ks, ke, k), float("-inf"))
    scores[0, 3, int(ks[0, 3]) : int(ke[0, 3])] = float("-inf")  # visible but unscored keys
    want_blocks, want_mask = _brute_candidates(scores, ks, ke, c, nb_keep)
    got = candidate_blocks(scores, ks, ke, c, nb_keep, budget_bytes=1000)
    assert torch.equal(got, want_blocks)
    assert torch.equal(candidate_block_mask(scores, ks, ke, c, nb_keep), want_mask)
    assert torch.equal(blocks_to_mask(got, ks, ke, c, k, budget_bytes=1), want_mask)


# ---------------------------------------------------------------------------- MXFP4
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
    g = _gen(500)
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
    x = torch.randn(2, 64, generator=_gen(7))
    x[1, 40] = bad  # second block of row 1
    y = mxfp4_quant_dequant(x)
    assert torch.isnan(y[1, 32:]).all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[1, :32]).all()


@pytest.mark.parametrize("new_api_first", [True, False])
def test_ieee_fp32_matmul_restores_tf32_setting(monkeypatch, new_api_first):
    """The V4 reference turns TF32 off around its matmuls whichever torch API enabled it."""
    from nemo_dsa.precision import ieee_fp32_matmul

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        if new_api_first:
            matmul.fp32_precision = "tf32"
        else:
            matmul.allow_tf32 = True
        with ieee_fp32_matmul():
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = before


# ---------------------------------------------------------------------------- on CUDA
@pytest.mark.gpu
def test_references_on_cuda_match_cpu():
    """Same references on CUDA tensors: exact selection/blocks/MXFP4/V4.1, V4 fp32 even with TF32 on."""
    b, s, h, d, k = 2, 300, 8, 64, 77
    g = _gen(600)
    q, keys, w = _inputs(b, s, h, d, k, g)
    ks, ke = random_ks_ke(b, s, k, g)
    cuda = [x.cuda() for x in (q, keys, w, ks, ke)]
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # the reference must not use it
    try:
        logits = v4_logits(*cuda).cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert torch.backends.cuda.matmul.allow_tf32 == previous
    dots = torch.einsum("bshd,btd->bsht", q.double(), keys.double())
    ref = (dots.relu() * w.double()[..., None]).sum(2)
    scale = (dots.abs() * w.double().abs()[..., None]).sum(2)
    mask = _dense_mask(ks, ke, k)
    assert torch.equal(torch.isinf(logits), ~mask)
    assert bool(((logits.double() - ref).abs()[mask] <= 1e-5 * scale[mask] + 1e-30).all())
    w16 = w.bfloat16()
    on_gpu = v41_scores(cuda[0], cuda[1], w16.cuda(), cuda[3], cuda[4])
    formula = _v41_formula(cuda[0], cuda[1], w16.cuda()).masked_fill(~mask.cuda(), float("-inf"))
    assert torch.equal(on_gpu, formula)
    scores = torch.randint(-3, 4, (b, s, k), generator=g).float().masked_fill(~mask, float("-inf"))
    for order in ("score", "index"):
        assert torch.equal(select_topk_reference(scores.cuda(), 9, order).cpu(), select_topk_reference(scores, 9, order))
    assert torch.equal(candidate_blocks(scores.cuda(), *cuda[3:], 4, 3).cpu(), candidate_blocks(scores, ks, ke, 4, 3))
    x = torch.randn(64, 128, generator=g) * 3
    assert torch.equal(mxfp4_quant_dequant(x.cuda()).cpu(), mxfp4_quant_dequant(x))
    idx = _random_indices(b, s, 6, k, g)
    grad = torch.randn(b, s, 6, generator=g)
    got = v4_backward(*cuda, idx.cuda(), grad.cuda())
    want = v4_backward(q, keys, w, ks, ke, idx, grad)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.cpu().float(), e.float(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("order", ["score", "index"])
@pytest.mark.parametrize("topk", [1, 64, 200, 300])
def test_select_topk_bf16_cut_with_many_ties(order, topk):
    """bf16 rows find their cut and decide ties among the scores at or above it: heavy ties at the
    cut, -0/+0, rows with fewer finite scores than T, NaN/+inf rows (the full key path)."""
    g = _gen(302 + topk)
    scores = (torch.randint(-40, 41, (12, 300), generator=g) / 8).bfloat16()
    scores[torch.rand(scores.shape, generator=g) < 0.1] = float("-inf")
    scores[torch.rand(scores.shape, generator=g) < 0.05] = -0.0
    scores[3, 50:] = float("-inf")  # fewer finite scores than most T
    scores[5, 7] = float("nan")
    scores[6, 9] = float("inf")
    got = select_topk_reference(scores, topk, order=order)
    want = torch.tensor([_brute_topk(r, topk, order) for r in scores.float().tolist()], dtype=torch.int32)
    assert torch.equal(got, want)
