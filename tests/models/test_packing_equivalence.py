"""A pack of documents (unaligned starts) scores and selects exactly as each document run alone.

"Alone" means: the document's own queries against only its own compressed groups, with visibility
shifted to start at 0. Quantised inputs make every sum exact, so end-to-end equality is bitwise
and ties are everywhere (the tie rule is what makes packing invariant). Random inputs check the
selection and candidate blocks on the same scores, where exactness does not depend on BLAS shapes.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import indexer_inputs, packed_ks_ke
from nemo_dsa.ops.topk import select_topk_reference
from nemo_dsa.ops.v41_indexer import candidate_blocks
from nemo_dsa.ops.v4_indexer import v4_lighting_indexer, v4_logits
from nemo_dsa.ops.v41_indexer import indexer_scores

RATIO, SEQ, HEADS, DIM, TOPK = 4, 48, 4, 32, 5
DOCS = [[7, 13, 10, 5, 9], [3, 21, 18]]  # starts 0,7,20,30,35 / 0,3,24; rows end in padding


def _documents(lengths):
    start = 0
    for length in lengths:
        first, last = -(-start // RATIO), (start + length) // RATIO
        yield slice(start, start + length), first, max(first, last)
        start += length


def _run(mode, q, keys, w, ks, ke):
    """Scores and top-k indices of one configuration through the public seed APIs."""
    if mode == "v4":
        sbhd = (q.transpose(0, 1), keys.transpose(0, 1), w.transpose(0, 1))
        score, idx = v4_lighting_indexer(*sbhd, RATIO, TOPK, ks=ks, ke=ke)
        return score, idx
    scores = indexer_scores(q, keys, w.bfloat16(), ks=ks, ke=ke)
    return scores, select_topk_reference(scores, TOPK, order="index")


@pytest.mark.parametrize("mode", ["v4", "v41"])
def test_pack_equals_documents_alone_exact(mode):
    q, keys, w = indexer_inputs(len(DOCS), SEQ, HEADS, DIM, SEQ // RATIO, 11, quantised=True)
    ks, ke = packed_ks_ke(DOCS, SEQ, RATIO)
    pack_scores, pack_idx = _run(mode, q, keys, w, ks, ke)
    for row, lengths in enumerate(DOCS):
        for tokens, first, last in _documents(lengths):
            got_idx = pack_idx[row, tokens]
            if last == first:  # document shorter than its first full group: sees nothing
                assert bool((got_idx == -1).all())
                continue
            one = slice(row, row + 1)
            alone_scores, alone_idx = _run(
                mode, q[one, tokens], keys[one, first:last], w[one, tokens], ks[one, tokens] - first, ke[one, tokens] - first
            )
            t = alone_idx.shape[-1]
            assert torch.equal(got_idx[:, :t], torch.where(alone_idx[0] >= 0, alone_idx[0] + first, -1))
            assert bool((got_idx[:, t:] == -1).all())
            if mode == "v4":  # gathered scores
                assert torch.equal(pack_scores[row, tokens, :t], alone_scores[0])
            else:  # full score rows: the document's columns match, all others are -inf
                assert torch.equal(pack_scores[row, tokens, first:last], alone_scores[0])
                outside = torch.ones(pack_scores.shape[-1], dtype=torch.bool)
                outside[first:last] = False
                assert bool(torch.isneginf(pack_scores[row, tokens][:, outside]).all())


@pytest.mark.parametrize("mode", ["v4", "v41"])
def test_pack_selection_and_blocks_equal_documents_alone(mode):
    q, keys, w = indexer_inputs(len(DOCS), SEQ, HEADS, DIM, SEQ // RATIO, 12, w_scale=1.0)
    ks, ke = packed_ks_ke(DOCS, SEQ, RATIO)
    if mode == "v4":
        scores = v4_logits(q, keys, w, ks, ke)
    else:
        scores = indexer_scores(q, keys, w.bfloat16(), ks=ks, ke=ke)
    order = "score" if mode == "v4" else "index"
    pack_idx = select_topk_reference(scores, TOPK, order=order)
    pack_blocks = candidate_blocks(scores, ks, ke, block_size=2, topk_blocks=2)
    for row, lengths in enumerate(DOCS):
        for tokens, first, last in _documents(lengths):
            if last == first:
                continue
            doc = scores[row : row + 1, tokens, first:last]
            doc_ks, doc_ke = ks[row : row + 1, tokens] - first, ke[row : row + 1, tokens] - first
            alone_idx = select_topk_reference(doc, TOPK, order=order)[0]
            t = alone_idx.shape[-1]
            assert torch.equal(pack_idx[row, tokens, :t], torch.where(alone_idx >= 0, alone_idx + first, -1))
            # Blocks are counted from the document's first group, so they are identical numbers.
            alone_blocks = candidate_blocks(doc, doc_ks, doc_ke, block_size=2, topk_blocks=2)[0]
            assert torch.equal(pack_blocks[row, tokens, : alone_blocks.shape[-1]], alone_blocks)


def test_causal_layout_helper_agrees_with_metadata_builder():
    from nemo_dsa.metadata import build_attention_metadata

    ids = torch.zeros(len(DOCS), SEQ, dtype=torch.int64)
    for row, lengths in enumerate(DOCS):
        for n, (tokens, _, _) in enumerate(_documents(lengths)):
            ids[row, tokens] = n + 1
    meta = build_attention_metadata(compress_ratio=RATIO, packed_seq_ids=ids)
    ks, ke = packed_ks_ke(DOCS, SEQ, RATIO)
    assert torch.equal(meta.ks, ks) and torch.equal(meta.ke, ke)
