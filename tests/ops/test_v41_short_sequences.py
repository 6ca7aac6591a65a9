"""V4.1 selection on sequences from one token up: every length a short prompt or a generation step
can bring runs, and equals the references.

A 1-token query of a ratio-1 layer sees one compressed key, a 2-token row two; the candidate
blocks are then shorter than one block (C > K). Each length from 1 to a few blocks is checked for
the candidate blocks (the fast path against ``candidate_blocks_reference``) and for the selection
without the score matrix (``v41_select_topk``: its CPU chunk planning, the candidate phase and the
top-k) against scoring in full and selecting with the references.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import generator
from nemo_dsa.ops.fused_selection import v41_select_topk
from nemo_dsa.ops.topk import candidate_blocks_reference, select_topk_reference
from nemo_dsa.ops.v41_indexer import blocks_to_mask, candidate_blocks, v41_scores

BLOCK_SIZES = (1, 2, 4, 8)
LENGTHS = range(1, 3 * 8 + 2)  # up to three blocks of the largest size, and one key over


def packed_ranges(batch: int, queries: int, ratio: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """ks, ke of a causal row (row 0) and of rows packing random documents (the others), K = S // R."""
    num_keys = queries // ratio
    ks = torch.zeros(batch, queries, dtype=torch.int32)
    ke = torch.zeros(batch, queries, dtype=torch.int32)
    for b in range(batch):
        start = 0
        for p in range(queries):
            if b > 0 and p > 0 and torch.rand((), generator=g) < 0.15:
                start = p  # a new document starts here
            ks[b, p] = min(-(-start // ratio), num_keys)
            ke[b, p] = max(int(ks[b, p]), min((p + 1) // ratio, num_keys))
    return ks, ke, num_keys


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_candidate_blocks_from_one_token(block_size):
    for queries in LENGTHS:
        g = generator(1000 * block_size + queries)
        ks, ke, num_keys = packed_ranges(3, queries, 1, g)
        # Scores with exact ties (a few distinct values) so the tie rule is exercised too.
        scores = torch.randint(-3, 4, (3, queries, num_keys), generator=g).float() / 4
        scores[torch.rand(scores.shape, generator=g) < 0.05] = float("nan")
        for topk_blocks in (1, 2, 3):
            fast = candidate_blocks(scores, ks, ke, block_size, topk_blocks)
            expected = candidate_blocks_reference(scores, ks, ke, block_size, topk_blocks)
            assert torch.equal(fast, expected), (queries, block_size, topk_blocks)
            # The block of the last visible key is kept by every query that sees a key.
            last = (ke.long() - 1 - ks.long()) // block_size
            sees = ke > ks
            assert ((fast == last.unsqueeze(-1)).any(-1) == sees).all(), (queries, block_size, topk_blocks)


@pytest.mark.parametrize("ratio", [1, 2])
def test_fused_v41_selection_from_one_token(ratio):
    heads, dim, topk, block_size, topk_blocks = 4, 32, 3, 4, 2
    for queries in range(1, 4 * block_size * ratio + 2):
        g = generator(100 * ratio + queries)
        ks, ke, num_keys = packed_ranges(2, queries, ratio, g)
        q = torch.randn(2, queries, heads, dim, generator=g).bfloat16()
        k = torch.randn(2, num_keys, dim, generator=g).bfloat16()
        w = torch.randn(2, queries, heads, generator=g).bfloat16()
        scores = v41_scores(q, k, w, ks, ke)
        indices, blocks = v41_select_topk(q, k, w, ks, ke, topk, candidate_block_size=block_size,
                                          candidate_topk_blocks=topk_blocks, backend="torch")  # fmt: skip
        assert torch.equal(indices, select_topk_reference(scores, topk, order="index")), (ratio, queries)
        assert torch.equal(blocks, candidate_blocks_reference(scores, ks, ke, block_size, topk_blocks)), (ratio, queries)
        # A reindex layer over the same keys: scores outside the kept blocks are -inf before top-k.
        reindexed = v41_select_topk(q, k, w, ks, ke, topk, candidate_block_size=block_size,
                                    candidate_blocks=blocks, backend="torch")  # fmt: skip
        kept = blocks_to_mask(blocks, ks, ke, block_size, num_keys)
        expected = select_topk_reference(scores.masked_fill(~kept, float("-inf")), topk, order="index")
        assert torch.equal(reindexed, expected), (ratio, queries)
