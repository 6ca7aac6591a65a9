"""V4.1 TileLang scorer against the torch formula (H200 only: ``pytest -m gpu``).

Criterion (docs/semantics.md "Index scoring", V4.1): identical -inf pattern; finite scores bitwise equal to
``einsum('bshd,btd->bsht', q, k).relu().mul(w[..., None]).sum(2)`` except where only the order of
the fp32 accumulation orders differ (see ``assert_v41_equal``; >= 99.999 % bitwise at the
model's shape). Outputs are poisoned with NaN before the kernel writes them.
"""

import zlib

import pytest
import torch
from _support.helpers import KERNEL_LAYOUTS, indexer_inputs, kernel_layout_ks_ke
from _support.helpers import KERNEL_RATIO as RATIO

from nemo_dsa.visibility import causal_ks_ke, visible_mask

pytestmark = pytest.mark.gpu

# (heads, index_dim): every head count, both main dims, a padded dim (80 -> 128) and D = 256;
# 2 and 4 heads take the register head sum, 8 and more the tensor-core one.
HEAD_CONFIGS = [(2, 128), (4, 64), (8, 64), (16, 128), (32, 80), (64, 128), (128, 64), (64, 256)]


def _formula(q, k, w, allowed):
    """docs/semantics.md's formula on bf16 tensors, query-chunked (each chunk is the unchunked formula).

    Also returns, in float64, the exact head sum of the bf16 per-head terms and the sum of their
    magnitudes: the yardstick for scores where only the fp32 summation order differs.
    """
    out = torch.empty(allowed.shape, dtype=torch.bfloat16, device=q.device)
    exact = torch.empty(allowed.shape, dtype=torch.float64, device=q.device)
    magnitude = torch.empty_like(exact)
    for s in range(0, q.shape[1], 64):
        terms = torch.einsum("bshd,btd->bsht", q[:, s : s + 64], k).relu().mul(w[:, s : s + 64, :, None])
        out[:, s : s + 64] = terms.sum(2).masked_fill(~allowed[:, s : s + 64], float("-inf"))
        exact[:, s : s + 64] = terms.double().sum(2)
        magnitude[:, s : s + 64] = terms.double().abs().sum(2)
    return out, exact, magnitude


def assert_v41_equal(got, reference, max_fraction: float = 5e-4) -> None:
    """Same -inf pattern, no NaN; finite scores bitwise equal but for ``max_fraction`` of them,
    and those only as far as the bf16 boundaries allow.

    The tensor cores and cuBLAS accumulate each dot product in different fp32 orders, so a
    per-head ``bf16(q.k)`` that lands on a rounding boundary may come out one bf16 ulp apart
    (and ``r_h`` with it); with signed weights the head sum can cancel far below its terms, so
    the score can move by more than one ulp of itself. Bound per differing score: one ulp of
    the score, two ulps of every per-head term (s_h's ulp carried through w, then r_h's own
    rounding: <= 2^-6 * sum|r_h|) and the fp32 reordering of the head sum (heads * 2^-24 *
    sum|r_h|). A wrong weight, relu or range breaks this almost
    everywhere; the fraction limit catches systematic drift.
    """
    want, _, magnitude = reference
    assert not torch.isnan(got).any(), "NaN in the output (an element the kernel did not write?)"
    got_inf, want_inf = torch.isneginf(got), torch.isneginf(want)
    assert torch.equal(got_inf, want_inf), f"-inf pattern differs at {int((got_inf != want_inf).sum())} elements"
    finite = ~want_inf
    g, r, m = got[finite].double(), want[finite].double(), magnitude[finite]
    unequal = g != r  # float equality: +0 == -0
    count = int(unequal.sum())
    if count:
        g_u, r_u, m_u = g[unequal], r[unequal], m[unequal]
        big = torch.maximum(g_u.abs(), r_u.abs()).clamp_min(2.0**-126)
        ulp = torch.exp2(torch.floor(torch.log2(big)) - 7)  # bf16 keeps 8 significant bits
        excess = (g_u - r_u).abs() - (ulp + (2.0**-6 + 128 * 2.0**-24) * m_u)
        assert float(excess.max()) <= 0, f"a score is off by more than bf16 rounding allows ({float(excess.max()):.3g})"
    assert count <= max_fraction * g.numel(), f"{count} of {g.numel()} scores not bitwise equal"


@pytest.mark.parametrize("heads,dim", HEAD_CONFIGS)
@pytest.mark.parametrize("layout,batch,queries,num_keys", KERNEL_LAYOUTS)
def test_range_scores_match_formula(heads, dim, layout, batch, queries, num_keys):
    from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

    gen = torch.Generator().manual_seed(zlib.crc32(f"{heads}/{dim}/{layout}".encode()))
    ks, ke, num_keys = kernel_layout_ks_ke(layout, batch, queries, num_keys, "cuda", gen)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, gen, w_scale="fan_in", w_dtype=torch.bfloat16, device="cuda")
    out = torch.full((batch, queries, num_keys), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = v41_scores_tilelang(q, k, w, ks, ke, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_v41_equal(got, _formula(q, k, w, visible_mask(ks, ke, num_keys)))


@pytest.mark.parametrize("heads,dim", [(16, 128), (128, 64), (64, 256)])
@pytest.mark.parametrize("mask_kind", ["range", "random", "holes"])
def test_masked_scores_honour_mask_elementwise(heads, dim, mask_kind):
    from nemo_dsa.ops.v41_indexer.kernels import v41_scores_masked_tilelang

    gen = torch.Generator().manual_seed(7 + heads + dim)
    batch, queries, num_keys = 2, 411, 389
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, gen, w_scale="fan_in", w_dtype=torch.bfloat16, device="cuda")
    ks, ke = causal_ks_ke(batch, queries, num_keys, 1, torch.device("cuda"))
    allowed = visible_mask(ks, ke, num_keys)
    if mask_kind == "random":  # not a range at all, some rows empty
        allowed = torch.rand(batch, queries, num_keys, generator=gen).cuda() < 0.3
        allowed[:, ::7] = False
    elif mask_kind == "holes":  # causal ranges with random holes and a far-away lone key
        allowed &= torch.rand(batch, queries, num_keys, generator=gen).cuda() < 0.9
        allowed[:, 3, num_keys - 1] = True
    out = torch.full((batch, queries, num_keys), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = v41_scores_masked_tilelang(q, k, w, allowed, out=out)
    assert_v41_equal(got, _formula(q, k, w, allowed))


@pytest.mark.parametrize("heads", [64, 8])
def test_every_key_tile_count(heads):
    """Query tiles that walk 0, 1, 2, ... 9 key tiles (both consumers' turns, odd and even counts,
    partial last tiles; rows of one tile see different ranges) match the formula."""
    from nemo_dsa.ops.v41_indexer.kernels import BLOCK_K, GEMM_COLUMNS, v41_scores_tilelang

    gen = torch.Generator().manual_seed(heads)
    block_q = GEMM_COLUMNS // heads
    batch, queries, num_keys = 2, 10 * block_q + 3, 9 * BLOCK_K - 5
    q_idx = torch.arange(queries)
    tile, row = q_idx // block_q, q_idx % block_q
    ks = (row * 3) % 50
    ke = torch.where(tile == 0, ks, ks + tile * (BLOCK_K - 4) + row).clamp(max=num_keys)
    ks, ke = (x.to(torch.int32).expand(batch, queries).contiguous().cuda() for x in (ks, ke))
    q, k, w = indexer_inputs(batch, queries, heads, 128, num_keys, gen, w_scale="fan_in", w_dtype=torch.bfloat16, device="cuda")
    out = torch.full((batch, queries, num_keys), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = v41_scores_tilelang(q, k, w, ks, ke, out=out)
    assert_v41_equal(got, _formula(q, k, w, visible_mask(ks, ke, num_keys)))


def test_large_causal_bitwise_fraction():
    """At the model's shape (H = 64, D = 128, 2M visible scores) >= 99.999 % are bitwise equal."""
    from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

    gen = torch.Generator().manual_seed(11)
    batch, queries, heads, dim = 1, 4096, 64, 128
    num_keys = queries // RATIO
    ks, ke = causal_ks_ke(batch, queries, num_keys, RATIO, torch.device("cuda"))
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, gen, w_scale="fan_in", w_dtype=torch.bfloat16, device="cuda")
    got = v41_scores_tilelang(q, k, w, ks, ke)
    assert_v41_equal(got, _formula(q, k, w, visible_mask(ks, ke, num_keys)), max_fraction=1e-5)


def test_interface_dispatches_to_kernels():
    """The seed API with backend='tilelang' gives the kernels' answer for both visibility forms."""
    from nemo_dsa.ops.v41_indexer.interface import indexer_scores

    gen = torch.Generator().manual_seed(3)
    batch, queries, heads, dim, num_keys = 2, 130, 16, 128, 40
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, gen, w_scale="fan_in", w_dtype=torch.bfloat16, device="cuda")
    ks, ke = causal_ks_ke(batch, queries, num_keys, RATIO, torch.device("cuda"))
    want = _formula(q, k, w, visible_mask(ks, ke, num_keys))
    assert_v41_equal(indexer_scores(q, k, w, ks=ks, ke=ke, backend="tilelang"), want)
    assert_v41_equal(indexer_scores(q, k, w, visible_mask(ks, ke, num_keys), backend="tilelang"), want)


def test_degenerate_shapes():
    from nemo_dsa.ops.v41_indexer.kernels import v41_scores_masked_tilelang, v41_scores_tilelang

    gen = torch.Generator().manual_seed(5)
    q, k, w = indexer_inputs(1, 9, 8, 64, 0, gen, w_scale="fan_in", w_dtype=torch.bfloat16, device="cuda")  # no keys
    zeros = torch.zeros(1, 9, dtype=torch.int32, device="cuda")
    assert v41_scores_tilelang(q, k, w, zeros, zeros).shape == (1, 9, 0)
    q, k, w = indexer_inputs(2, 5, 8, 64, 3, gen, w_scale="fan_in", w_dtype=torch.bfloat16, device="cuda")  # nothing visible: all -inf, never NaN
    zeros = torch.zeros(2, 5, dtype=torch.int32, device="cuda")
    assert torch.isneginf(v41_scores_tilelang(q, k, w, zeros, zeros)).all()
    nothing = torch.zeros(2, 5, 3, dtype=torch.bool, device="cuda")
    assert torch.isneginf(v41_scores_masked_tilelang(q, k, w, nothing)).all()
