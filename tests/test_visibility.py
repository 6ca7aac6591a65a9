"""Visibility (nemo_dsa.visibility): the (ks, ke) rule, its dense form, and the check every op runs."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import dense_visibility, ERROR_SIZES, error_v4_inputs, full_visibility, generator, packed_ks_ke, random_ks_ke
from nemo_dsa.ops.v41_indexer import candidate_blocks
from nemo_dsa.ops.v41_indexer import indexer_scores, v41_scores
from nemo_dsa.ops.v4_indexer import v4_lighting_indexer, v4_logits
from nemo_dsa.visibility import causal_ks_ke, document_ks_ke, visible_mask

S, B, H, D, K = ERROR_SIZES


def _bad_ks_ke():
    ks, ke = full_visibility(B, S, K)
    neg = ks.clone()
    neg[1, 3] = -1
    big = ke.clone()
    big[0, 0] = K + 1
    inverted_ks = ks.clone()
    inverted_ks[0, 5] = 2
    inverted_ke = ke.clone()
    inverted_ke[0, 5] = 1
    return [
        (ValueError, "ke is missing", dict(ks=ks)),
        (ValueError, "ks is missing", dict(ke=ke)),
        (TypeError, "ks", dict(ks=ks.long(), ke=ke)),
        (TypeError, "ke", dict(ks=ks, ke=ke.float())),
        (ValueError, "ks", dict(ks=ks[:, :-1], ke=ke)),
        (ValueError, "ke", dict(ks=ks, ke=ke.T.contiguous())),
        (ValueError, "ks must be >= 0", dict(ks=neg, ke=ke)),
        (ValueError, "ke must be <=", dict(ks=ks, ke=big)),
        (ValueError, "ke must be >= ks", dict(ks=inverted_ks, ke=inverted_ke)),
    ]


@pytest.mark.parametrize("error,match,kwargs", _bad_ks_ke())
def test_ks_ke_everywhere(error, match, kwargs):
    with pytest.raises(error, match=match):
        v4_lighting_indexer(*error_v4_inputs(), 4, 2, **kwargs)
    q, k, w = (x.transpose(0, 1) for x in error_v4_inputs())
    w_bf16 = w.bfloat16()
    full = {"ks": None, "ke": None, **kwargs}
    with pytest.raises(error, match=match):
        indexer_scores(q.contiguous(), k.contiguous(), w_bf16, **full)
    if full["ks"] is not None and full["ke"] is not None:
        for fn in (v4_logits, v41_scores):
            with pytest.raises(error, match=match):
                fn(q, k, w if fn is v4_logits else w_bf16, full["ks"], full["ke"])
        with pytest.raises(error, match=match):
            candidate_blocks(torch.randn(B, S, K), full["ks"], full["ke"], 2, 2)


@pytest.mark.parametrize("ratio", [1, 3, 4])
def test_document_rule_equals_the_spec_oracle(ratio):
    """document_ks_ke on packed rows equals packed_ks_ke, built token by token from docs/semantics.md; the
    unpacked causal_ks_ke is its single-document case, clamped to the keys given."""
    docs = [[5, 13, 1, 22], [41]]
    seq = 41
    want_ks, want_ke = packed_ks_ke(docs, seq, ratio)
    start = torch.zeros(2, seq, dtype=torch.int64)
    for row, lengths in enumerate(docs):
        offset = 0
        for length in lengths:
            start[row, offset : offset + length] = offset
            offset += length
    ks, ke = document_ks_ke(start, torch.arange(seq).expand(2, seq), ratio)
    assert torch.equal(ks.int(), want_ks) and torch.equal(ke.int(), want_ke)
    for num_keys in (seq // ratio, seq // ratio - 2):
        causal = causal_ks_ke(3, seq, num_keys, ratio, torch.device("cpu"))
        single = packed_ks_ke([[seq]] * 3, seq, ratio)
        assert torch.equal(causal[0], single[0]) and torch.equal(causal[1], single[1].clamp(max=num_keys))


def test_visible_mask_is_the_dense_rule_on_any_key_window():
    g = generator(5)
    ks, ke = random_ks_ke(2, 30, 17, g)
    assert torch.equal(visible_mask(ks, ke, 17), dense_visibility(ks, ke, 17))
    window = visible_mask(ks, ke, 9, first_key=4)  # keys 4..12
    assert torch.equal(window, dense_visibility(ks, ke, 17)[..., 4:13])
