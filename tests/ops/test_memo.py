"""Facts remembered on metadata tensors: reused while unchanged, recomputed after any change."""

import gc
import io

import pytest
import torch

from helpers import indexer_inputs
from nemo_dsa.memo import anchors, memo_on_tensors
from nemo_dsa.ops.fused_selection import v4_select_topk
from nemo_dsa.visibility import check_ks_ke


def test_reused_for_the_same_tensors_and_recomputed_after_changes():
    ks, ke = torch.zeros(1, 4, dtype=torch.int32), torch.arange(1, 5, dtype=torch.int32)[None]
    calls = []

    def compute():
        calls.append(1)
        return int(ke.sum())

    assert memo_on_tensors((ks, ke), "sum", compute) == 10
    assert memo_on_tensors((ks, ke), "sum", compute) == 10 and len(calls) == 1
    ke += 1  # in place: a new version
    assert memo_on_tensors((ks, ke), "sum", compute) == 14 and len(calls) == 2
    other = ke.clone()  # equal values, another object
    assert memo_on_tensors((ks, other), "sum", compute) == 14 and len(calls) == 3
    assert memo_on_tensors((ks, ke), "other key", compute) == 14 and len(calls) == 4


def test_validation_still_rejects_after_an_in_place_change():
    ks, ke = torch.zeros(1, 3, dtype=torch.int32), torch.ones(1, 3, dtype=torch.int32)
    check_ks_ke(ks, ke, batch=1, queries=3, num_keys=2, device=ks.device)
    ke[0, 1] = 5
    with pytest.raises(ValueError, match="ke must be <= the number of keys 2"):
        check_ks_ke(ks, ke, batch=1, queries=3, num_keys=2, device=ks.device)


def test_streamed_selection_replans_when_ranges_change():
    q, k, w = indexer_inputs(1, 300, 2, 16, 40, 0, w_scale=1.0)
    ks = torch.zeros(1, 300, dtype=torch.int32)
    ke = torch.full((1, 300), 40, dtype=torch.int32)
    first = v4_select_topk(q, k, w, ks, ke, 8, chunk_bytes=2**14)[1]
    ke[0, :150] = 10  # the same tensor object, new ranges: the cached plan must not be reused
    second = v4_select_topk(q, k, w, ks, ke, 8, chunk_bytes=2**14)[1]
    assert int(second[0, :150].max()) < 10 < int(first[0, :150].max())


def test_inference_tensors_are_never_remembered():
    with torch.inference_mode():
        ks, ke = torch.zeros(1, 4, dtype=torch.int32), torch.full((1, 4), 2, dtype=torch.int32)
    calls = []
    for _ in range(2):
        assert memo_on_tensors((ks, ke), "sum", lambda: calls.append(1) or int(ke.sum())) == 8
    assert len(calls) == 2
    check_ks_ke(ks, ke, batch=1, queries=4, num_keys=2, device=ks.device)


def test_streamed_selection_under_inference_mode():
    q, k, w = indexer_inputs(1, 64, 2, 16, 16, 1, w_scale=1.0)
    with torch.inference_mode():
        ks = torch.zeros(1, 64, dtype=torch.int32)
        ke = torch.full((1, 64), 16, dtype=torch.int32)
        scores, index = v4_select_topk(q, k, w, ks, ke, 4)
    assert index.shape == (1, 64, 4) and bool((index >= 0).all())


def test_tensors_still_pickle_and_facts_go_with_them():
    ks, ke = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, 4, dtype=torch.int32)
    check_ks_ke(ks, ke, batch=1, queries=4, num_keys=2, device=ks.device)
    assert id(ks) in anchors()
    buffer = io.BytesIO()
    torch.save({"ks": ks, "ke": ke}, buffer)  # nothing unpicklable attached to the tensors
    buffer.seek(0)
    assert torch.equal(torch.load(buffer)["ke"], ke)
    anchor = id(ks)
    del ks
    gc.collect()
    assert anchor not in anchors()
