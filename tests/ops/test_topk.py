"""Top-k selection on CPU (nemo_dsa.ops.topk: the reference, row selection, gather, candidate
blocks) against brute-force oracles, and its argument errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from _support.helpers import dense_visibility, ERROR_SIZES, full_visibility, generator, random_ks_ke
from nemo_dsa.ops.topk import candidate_blocks_reference, pytorch_extract_topk_scores, select_topk_reference
from nemo_dsa.ops.v41_indexer import blocks_to_mask, candidate_block_mask, candidate_blocks


def _brute_topk(row: list[float], t: int, order: str) -> list[int]:
    finite = [j for j, v in enumerate(row) if math.isfinite(v)]
    best = sorted(finite, key=lambda j: (-row[j], j))[:t]
    if order == "index":
        best.sort()
    return best + [-1] * (t - len(best))


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


S, B, H, D, K = ERROR_SIZES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["score", "index"])
@pytest.mark.parametrize("quantised", [False, True])
def test_select_topk_brute_force(dtype, order, quantised):
    g = generator(300)
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

    g = generator(301)
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


@pytest.mark.parametrize("order", ["score", "index"])
@pytest.mark.parametrize("topk", [1, 64, 200, 300])
def test_select_topk_bf16_cut_with_many_ties(order, topk):
    """bf16 rows find their cut and decide ties among the scores at or above it: heavy ties at the
    cut, -0/+0, rows with fewer finite scores than T, NaN/+inf rows (the full key path)."""
    g = generator(302 + topk)
    scores = (torch.randint(-40, 41, (12, 300), generator=g) / 8).bfloat16()
    scores[torch.rand(scores.shape, generator=g) < 0.1] = float("-inf")
    scores[torch.rand(scores.shape, generator=g) < 0.05] = -0.0
    scores[3, 50:] = float("-inf")  # fewer finite scores than most T
    scores[5, 7] = float("nan")
    scores[6, 9] = float("inf")
    got = select_topk_reference(scores, topk, order=order)
    want = torch.tensor([_brute_topk(r, topk, order) for r in scores.float().tolist()], dtype=torch.int32)
    assert torch.equal(got, want)


@pytest.mark.parametrize("c,nb_keep", [(3, 2), (4, 1), (2, 5), (16, 3)])
def test_candidate_blocks_brute_force(c, nb_keep):
    g = generator(400 + c)
    b, s, k = 2, 20, 23
    scores = torch.randint(-4, 5, (b, s, k), generator=g).float().bfloat16()  # ties across blocks
    ks, ke = random_ks_ke(b, s, k, g)
    scores = scores.masked_fill(~dense_visibility(ks, ke, k), float("-inf"))
    scores[0, 3, int(ks[0, 3]) : int(ke[0, 3])] = float("-inf")  # visible but unscored keys
    want_blocks, want_mask = _brute_candidates(scores, ks, ke, c, nb_keep)
    got = candidate_blocks(scores, ks, ke, c, nb_keep, budget_bytes=1000)
    assert torch.equal(got, want_blocks)
    assert torch.equal(candidate_blocks_reference(scores, ks, ke, c, nb_keep, budget_bytes=1000), want_blocks)
    assert torch.equal(candidate_block_mask(scores, ks, ke, c, nb_keep), want_mask)
    assert torch.equal(blocks_to_mask(got, ks, ke, c, k, budget_bytes=1), want_mask)


def candidate_scores(b, s, k, g, dtype):
    """Scores for candidate-block tests: small integers (ties within and across blocks), NaN and
    +/-inf sprinkled in, and finite values outside each row's [ks, ke) that must be ignored."""
    scores = torch.randint(-6, 7, (b, s, k), generator=g).to(dtype)
    specials = torch.rand(b, s, k, generator=g)
    scores[specials < 0.03] = float("nan")
    scores[(specials >= 0.03) & (specials < 0.05)] = float("inf")
    scores[(specials >= 0.05) & (specials < 0.15)] = float("-inf")
    return scores


@pytest.mark.parametrize("c", [1, 3, 5, 8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidate_blocks_fast_path_equals_reference(c, dtype):
    """The block-maxima table + select_topk path against the scatter-reduce reference: ragged K,
    several batches, non-power-of-two block sizes, budgets that split the rows, every keep count
    from 1 to beyond the number of blocks, rows that see nothing, packed starts anywhere."""
    g = generator(450 + c)
    for b, s, k in [(1, 37, 61), (3, 19, 200), (2, 8, 7)]:
        scores = candidate_scores(b, s, k, g, dtype)
        ks, ke = random_ks_ke(b, s, k, g)
        num_blocks = -(-k // c)
        for keep in sorted({1, 2, 3, max(1, num_blocks // 2), num_blocks, num_blocks + 4}):
            want = candidate_blocks_reference(scores, ks, ke, c, keep)
            got = candidate_blocks(scores, ks, ke, c, keep, budget_bytes=2000)
            assert torch.equal(got, want), (b, s, k, keep)
    # A row's last block is kept even when its only visible scores are not finite.
    scores = torch.randn(1, 2, 12, generator=g).to(dtype)
    scores[0, :, 8:] = float("nan")
    ks, ke = torch.tensor([[0, 2]], dtype=torch.int32), torch.tensor([[10, 12]], dtype=torch.int32)
    got = candidate_blocks(scores, ks, ke, 4, 2)
    assert torch.equal(got, candidate_blocks_reference(scores, ks, ke, 4, 2))
    assert got[0, 0, -1] == (10 - 1) // 4 and got[0, 1, -1] == (12 - 1 - 2) // 4


def test_extract_topk_scores_gathers_with_minus_one():
    logits = torch.randn(2, 3, 5)
    idx = torch.tensor([[[4, -1], [0, 2], [-1, -1]], [[1, 1], [3, 0], [2, -1]]])
    out = pytorch_extract_topk_scores(logits, idx)
    want = torch.where(idx >= 0, logits.gather(-1, idx.clamp(min=0)), float("-inf"))
    assert torch.equal(out, want)
    out1 = pytorch_extract_topk_scores(logits.transpose(1, 2), idx.transpose(1, 2), dim=1)
    assert torch.equal(out1, want.transpose(1, 2))


def test_extract_topk_scores_arguments():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="topk_indices must lie"):
        pytorch_extract_topk_scores(logits, torch.full((2, 3, 1), 5))
    with pytest.raises(ValueError, match="topk_indices must lie"):
        pytorch_extract_topk_scores(logits, torch.full((2, 3, 1), -2))
    with pytest.raises(TypeError, match="topk_indices"):
        pytorch_extract_topk_scores(logits, torch.zeros(2, 3, 1))
    with pytest.raises(ValueError, match="topk_indices"):
        pytorch_extract_topk_scores(logits, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="topk_indices"):
        pytorch_extract_topk_scores(logits, torch.zeros(2, 4, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="logits"):
        pytorch_extract_topk_scores(logits.tolist(), torch.zeros(2, 3, 1, dtype=torch.long))


def test_selection_and_block_arguments():
    scores = torch.randn(B, S, K)
    ks, ke = full_visibility(B, S, K)
    with pytest.raises(ValueError, match="topk"):
        select_topk_reference(scores, 0)
    with pytest.raises(ValueError, match="order"):
        select_topk_reference(scores, 2, order="random")
    with pytest.raises(TypeError, match="scores"):
        select_topk_reference(scores.long(), 2)
    with pytest.raises(TypeError, match="scores"):
        select_topk_reference(scores.double(), 2)
    with pytest.raises(ValueError, match="block_size"):
        candidate_blocks(scores, ks, ke, 0, 2)
    with pytest.raises(ValueError, match="topk_blocks"):
        candidate_blocks(scores, ks, ke, 2, 0)
    with pytest.raises(ValueError, match="scores"):
        candidate_blocks(scores[0], ks, ke, 2, 2)
