"""Streaming top-k (nemo_dsa.ops.fused_selection) on CPU: exact equality with full-matrix selection.

End-to-end comparisons use quantised inputs (q, k in {-1, 0, 1}, w in quarter steps): every
product and sum is exact in fp32, so any scorer and any chunking give bitwise the same scores,
with many ties, and equality tests the windowing and the tie rule. The selection on arbitrary
float scores is tested separately with the scorer replaced by slices of a fixed random matrix
(CPU BLAS picks kernels by matrix shape, so the torch scorer itself is only 1-ulp stable).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from _support.helpers import indexer_inputs, packed_ks_ke, random_ks_ke
from nemo_dsa.ops.fused_selection import (
    DEFAULT_CHUNK_BYTES,
    KEY_ALIGN,
    ChunkPlan,
    plan_query_chunks,
    select_window,
    v4_row_bytes,
    v4_select_topk,
    v41_row_bytes,
    v41_select_topk,
    v41_select_topk_in_ranges,
)
from nemo_dsa.ops.fused_selection import interface as fused_interface
from nemo_dsa.ops.fused_selection import plan as fused_plan
from nemo_dsa.ops.topk import (
    orderable_image,
    orderable_int32,
    pytorch_extract_topk_scores,
    select_topk_reference,
)
from nemo_dsa.ops.topk import naive as topk_naive
from nemo_dsa.ops.topk.rows import MAX_INT32_KEY_WIDTH
from nemo_dsa.ops.v4_indexer import v4_logits
from nemo_dsa.ops.v41_indexer import blocks_to_mask, candidate_blocks, v41_scores
from nemo_dsa.visibility import KeyRanges, causal_ks_ke, visible_mask

INF = float("inf")


# ----------------------------------------------------------------------------------------------
# Inputs and layouts
# ----------------------------------------------------------------------------------------------


def _layout(name, batch, queries, ratio, seed):
    """(ks, ke, K) for a layout; the CP layout returns rank 1 of 3 (queries a slice, global keys)."""
    g = torch.Generator().manual_seed(seed)
    if name == "causal":
        num_keys = queries // ratio
        ks, ke = causal_ks_ke(batch, queries, num_keys, ratio, torch.device("cpu"))
    elif name == "packed":  # document lengths off multiples of R, trailing padding
        docs = [[37, 101, 5, queries - 37 - 101 - 5 - 9], [queries - 50, 43]][:batch]
        docs += [[queries]] * (batch - len(docs))
        num_keys = queries // ratio
        ks, ke = packed_ks_ke(docs, queries, ratio)
    elif name == "cp":
        ranks, rank = 3, 1
        total = queries * ranks
        docs = [[total // 2 + 3, total - total // 2 - 3]] * batch
        ks, ke = packed_ks_ke(docs, total, ratio)
        ks, ke = ks[:, rank * queries : (rank + 1) * queries], ke[:, rank * queries : (rank + 1) * queries]
        num_keys = total // ratio
    else:  # arbitrary ranges, some empty
        num_keys = queries // ratio
        ks, ke = random_ks_ke(batch, queries, num_keys, g)
    return ks.contiguous(), ke.contiguous(), num_keys


def _v4_reference(q, k, w, ks, ke, topk):
    logits = v4_logits(q, k, w, ks, ke)
    index = select_topk_reference(logits, topk, order="score")
    return pytorch_extract_topk_scores(logits, index), index


# ----------------------------------------------------------------------------------------------
# The integer images and window selection
# ----------------------------------------------------------------------------------------------


def _same_order(reference: torch.Tensor, image: torch.Tensor) -> bool:
    """True if ``image`` orders (and ties) the elements exactly as ``reference`` does."""
    order = torch.argsort(reference, stable=True)
    monotone = bool((image[order][1:] >= image[order][:-1]).all())
    return monotone and torch.unique(reference).numel() == torch.unique(image).numel()


def _float_rule(values: torch.Tensor) -> torch.Tensor:
    """The order the images must reproduce, in float64: zeros tie, every non-finite value is lowest."""
    wide = values.double() + 0.0
    return torch.where(torch.isfinite(wide), wide, -INF)


def test_bf16_image_orders_every_bit_pattern_like_the_float_rule():
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    image = orderable_image(values.clone()).long()
    assert _same_order(_float_rule(values), image)
    assert _same_order(_float_rule(values), orderable_int32(values))
    assert image.min() == -(2**15) and int((image == -(2**15)).sum()) == int((~torch.isfinite(values)).sum())


def test_fp32_image_orders_like_the_float_rule():
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31, (200000,), generator=g, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0.0, -0.0, INF, -INF, float("nan"), 1e-45, -1e-45, 3.4028235e38, -3.4028235e38, 1.0, -1.0])
    values = torch.cat([bits.view(torch.float32), special])
    assert _same_order(_float_rule(values), orderable_image(values.clone()).long())


def _scores_with_ties(rows, width, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randint(-6, 7, (rows, width), generator=g) / 2).to(dtype)
    scores[torch.rand(rows, width, generator=g) < 0.1] = -INF
    scores[torch.rand(rows, width, generator=g) < 0.03] = -0.0
    scores[torch.rand(rows, width, generator=g) < 0.01] = float("nan")
    scores[torch.rand(rows, width, generator=g) < 0.01] = INF
    scores[::7] = -INF  # rows that see nothing
    return scores


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["score", "index"])
@pytest.mark.parametrize("count", [1, 13, 40, 90])
def test_select_window_equals_select_topk_on_the_full_row(dtype, order, count):
    full_width, start, width = 90, 23, 51
    window = _scores_with_ties(30, width, dtype, seed=count)
    full = torch.full((30, full_width), -INF, dtype=dtype)
    full[:, start : start + width] = window
    index, values = select_window(window.clone(), start, count, order)
    expected = select_topk_reference(full, count, order=order)
    assert torch.equal(index, expected)
    gathered = pytorch_extract_topk_scores(full.float(), expected)
    assert torch.equal(values.float(), gathered)


def _stable_sort_oracle(scores: torch.Tensor, count: int, order: str) -> torch.Tensor:
    """Top-count by a stable float64 sort (ties keep index order), non-finite scores excluded."""
    wide = scores.double()
    ranked = torch.sort(torch.where(torch.isfinite(wide), -wide, INF), dim=-1, stable=True).indices[:, :count]
    finite = torch.isfinite(torch.gather(wide, -1, ranked))
    if order == "index":
        ranked = torch.where(finite, ranked, scores.shape[-1]).sort(dim=-1).values
        finite = ranked < scores.shape[-1]
    return torch.where(finite, ranked, -1).to(torch.int32)


def test_select_window_wide_bf16_uses_64_bit_keys():
    width = MAX_INT32_KEY_WIDTH + 1000  # past the int32 key's 16 index bits
    scores = _scores_with_ties(3, width, torch.bfloat16, seed=5)
    scores[1, -3:] = 100.0  # ties at the far end must still go to the smaller index
    for order in ("score", "index"):
        index, _ = select_window(scores.clone(), 7, 64, order)
        want = _stable_sort_oracle(scores, 64, order)
        assert torch.equal(index, torch.where(want >= 0, want + 7, -1))


# ----------------------------------------------------------------------------------------------
# Chunk planner
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["causal", "packed", "cp", "random"])
@pytest.mark.parametrize("budget", [1, 50_000, 2_000_000, 2**40])
@pytest.mark.parametrize("row_align", [None, 8])  # None: the kernels' ROW_ALIGN (256)
def test_planner_covers_rows_windows_hold_visible_keys_and_fit_the_budget(layout, budget, row_align):
    ks, ke, num_keys = _layout(layout, 2, 523, 4, seed=3)
    align = row_align or fused_plan.ROW_ALIGN
    for row_bytes in (v4_row_bytes(4, 32, 64), v41_row_bytes(4, 32, 64, candidates=True, block_size=4)):
        chunks = plan_query_chunks(ks, ke, row_bytes, budget, row_align=row_align)
        assert chunks[0].start == 0 and chunks[-1].end == 523
        assert all(a.end == b.start for a, b in zip(chunks, chunks[1:]))
        for c in chunks:
            seen = ke[:, c.rows] > ks[:, c.rows]
            assert (ks[:, c.rows][seen] >= c.key_start).all() and (ke[:, c.rows][seen] <= c.key_end).all()
            assert 0 <= c.key_start <= c.key_end <= num_keys and c.key_start % KEY_ALIGN == 0
            rows = c.end - c.start
            cost = rows * 2 * int(row_bytes(np.array([c.width]))[0])
            assert c.start % align == 0, c  # chunks start on the kernels' query tiles
            assert rows <= align or cost <= budget, (c, cost)
        if budget == 2**40:
            assert len(chunks) == 1


@pytest.mark.parametrize("layout", ["causal", "packed", "random"])
@pytest.mark.parametrize("budget", [150_000, 400_000, 1_000_000])
def test_planner_splits_the_last_two_chunks_where_their_larger_cost_is_least(layout, budget):
    """No sliver of a last chunk: among every query-tile split of the last two chunks' rows within the
    budget, the plan's has the least larger cost (brute force)."""
    ks, ke, _ = _layout(layout, 2, 1100, 4, seed=5)
    row_bytes, align = v4_row_bytes(4, 32, 64), 8
    chunks = plan_query_chunks(ks, ke, row_bytes, budget, row_align=align)
    assert len(chunks) >= 2

    def cost(start, end):
        seen = ke[:, start:end] > ks[:, start:end]
        if not seen.any():
            return 0
        lo = int(ks[:, start:end][seen].min()) // KEY_ALIGN * KEY_ALIGN
        return (end - start) * 2 * int(row_bytes(np.array([int(ke[:, start:end][seen].max()) - lo]))[0])

    a, b = chunks[-2], chunks[-1]
    assert a.start % align == 0 and b.start % align == 0
    fits = [max(cost(a.start, m), cost(m, b.end)) for m in range(a.start + align, b.end, align)
            if cost(a.start, m) <= budget and cost(m, b.end) <= budget]  # fmt: skip
    assert max(cost(a.start, b.start), cost(b.start, b.end)) == min(fits)


def test_row_bytes_count_the_query_copy_only_for_several_sequences():
    # q[:, rows] is a view for B = 1 and a copy the scorer makes for B > 1: H * D bf16 per row.
    widths = np.array([0, 100, 4096])
    for one, several in (
        (v4_row_bytes(8, 64, 512, on_gpu=True, batched=False), v4_row_bytes(8, 64, 512, on_gpu=True, batched=True)),
        (v41_row_bytes(8, 64, 512, on_gpu=True, batched=False), v41_row_bytes(8, 64, 512, on_gpu=True, batched=True)),
    ):
        assert (several(widths) - one(widths) == 8 * 64 * 2).all()


# ----------------------------------------------------------------------------------------------
# End to end (torch backend) against the full-matrix references
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def small_tiles(monkeypatch):
    """Chunks of 8-query tiles: the torch references have no kernel tiles to keep aligned, and
    these small problems then still split into many chunks."""
    monkeypatch.setattr(fused_plan, "ROW_ALIGN", 8)

CASES = [  # layout, batch, queries, heads, dim, topk, ratio
    ("causal", 2, 301, 3, 16, 64, 4),
    ("causal", 1, 2150, 2, 16, 2048, 1),  # T = 2048 < K = 2150
    ("packed", 2, 523, 4, 16, 64, 4),
    ("cp", 3, 211, 2, 32, 512, 4),  # T > K = 158
    ("random", 2, 1100, 1, 16, 1024, 1),  # T = 1024 < K = 1100, arbitrary ranges
]


@pytest.mark.parametrize("layout,batch,queries,heads,dim,topk,ratio", CASES)
def test_v4_streaming_equals_full_selection(layout, batch, queries, heads, dim, topk, ratio, small_tiles):
    ks, ke, num_keys = _layout(layout, batch, queries, ratio, seed=queries)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, seed=queries, w_dtype=torch.float32, quantised=True)
    ref_scores, ref_index = _v4_reference(q, k, w, ks, ke, topk)
    assert ref_index.shape[-1] == min(topk, num_keys)
    for budget in (DEFAULT_CHUNK_BYTES, 3_000_000) + ((20_000,) if queries < 1000 else ()):
        scores, index = v4_select_topk(q, k, w, ks, ke, topk, backend="torch", chunk_bytes=budget)
        assert torch.equal(index, ref_index), budget
        assert torch.equal(scores, ref_scores), budget


@pytest.mark.parametrize("layout,batch,queries,heads,dim,topk,ratio", CASES)
def test_v41_streaming_equals_full_selection(layout, batch, queries, heads, dim, topk, ratio, small_tiles):
    ks, ke, num_keys = _layout(layout, batch, queries, ratio, seed=queries + 1)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, seed=queries + 1, w_dtype=torch.bfloat16, quantised=True)
    full = v41_scores(q, k, w, ks, ke)
    ref = select_topk_reference(full, topk, order="index")
    for budget in (DEFAULT_CHUNK_BYTES, 3_000_000) + ((20_000,) if queries < 1000 else ()):
        assert torch.equal(v41_select_topk(q, k, w, ks, ke, topk, backend="torch", chunk_bytes=budget), ref), budget


@pytest.mark.parametrize("layout", ["causal", "packed", "cp"])
@pytest.mark.parametrize("block_size,topk_blocks", [(4, 3), (8, 100)])
def test_v41_candidate_source_and_reindex_equal_full_matrix(layout, block_size, topk_blocks, small_tiles):
    batch, queries, heads, dim, topk = 2, 389, 2, 16, 24
    ks, ke, num_keys = _layout(layout, batch, queries, 4, seed=7)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, seed=8, w_dtype=torch.bfloat16, quantised=True)
    full = v41_scores(q, k, w, ks, ke)
    ref_blocks = candidate_blocks(full, ks, ke, block_size, topk_blocks)
    ref_source = select_topk_reference(full, topk, order="index")
    # A second layer's scores, masked by the source layer's blocks.
    q2, k2, w2 = indexer_inputs(batch, queries, heads, dim, num_keys, seed=9, w_dtype=torch.bfloat16, quantised=True)
    full2 = v41_scores(q2, k2, w2, ks, ke)
    keep = blocks_to_mask(ref_blocks, ks, ke, block_size, num_keys)
    ref_reindex = select_topk_reference(full2.masked_fill(~keep, -INF), topk, order="index")
    for budget in (DEFAULT_CHUNK_BYTES, 100_000):
        index, blocks = v41_select_topk(q, k, w, ks, ke, topk, candidate_block_size=block_size,
                                        candidate_topk_blocks=topk_blocks, backend="torch", chunk_bytes=budget)
        assert torch.equal(blocks, ref_blocks) and torch.equal(index, ref_source)
        index2 = v41_select_topk(q2, k2, w2, ks, ke, topk, candidate_block_size=block_size,
                                 candidate_blocks=blocks, backend="torch", chunk_bytes=budget)
        assert torch.equal(index2, ref_reindex)


def test_candidate_source_checks_ks_ke_once_not_per_chunk(monkeypatch, small_tiles):
    """The candidate blocks of each chunk skip the ks/ke value check the call already made: a
    check of the chunk's fresh slices is a host sync per chunk (measured on the H200: the layer's
    queue drained 16 times, 30 ms queued for 15 ms of kernels)."""
    batch, queries, heads, dim = 1, 389, 2, 16
    ks, ke, num_keys = _layout("causal", batch, queries, 4, seed=13)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, seed=14, w_dtype=torch.bfloat16, quantised=True)
    budget = 20_000
    plan = fused_plan.plan_query_chunks(ks, ke, fused_plan.v41_row_bytes(heads, dim, 8, True, 4, batched=False), budget)
    assert len(plan) >= 3
    checked = []
    original = topk_naive.check_ks_ke
    monkeypatch.setattr(topk_naive, "check_ks_ke", lambda *a, **kw: checked.append(a) or original(*a, **kw))
    index, blocks = v41_select_topk(q, k, w, ks, ke, 8, candidate_block_size=4, candidate_topk_blocks=3,
                                    backend="torch", chunk_bytes=budget)  # fmt: skip
    assert checked == []
    full = v41_scores(q, k, w, ks, ke)
    assert torch.equal(blocks, candidate_blocks(full, ks, ke, 4, 3))
    assert len(checked) == 1  # the public candidate_blocks still checks its arguments


def test_selection_of_arbitrary_float_scores_is_independent_of_chunking(monkeypatch, small_tiles):
    """The scorer replaced by slices of one random matrix: streaming == select_topk_reference(matrix)."""
    batch, queries, heads, dim, topk = 2, 403, 2, 16, 37
    ks, ke, num_keys = _layout("packed", batch, queries, 4, seed=11)
    g = torch.Generator().manual_seed(12)
    fixed = torch.randn(batch, queries, num_keys, generator=g)
    fixed[torch.rand(fixed.shape, generator=g) < 0.2] = 0.5  # ties
    fixed[torch.rand(fixed.shape, generator=g) < 0.05] = -0.0
    fixed = fixed.masked_fill(~visible_mask(ks, ke, num_keys), -INF)
    current = []  # the chunk being scored, recorded where its local ranges are formed
    original_ranges = ChunkPlan.ranges

    def ranges(plan, chunk):
        current[:] = [chunk]
        return original_ranges(plan, chunk)

    def scorer_of(dtype):
        def scorer(backend, q, k, w, ranges, *rest):
            chunk = current[0]
            assert q.shape[1] == chunk.end - chunk.start and k.shape[1] == chunk.width
            return fixed[:, chunk.rows, chunk.key_start : chunk.key_end].to(dtype)
        return scorer

    monkeypatch.setattr(ChunkPlan, "ranges", ranges)
    monkeypatch.setattr(fused_interface, "v4_chunk_logits", scorer_of(torch.float32))
    monkeypatch.setattr(fused_interface, "v41_chunk_scores", scorer_of(torch.bfloat16))
    q, k, _ = indexer_inputs(batch, queries, heads, dim, num_keys, seed=0, w_dtype=torch.float32, quantised=True)
    w = torch.zeros(batch, queries, heads)
    expected_v4 = select_topk_reference(fixed, topk)
    expected_v41 = select_topk_reference(fixed.bfloat16(), topk, order="index")
    for budget in (10**9, 30_000, 2_000):
        scores, index = v4_select_topk(q, k, w, ks, ke, topk, backend="torch", chunk_bytes=budget)
        assert torch.equal(index, expected_v4) and torch.equal(scores, pytorch_extract_topk_scores(fixed, expected_v4))
        index = v41_select_topk(q, k, w.bfloat16(), ks, ke, topk, backend="torch", chunk_bytes=budget)
        assert torch.equal(index, expected_v41)
    assert len(plan_query_chunks(ks, ke, v4_row_bytes(heads, dim, topk), 2_000)) > 50


def test_rows_with_ties_beyond_the_candidates_are_redone_after_rescoring(monkeypatch, small_tiles):
    """Rows whose T-th score has more copies than the candidates hold are flagged; their chunk is
    scored again after the loop and those rows selected with full-row keys: still exact."""
    batch, queries, heads, dim, topk = 1, 1200, 2, 16, 37
    ks, ke, num_keys = _layout("causal", batch, queries, 4, seed=13)
    fixed = torch.randn(batch, queries, num_keys, generator=torch.Generator().manual_seed(14))
    fixed[:, 900:905] = 0.25  # 225+ equal visible scores: more than T + TIE_MARGIN
    fixed = fixed.masked_fill(~visible_mask(ks, ke, num_keys), -INF)
    scored = []

    def scorer_of(dtype):
        def scorer(backend, q, k, w, ranges, *rest):
            chunk = next(c for c in chunks if c.end - c.start == q.shape[1] and c.width == k.shape[1])
            scored.append(chunk)
            return fixed[:, chunk.rows, chunk.key_start : chunk.key_end].to(dtype)
        return scorer

    chunks = plan_query_chunks(ks, ke, v4_row_bytes(heads, dim, topk), 30_000)
    assert len({(c.end - c.start, c.width) for c in chunks}) == len(chunks)  # the scorer can tell them apart
    monkeypatch.setattr(fused_interface, "v4_chunk_logits", scorer_of(torch.float32))
    q, k, _ = indexer_inputs(batch, queries, heads, dim, num_keys, seed=0, w_dtype=torch.float32, quantised=True)
    scores, index = v4_select_topk(q, k, torch.zeros(batch, queries, heads), ks, ke, topk, backend="torch", chunk_bytes=30_000)
    expected = select_topk_reference(fixed, topk)
    assert torch.equal(index, expected) and torch.equal(scores, pytorch_extract_topk_scores(fixed, expected))
    again = scored[len([c for c in chunks if c.width]):]
    assert again and all(c.start <= 900 < c.end or c.start < 905 <= c.end for c in again), again


def test_queries_that_see_nothing_get_minus_one_and_no_nan(small_tiles):
    q, k, w = indexer_inputs(2, 70, 2, 16, 30, seed=3, w_dtype=torch.float32, quantised=True)
    ks = torch.full((2, 70), 5, dtype=torch.int32)
    ke = ks.clone()
    ke[1, 40:] = 17  # a few queries of row 1 see keys 5..16
    scores, index = v4_select_topk(q, k, w, ks, ke, 8, backend="torch", chunk_bytes=4_000)
    assert (index[0] == -1).all() and (scores[0] == -INF).all() and not scores.isnan().any()
    ref_scores, ref_index = _v4_reference(q, k, w, ks, ke, 8)
    assert torch.equal(index, ref_index) and torch.equal(scores, ref_scores)
    assert (v41_select_topk(q, k, w.bfloat16(), ks, ke, 64, backend="torch")[0] == -1).all()


def test_no_keys_gives_empty_outputs():
    q, k, w = indexer_inputs(1, 5, 2, 16, 0, seed=0, w_dtype=torch.float32, quantised=True)
    zeros = torch.zeros(1, 5, dtype=torch.int32)
    scores, index = v4_select_topk(q, k, w, zeros, zeros, 4)
    assert scores.shape == index.shape == (1, 5, 0)


def test_bad_arguments_raise_clear_errors():
    q, k, w = indexer_inputs(1, 9, 2, 16, 2, seed=0, w_dtype=torch.float32, quantised=True)
    ks, ke = causal_ks_ke(1, 9, 2, 4, torch.device("cpu"))
    with pytest.raises(TypeError, match="w must have dtype float32"):
        v4_select_topk(q, k, w.bfloat16(), ks, ke, 4)
    with pytest.raises(TypeError, match="w must have dtype bfloat16"):
        v41_select_topk(q, k, w, ks, ke, 4)
    with pytest.raises(ValueError, match="ke must be <= the number of keys"):
        v4_select_topk(q, k, w, ks, ke + 5, 4)
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1"):
        v4_select_topk(q, k, w, ks, ke, 4, chunk_bytes=0)
    with pytest.raises(ValueError, match="topk must be >= 1"):
        v4_select_topk(q, k, w, ks, ke, 0)
    with pytest.raises(ValueError, match="backend='tilelang' needs CUDA"):
        v4_select_topk(q, k, w, ks, ke, 4, backend="tilelang")
    wb = w.bfloat16()
    with pytest.raises(ValueError, match="candidate_block_size is required"):
        v41_select_topk(q, k, wb, ks, ke, 4, candidate_topk_blocks=2)
    with pytest.raises(ValueError, match="not both"):
        v41_select_topk(q, k, wb, ks, ke, 4, candidate_block_size=2, candidate_topk_blocks=2,
                        candidate_blocks=torch.zeros(1, 9, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="candidate_blocks must lie in"):
        v41_select_topk(q, k, wb, ks, ke, 4, candidate_block_size=2, candidate_blocks=torch.full((1, 9, 1), 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="candidate_blocks must have shape"):
        v41_select_topk(q, k, wb, ks, ke, 4, candidate_block_size=2, candidate_blocks=torch.zeros(1, 8, 1, dtype=torch.int32))


def test_candidate_blocks_are_checked_where_they_enter_only(monkeypatch):
    """v41_select_topk checks a caller's candidate_blocks (one host read a call); the indexer's
    entry (``v41_select_topk_in_ranges``: the metadata's ranges, blocks from its candidate-source
    layer) reads nothing back and selects the same keys."""
    q, k, w = indexer_inputs(1, 40, 2, 16, 10, seed=3, w_dtype=torch.bfloat16, quantised=True)
    ks, ke = causal_ks_ke(1, 40, 10, 4, torch.device("cpu"))
    reads = []
    real_check = fused_interface.check_index_range
    monkeypatch.setattr(fused_interface, "check_index_range", lambda *a, **kw: reads.append(a[0]) or real_check(*a, **kw))
    _, blocks = v41_select_topk(q, k, w, ks, ke, 4, candidate_block_size=2, candidate_topk_blocks=3)
    assert reads == []
    checked = v41_select_topk(q, k, w, ks, ke, 4, candidate_block_size=2, candidate_blocks=blocks)
    assert reads == ["candidate_blocks"]
    trusted = v41_select_topk_in_ranges(q, k, w, KeyRanges(ks, ke, 10), 4, "torch", candidate_block_size=2,
                                        candidate_blocks=blocks, blocks_from_source=True)  # fmt: skip
    assert reads == ["candidate_blocks"] and torch.equal(trusted, checked)
    bad = blocks.clone()
    bad[0, 5, 0] = 7
    with pytest.raises(ValueError, match="candidate_blocks must lie in"):
        v41_select_topk(q, k, w, ks, ke, 4, candidate_block_size=2, candidate_blocks=bad)


@pytest.mark.parametrize("batch,queries,num_keys", [(0, 5, 7), (0, 0, 3), (0, 4, 0)])
def test_fused_selection_of_no_rows_returns_the_unfused_empties(batch, queries, num_keys):
    """Batch 0 has no rows to plan chunks over: the empty results of the unfused paths, not a crash."""
    q, k, w = indexer_inputs(batch, queries, 2, 16, num_keys, seed=3, w_dtype=torch.float32, quantised=True)
    ks, ke = torch.zeros(batch, queries, dtype=torch.int32), torch.full((batch, queries), num_keys, dtype=torch.int32)
    count = min(3, num_keys)
    want = select_topk_reference(v4_logits(q, k, w, ks, ke), 3)
    scores, indices = v4_select_topk(q, k, w, ks, ke, 3, backend="torch")
    assert indices.shape == want.shape == (batch, queries, count) and indices.dtype == want.dtype == torch.int32
    assert scores.shape == (batch, queries, count) and scores.dtype == torch.float32
    w41 = w.bfloat16()
    want41 = select_topk_reference(v41_scores(q, k, w41, ks, ke), 3, order="index")
    got41 = v41_select_topk(q, k, w41, ks, ke, 3, backend="torch")
    assert got41.shape == want41.shape and got41.dtype == want41.dtype
    got_source, blocks = v41_select_topk(q, k, w41, ks, ke, 3, candidate_block_size=2, candidate_topk_blocks=2,
                                         backend="torch")
    assert got_source.shape == want41.shape and blocks.shape == (batch, queries, min(2, -(-num_keys // 2)))
