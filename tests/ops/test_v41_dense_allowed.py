"""The dense-``allowed`` path of the V4.1 scorer on the CPU: ``mask_ranges`` (one read of the
mask, in words of 8, 4, 2 or 1 bytes) gives each row's tightest range, reads nothing on the host,
and the masked wrapper's composition (ranges, range scores, in-place fill of the holes) equals
the reference's dense mask and, for range masks, the ks / ke path: bitwise."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import generator, indexer_inputs
from _support.host_reads import count_host_reads
from nemo_dsa.ops.v41_indexer import kernels
from nemo_dsa.ops.v41_indexer.interface import _scores_torch
from nemo_dsa.ops.v41_indexer.kernels import mask_ranges
from nemo_dsa.ops.v41_indexer.naive import v41_scores


def brute_ranges(allowed):
    ks = torch.zeros(allowed.shape[:2], dtype=torch.int32)
    ke = torch.zeros_like(ks)
    for b in range(allowed.shape[0]):
        for s in range(allowed.shape[1]):
            keys = [j for j in range(allowed.shape[2]) if allowed[b, s, j]]
            if keys:
                ks[b, s], ke[b, s] = keys[0], keys[-1] + 1
    return ks, ke


def ragged_mask(batch, queries, num_keys, g, holes: bool):
    """Random ranges (empty, single-key, first and last key included), optionally with holes."""
    ks = torch.randint(0, num_keys + 1, (batch, queries), generator=g)
    ke = ks + torch.randint(0, num_keys + 1, (batch, queries), generator=g)
    ke = ke.clamp_max(num_keys)
    ks[0, 0], ke[0, 0] = 0, num_keys  # a full row
    ks[-1, -1], ke[-1, -1] = num_keys - 1, num_keys  # the last key alone
    ks[0, -1] = ke[0, -1] = 0  # nothing
    keys = torch.arange(num_keys)
    allowed = (keys >= ks[..., None]) & (keys < ke[..., None])
    if holes:
        allowed &= torch.rand(allowed.shape, generator=g) < 0.6
    return allowed


@pytest.mark.parametrize("num_keys", [1, 3, 8, 12, 37, 64, 66, 130])  # every word width, ragged tails
@pytest.mark.parametrize("holes", [False, True])
def test_mask_ranges_match_the_first_and_last_allowed_key(num_keys, holes):
    g = generator(num_keys + 100 * holes)
    allowed = ragged_mask(3, 29, num_keys, g, holes)
    ks, ke = mask_ranges(allowed)
    assert ks.dtype == ke.dtype == torch.int32
    want_ks, want_ke = brute_ranges(allowed)
    assert torch.equal(ks, want_ks) and torch.equal(ke, want_ke)


def test_mask_ranges_of_views_at_odd_offsets_and_strides():
    g = generator(3)
    base = ragged_mask(2, 40, 70, g, holes=True)
    for view in (base[:, 3:], base[:, :, 1:65], base[:, :, 5:], base.transpose(0, 1).contiguous().transpose(0, 1)):
        ks, ke = mask_ranges(view)
        want_ks, want_ke = brute_ranges(view)
        assert torch.equal(ks, want_ks) and torch.equal(ke, want_ke)


def test_mask_ranges_read_nothing_on_the_host():
    allowed = ragged_mask(2, 33, 48, generator(4), holes=True)
    mask_ranges(allowed)
    with count_host_reads() as reads:
        mask_ranges(allowed)
    assert reads.total == 0, reads.by_site()


@pytest.fixture
def range_scorer_on_cpu(monkeypatch):
    """The masked wrapper around the torch reference of the range scorer (the kernel's contract:
    -inf outside [ks, ke), every element written), its CUDA check off."""

    def check_inputs(q, k, w):
        return (*q.shape, k.shape[1])

    def range_scores(q, k, w, ks, ke, *, out):
        return out.copy_(v41_scores(q, k, w, ks, ke))

    monkeypatch.setattr(kernels, "_check_inputs", check_inputs)
    monkeypatch.setattr(kernels, "v41_scores_tilelang", range_scores)


@pytest.mark.parametrize("batch,queries,heads,dim,num_keys", [(1, 17, 8, 32, 9), (2, 40, 4, 16, 64), (3, 23, 16, 32, 37)])
def test_dense_allowed_equals_the_reference_and_the_ranges(range_scorer_on_cpu, batch, queries, heads, dim, num_keys):
    g = generator(batch * 1000 + num_keys)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, g, w_scale=0.1, w_dtype=torch.bfloat16)
    for holes in (False, True):
        allowed = ragged_mask(batch, queries, num_keys, g, holes)
        got = kernels.v41_scores_masked_tilelang(q, k, w, allowed)
        assert torch.equal(got, _scores_torch(q, k, w, allowed, None))
        assert torch.equal(torch.isneginf(got), ~allowed)
        if not holes:  # a range mask: the same scores as its ks / ke
            ks, ke = brute_ranges(allowed)
            assert torch.equal(got, v41_scores(q, k, w, ks, ke))
