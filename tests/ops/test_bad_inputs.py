"""Inputs that were accepted with a wrong result or failed with an internal-looking error: each is
now a ValueError/TypeError naming the argument the caller passed (or, where the input is valid, the
right result). One test per case."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import generator, indexer_inputs
from nemo_dsa.metadata import build_attention_metadata
from nemo_dsa.ops.sparse_attention import (
    attend,
    attend_to_indices,
    sparse_attention,
    sparse_window_attention,
    window_compressed_attention_reference,
)
from nemo_dsa.ops.topk import pytorch_extract_topk_scores, select_topk, select_topk_reference
from nemo_dsa.ops.v4_indexer import v4_indexer_bshd

HUGE = 2**70


# ---- pytorch_extract_topk_scores ----------------------------------------------------------------


@pytest.mark.parametrize("dim", [3, 5, -4])
def test_extract_topk_scores_out_of_range_dim_is_rejected(dim):
    logits, indices = torch.randn(2, 3, 5), torch.zeros(2, 3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dim must lie in \[-3, 3\)"):
        pytorch_extract_topk_scores(logits, indices, dim=dim)


@pytest.mark.parametrize("dim", ["2", True, 1.0, None])
def test_extract_topk_scores_non_int_dim_is_rejected(dim):
    logits, indices = torch.randn(2, 3, 5), torch.zeros(2, 3, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="dim must be an int"):
        pytorch_extract_topk_scores(logits, indices, dim=dim)


def test_extract_topk_scores_negative_dim_in_range_still_works():
    logits = torch.randn(2, 5, 3, generator=generator(1))
    indices = torch.tensor([[[4, -1, 0], [1, 2, 3]]] * 2, dtype=torch.int32)
    got = pytorch_extract_topk_scores(logits, indices, dim=-2)
    want = torch.where(indices >= 0, logits.gather(1, indices.clamp_min(0).long()), float("-inf"))
    assert torch.equal(got, want)


def test_extract_topk_scores_zero_keys_with_minus_one_indices():
    got = pytorch_extract_topk_scores(torch.randn(2, 3, 0), torch.full((2, 3, 2), -1, dtype=torch.int32))
    assert got.shape == (2, 3, 2) and bool(torch.isneginf(got).all())
    with pytest.raises(ValueError, match="topk_indices must lie in"):
        pytorch_extract_topk_scores(torch.randn(2, 3, 0), torch.zeros(2, 3, 2, dtype=torch.int32))


# ---- select_topk honours ks/ke on the reference path ----------------------------------------------


def test_select_topk_empty_and_reversed_ranges_select_nothing():
    scores = torch.randn(2, 3, 6, generator=generator(2))
    for ks_value, ke_value in ((1, 0), (3, 3), (6, 2)):
        ks = torch.full((2, 3), ks_value, dtype=torch.int32)
        ke = torch.full((2, 3), ke_value, dtype=torch.int32)
        got = select_topk(scores, 2, ks=ks, ke=ke, backend="torch")
        assert bool((got == -1).all()), (ks_value, ke_value)


def test_select_topk_reads_only_the_range_on_cpu():
    g = generator(3)
    scores = torch.randn(2, 4, 9, generator=g)
    ks = torch.randint(0, 5, (2, 4), generator=g, dtype=torch.int32)
    ke = ks + torch.randint(0, 5, (2, 4), generator=g, dtype=torch.int32)
    keys = torch.arange(9)
    masked = scores.masked_fill((keys < ks[..., None]) | (keys >= ke[..., None]), float("-inf"))
    for order in ("score", "index"):
        got = select_topk(scores, 3, order, ks=ks, ke=ke, backend="torch")
        assert torch.equal(got, select_topk_reference(masked, 3, order))
        chosen = got.long()
        assert bool(((chosen == -1) | ((chosen >= ks[..., None]) & (chosen < ke[..., None]))).all())


# ---- sparse attention: q dtype and scale ----------------------------------------------------------


def _sparse_args():
    g = generator(4)
    q = torch.randn(1, 4, 2, 8, generator=g)
    kv = torch.randn(1, 4, 8, generator=g)
    indices = torch.tensor([[[0, -1], [1, 0], [2, -1], [3, 1]]], dtype=torch.int32)
    return q, kv, indices


def test_sparse_attention_rejects_integer_q():
    q, kv, indices = _sparse_args()
    with pytest.raises(TypeError, match="q must have dtype"):
        sparse_attention(q.long(), kv, indices, None, 1.0)
    with pytest.raises(TypeError, match="kv must have dtype"):
        sparse_attention(q, kv.long(), indices, None, 1.0)
    with pytest.raises(TypeError, match="q must have dtype"):
        sparse_window_attention(q.long(), kv.long(), torch.zeros(1, 4, dtype=torch.int32), 2, scale=1.0)


@pytest.mark.parametrize(
    "scale,error",
    [(float("nan"), ValueError), (float("inf"), ValueError), (-float("inf"), ValueError), (HUGE**20, ValueError),
     (torch.tensor(1.0), TypeError), (True, TypeError), ("1", TypeError), (None, TypeError)],
    ids=["nan", "inf", "-inf", "int_too_big", "tensor", "bool", "str", "none"],
)
def test_sparse_attention_rejects_bad_scale(scale, error):
    q, kv, indices = _sparse_args()
    with pytest.raises(error, match="scale must be"):
        sparse_attention(q, kv, indices, None, scale)
    with pytest.raises(error, match="scale must be"):
        sparse_window_attention(q, kv, torch.zeros(1, 4, dtype=torch.int32), 2, scale=scale)


def test_sparse_attention_index_check_is_named():
    q, kv, indices = _sparse_args()
    bad = indices.clone()
    bad[0, 1, 0] = 4
    with pytest.raises(ValueError, match=r"indices must lie in \[-1, 4\)"):
        sparse_attention(q, kv, bad, None, 1.0)
    ws = torch.zeros(1, 4, dtype=torch.int32)
    compressed = torch.randn(1, 2, 8)
    with pytest.raises(ValueError, match=r"indices must lie in \[-1, 2\)"):
        sparse_window_attention(q, kv, ws, 2, compressed, indices=indices, scale=1.0)
    with pytest.raises(ValueError, match=r"indices must lie in \[-1, 2\)"):
        window_compressed_attention_reference(q, kv, ws, 2, compressed, indices=indices, scale=1.0)
    # The unchecked entries (the layers') compute the same on valid indices.
    ok = indices.clamp_max(1)
    checked = sparse_window_attention(q, kv, ws, 2, compressed, indices=ok, scale=0.5)
    unchecked = attend(q, kv, ws, 2, compressed, indices=ok, scale=0.5)
    assert all(torch.equal(a, b) for a, b in zip(checked, unchecked))
    wide = torch.cat((kv, compressed), dim=1)
    assert all(torch.equal(a, b) for a, b in zip(sparse_attention(q, wide, indices, None, 0.5),
                                                 attend_to_indices(q, wide, indices, None, 0.5)))


def test_sparse_attention_meta_and_huge_window():
    q, kv, indices = _sparse_args()
    with pytest.raises(ValueError, match="q must hold data"):
        sparse_attention(q.to("meta"), kv.to("meta"), indices.to("meta"), None, 1.0)
    with pytest.raises(ValueError, match="window must be <="):
        sparse_window_attention(q, kv, torch.zeros(1, 4, dtype=torch.int32), HUGE, scale=1.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        sparse_attention(q, kv, indices, None, 1.0, chunk_size=0)


# ---- V4 indexer ----------------------------------------------------------------------------------


def test_v4_indexer_meta_tensors_and_huge_ratio():
    q, k, w = indexer_inputs(1, 8, 2, 16, 2, 0)
    with pytest.raises(ValueError, match="q must hold data"):
        v4_indexer_bshd(q.to("meta"), k.to("meta"), w.to("meta"), 4, 2, backend="torch")
    with pytest.raises(ValueError, match="compress_ratio must be <="):
        v4_indexer_bshd(q, k, w, HUGE, 2, backend="torch")


# ---- build_attention_metadata ---------------------------------------------------------------------


def test_metadata_int32_wrap_is_rejected():
    with pytest.raises(ValueError, match=r"seq_len: the global row .* 4294967296 tokens\) must be at most 2147483647"):
        build_attention_metadata(compress_ratio=4, cp_rank=2**30 - 1, cp_size=2**30, batch_size=1, seq_len=4)
    # The largest row that fits is accepted (shape only, no tensor of that size is built here).
    meta = build_attention_metadata(compress_ratio=2, cp_rank=2**30 - 2, cp_size=2**30 - 1, batch_size=1, seq_len=2)
    assert meta.num_groups == 2**30 - 1 and meta.ke.tolist() == [[2**30 - 2, 2**30 - 1]]


@pytest.mark.parametrize("name", ["compress_ratio", "cp_size", "batch_size", "seq_len"])
def test_metadata_huge_integers_are_named(name):
    kwargs = dict(compress_ratio=4, cp_size=1, batch_size=1, seq_len=4)
    kwargs[name] = HUGE
    with pytest.raises(ValueError, match=f"{name} must be <= 2147483647"):
        build_attention_metadata(**kwargs)
    with pytest.raises(ValueError, match="cp_rank must be"):
        build_attention_metadata(compress_ratio=4, cp_rank=HUGE, batch_size=1, seq_len=4)


def test_metadata_huge_seq_lens_padded_entry_is_named_before_allocating():
    with pytest.raises(ValueError, match="seq_lens_padded: the global row"):
        build_attention_metadata(compress_ratio=4, seq_lens=torch.tensor([[3]]), seq_lens_padded=torch.tensor([[2**40]]))
    with pytest.raises(ValueError, match="seq_lens: the global row"):
        build_attention_metadata(compress_ratio=4, seq_lens=torch.tensor([[2**40]]))
    with pytest.raises(ValueError, match="seq_lens_padded: lengths of row 0 sum to"):
        build_attention_metadata(compress_ratio=4, seq_lens=torch.tensor([[3]]), seq_lens_padded=torch.tensor([[2**40]]),
                                 seq_len=8)  # fmt: skip


def test_metadata_seq_lens_with_zero_rows_is_named():
    for name in ("seq_lens", "cu_seqlens"):
        with pytest.raises(ValueError, match=f"{name} has no rows"):
            build_attention_metadata(compress_ratio=4, **{name: torch.zeros(0, 2, dtype=torch.int64)})


@pytest.mark.parametrize("name", ["position_ids", "seq_lens", "cu_seqlens", "attention_mask", "packed_seq_ids"])
def test_metadata_meta_tensors_are_named(name):
    value = {"seq_lens": torch.tensor([[8]]), "cu_seqlens": torch.tensor([0, 8])}.get(name, torch.ones(1, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=f"{name} must hold data"):
        build_attention_metadata(compress_ratio=4, **{name: value.to("meta")})


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(position_ids=torch.zeros(1, 0, dtype=torch.int64)), "position_ids"),
        (dict(attention_mask=torch.zeros(2, 0, dtype=torch.bool)), "attention_mask"),
        (dict(packed_seq_ids=torch.zeros(1, 0, dtype=torch.int64)), "packed_seq_ids"),
        (dict(seq_lens=torch.tensor([[0, -1000]])), "seq_lens"),
        (dict(cu_seqlens=torch.tensor([0, 0])), "cu_seqlens"),
        (dict(batch_size=1, seq_len=0), "seq_len"),
    ],
)
def test_metadata_zero_length_names_the_argument_passed(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        build_attention_metadata(compress_ratio=4, **kwargs)


def test_metadata_cp_alignment_error_names_the_argument_passed():
    with pytest.raises(ValueError, match="^position_ids: under context parallelism"):
        build_attention_metadata(compress_ratio=4, cp_size=2, position_ids=torch.arange(6).view(1, 6))


def test_metadata_max_position_embeddings_is_enforced():
    lens = torch.tensor([[5, 11]])
    meta = build_attention_metadata(compress_ratio=4, seq_lens=lens, max_position_embeddings=11)
    assert int(meta.local_positions.max()) == 10
    with pytest.raises(ValueError, match="max_position_embeddings is 10, but row 0 token 15 is at position 10"):
        build_attention_metadata(compress_ratio=4, seq_lens=lens, max_position_embeddings=10)
    with pytest.raises(ValueError, match="max_position_embeddings must be >= 1"):
        build_attention_metadata(compress_ratio=4, seq_lens=lens, max_position_embeddings=0)
    with pytest.raises(TypeError, match="max_position_embeddings must be an int"):
        build_attention_metadata(compress_ratio=4, seq_lens=lens, max_position_embeddings=10.0)
    # Padding never counts, and the unpacked row's positions are global.
    meta = build_attention_metadata(compress_ratio=4, batch_size=2, seq_len=4, cp_rank=1, cp_size=2,
                                    max_position_embeddings=8)  # fmt: skip
    assert int(meta.local_positions.max()) == 7
    with pytest.raises(ValueError, match="max_position_embeddings is 7"):
        build_attention_metadata(compress_ratio=4, batch_size=2, seq_len=4, cp_rank=1, cp_size=2, max_position_embeddings=7)


def test_select_topk_on_meta_tensors_is_named():
    """A meta tensor has a shape but no values to select from: a ValueError naming scores."""
    with pytest.raises(ValueError, match="scores must hold data, got a tensor on the meta device"):
        select_topk(torch.empty(1, 4, 8, device="meta"), 2)
    ks = torch.zeros(1, 4, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="scores must hold data"):
        select_topk(torch.empty(1, 4, 8, device="meta"), 2, ks=ks, ke=ks)


@pytest.mark.parametrize("device,error", [("nonsense", ValueError), ("cuda:x", ValueError), (3.5, TypeError)])
def test_a_device_argument_that_is_no_device_is_named(device, error):
    from nemo_dsa.builder import build_model

    with pytest.raises(error, match="device must"):
        build_attention_metadata(compress_ratio=4, batch_size=1, seq_len=8, device=device)
    with pytest.raises(error, match="device must"):
        build_model({"vocab_size": 64}, device=device)
