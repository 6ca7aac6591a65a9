"""The V4.1 indexer reference (nemo_dsa.ops.v41_indexer.naive): bitwise docs/semantics.md's bf16 formula."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import dense_visibility, generator, indexer_inputs, random_ks_ke, v41_formula
from nemo_dsa.ops.v41_indexer import v41_scores

SHAPES = [(1, 7, 1, 16, 5), (2, 33, 4, 32, 9), (3, 50, 8, 48, 13)]  # B, S, H, D, K (ragged)


@pytest.mark.parametrize("shape", SHAPES + [(2, 64, 16, 64, 32)])
def test_v41_scores_bitwise_formula(shape):
    g = generator(200 + sum(shape))
    q, k, w = indexer_inputs(*shape, g, w_dtype=torch.bfloat16)
    ks, ke = random_ks_ke(shape[0], shape[1], shape[4], g)
    want = v41_formula(q, k, w).masked_fill(~dense_visibility(ks, ke, shape[4]), float("-inf"))
    with torch.no_grad():
        for budget in (None, 1, 3 * shape[0] * shape[2] * shape[4] * 2 * 5):  # unchunked, 1, 5 rows
            got = v41_scores(q, k, w, ks, ke, **({} if budget is None else {"budget_bytes": budget}))
            assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not v41_scores(q.requires_grad_(), k, w, ks, ke).requires_grad
