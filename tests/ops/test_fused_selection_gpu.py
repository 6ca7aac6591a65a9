"""Streaming top-k with the TileLang scorers on the GPU (pytest -m gpu on the H200).

Three comparisons on fresh random inputs, ragged S and K, several B/H, packed unaligned documents
and a CP-local slice:
- against select_topk_reference on the full score matrix of the *same kernel*: bitwise (indices and scores),
  for several chunk budgets (chunks start on the kernels' tile boundaries);
- against the torch reference on quantised inputs (exact arithmetic, many ties): bitwise;
- against the torch reference on continuous inputs: the selected scores agree within docs/semantics.md's
  tolerance (scores are only 1e-5 / 1-ulp equal there, so index sets may differ at near-ties).
Plus the memory bound: the peak allocation beyond inputs and outputs stays within the budget.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import indexer_inputs, packed_ks_ke, random_ks_ke
from nemo_dsa.ops.fused_selection import DEFAULT_CHUNK_BYTES, v4_select_topk, v41_select_topk
from nemo_dsa.ops.fused_selection import interface as fused_interface
from nemo_dsa.ops.topk import pytorch_extract_topk_scores, select_topk_reference
from nemo_dsa.ops.v41_indexer import blocks_to_mask, candidate_blocks
from nemo_dsa.ops.v4_indexer import v4_logits
from nemo_dsa.ops.v41_indexer import v41_scores
from nemo_dsa.visibility import causal_ks_ke

pytestmark = pytest.mark.gpu
INF = float("inf")


def _layout(name, batch, queries, ratio, seed):
    g = torch.Generator().manual_seed(seed)
    if name == "causal":
        num_keys = queries // ratio
        ks, ke = causal_ks_ke(batch, queries, num_keys, ratio, torch.device("cpu"))
    elif name == "packed":
        docs = [[301, 1037, 5, queries - 301 - 1037 - 5 - 11], [queries - 777, 770]][:batch]
        docs += [[queries]] * (batch - len(docs))
        num_keys = queries // ratio
        ks, ke = packed_ks_ke(docs, queries, ratio)
    elif name == "cp":  # rank 2 of 4: local queries, global keys
        ranks, rank = 4, 2
        total = queries * ranks
        ks, ke = packed_ks_ke([[total // 3 + 1, total - total // 3 - 1]] * batch, total, ratio)
        ks, ke = ks[:, rank * queries : (rank + 1) * queries], ke[:, rank * queries : (rank + 1) * queries]
        num_keys = total // ratio
    else:
        num_keys = queries // ratio
        ks, ke = random_ks_ke(batch, queries, num_keys, g)
    return ks.contiguous().cuda(), ke.contiguous().cuda(), num_keys


def _v4_full(q, k, w, ks, ke, topk):
    from nemo_dsa.ops.v4_indexer.kernels import v4_logits_tilelang

    logits = v4_logits_tilelang(q, k, w, ks, ke)
    index = select_topk_reference(logits, topk)
    return logits, pytorch_extract_topk_scores(logits, index), index


def _v41_full(q, k, w, ks, ke):
    from nemo_dsa.ops.v41_indexer.kernels import v41_scores_tilelang

    return v41_scores_tilelang(q, k, w, ks, ke)


CASES = [  # layout, batch, queries, heads, dim, topk
    ("causal", 1, 4133, 64, 128, 512),
    ("causal", 2, 2999, 8, 64, 64),
    ("packed", 2, 5000, 32, 128, 2048),
    ("cp", 1, 1531, 16, 128, 1024),
    ("random", 3, 1000, 64, 128, 512),
]
BUDGETS = (DEFAULT_CHUNK_BYTES, 8 * 2**20, 300_000)


@pytest.mark.parametrize("layout,batch,queries,heads,dim,topk", CASES)
def test_v4_streaming_equals_the_kernels_full_matrix(layout, batch, queries, heads, dim, topk):
    ks, ke, num_keys = _layout(layout, batch, queries, 4, seed=queries)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, queries, w_dtype=torch.float32, w_scale="fan_in", device="cuda")
    logits, ref_scores, ref_index = _v4_full(q, k, w, ks, ke, topk)
    for budget in BUDGETS:
        scores, index = v4_select_topk(q, k, w, ks, ke, topk, backend="tilelang", chunk_bytes=budget)
        assert torch.equal(index, ref_index), budget
        assert torch.equal(scores, ref_scores), budget
    # Against the float64 reference: same selected scores within docs/semantics.md's tolerance.
    exact = v4_logits(q.double(), k.double(), w.double(), ks, ke)
    taken = pytorch_extract_topk_scores(exact, index.long())
    finite = index >= 0
    torch.testing.assert_close(scores[finite].double(), taken[finite], rtol=1e-5, atol=1e-5)
    best = torch.topk(exact.nan_to_num(neginf=-1e300), index.shape[-1], dim=-1).values
    torch.testing.assert_close(scores[finite].double(), best[finite], rtol=1e-5, atol=1e-5)
    assert torch.equal(finite, torch.isfinite(best) & (best > -1e299))


@pytest.mark.parametrize("layout,batch,queries,heads,dim,topk", CASES[:4])
def test_v4_streaming_quantised_equals_the_reference(layout, batch, queries, heads, dim, topk):
    ks, ke, num_keys = _layout(layout, batch, queries, 4, seed=queries + 1)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, queries + 1, w_dtype=torch.float32, quantised=True, w_scale="fan_in", device="cuda")
    logits = v4_logits(q, k, w, ks, ke)
    ref_index = select_topk_reference(logits, topk)
    scores, index = v4_select_topk(q, k, w, ks, ke, topk, backend="tilelang", chunk_bytes=8 * 2**20)
    assert torch.equal(index, ref_index)
    assert torch.equal(scores, pytorch_extract_topk_scores(logits, ref_index))


@pytest.mark.parametrize("layout,batch,queries,heads,dim,topk", CASES)
def test_v41_streaming_equals_the_kernels_full_matrix(layout, batch, queries, heads, dim, topk):
    ks, ke, num_keys = _layout(layout, batch, queries, 4, seed=queries + 2)
    for quantised in (False, True):
        q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, queries + 2, w_dtype=torch.bfloat16, quantised=quantised, w_scale="fan_in", device="cuda")
        full = _v41_full(q, k, w, ks, ke)
        ref = select_topk_reference(full, topk, order="index")
        for budget in BUDGETS:
            assert torch.equal(v41_select_topk(q, k, w, ks, ke, topk, backend="tilelang", chunk_bytes=budget), ref)
        if quantised:  # exact arithmetic: the reference agrees bitwise
            assert torch.equal(select_topk_reference(v41_scores(q, k, w, ks, ke), topk, order="index"), ref)


@pytest.mark.parametrize("layout", ["causal", "packed", "cp"])
def test_v41_candidate_blocks_on_the_gpu(layout):
    """The reindex path (the blocks applied inside the vector select, reading the candidate
    source's lists) equals masking the full scores first."""
    batch, queries, heads, dim, topk, block_size, topk_blocks = 2, 3001, 64, 128, 512, 8, 64
    ks, ke, num_keys = _layout(layout, batch, queries, 4, seed=5)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, 6, w_dtype=torch.bfloat16, w_scale="fan_in", device="cuda")
    q2, k2, w2 = indexer_inputs(batch, queries, heads, dim, num_keys, 7, w_dtype=torch.bfloat16, w_scale="fan_in", device="cuda")
    full, full2 = _v41_full(q, k, w, ks, ke), _v41_full(q2, k2, w2, ks, ke)
    ref_blocks = candidate_blocks(full, ks, ke, block_size, topk_blocks)
    keep = blocks_to_mask(ref_blocks, ks, ke, block_size, num_keys)
    ref_reindex = select_topk_reference(full2.masked_fill(~keep, -INF), topk, order="index")
    for budget in (DEFAULT_CHUNK_BYTES, 4 * 2**20):
        index, blocks = v41_select_topk(q, k, w, ks, ke, topk, candidate_block_size=block_size,
                                        candidate_topk_blocks=topk_blocks, chunk_bytes=budget)
        assert torch.equal(blocks, ref_blocks) and torch.equal(index, select_topk_reference(full, topk, order="index"))
        index2 = v41_select_topk(q2, k2, w2, ks, ke, topk, candidate_block_size=block_size,
                                 candidate_blocks=blocks, chunk_bytes=budget)
        assert torch.equal(index2, ref_reindex)


@pytest.mark.parametrize("mode", ["v4", "v41"])
def test_peak_memory_stays_within_the_chunk_budget(mode):
    batch, queries, heads, dim, topk, budget = 1, 16384, 64, 128, 512, 64 * 2**20
    ks, ke, num_keys = _layout("causal", batch, queries, 4, seed=0)
    w_dtype = torch.float32 if mode == "v4" else torch.bfloat16
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, 1, w_dtype=w_dtype, w_scale="fan_in", device="cuda")
    select = v4_select_topk if mode == "v4" else v41_select_topk
    select(q, k, w, ks, ke, topk, chunk_bytes=budget)  # compile outside the measurement
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = select(q, k, w, ks, ke, topk, chunk_bytes=budget)
    torch.cuda.synchronize()
    outputs = sum(t.numel() * t.element_size() for t in (result if isinstance(result, tuple) else (result,)))
    transient = torch.cuda.max_memory_allocated() - before - outputs
    full_matrix = batch * queries * num_keys * (4 if mode == "v4" else 2)
    # Slack: torch.topk's per-slice scratch, the planner's int32 ks/ke copies, allocator rounding.
    assert transient <= budget * 1.1 + 8 * 2**20, (transient, budget)
    assert transient < full_matrix, (transient, full_matrix)


@pytest.mark.parametrize("layout,batch,queries,heads,dim,topk", [CASES[0], CASES[2], CASES[3]])
def test_seed_api_streams_by_default_and_matches_the_materialised_path(layout, batch, queries, heads, dim, topk):
    """On CUDA v4_lighting_indexer streams its selection unless fused_topk=False; both paths give
    the same indices and scores bitwise, and gradients through them agree."""
    from nemo_dsa import v4_lighting_indexer

    ks, ke, num_keys = _layout(layout, batch, queries, 4, seed=queries + 3)
    q, k, w = indexer_inputs(batch, queries, heads, dim, num_keys, queries + 3, w_dtype=torch.float32, w_scale="fan_in", device="cuda")
    calls = []
    original = fused_interface.v4_select_topk_in_ranges
    fused_interface.v4_select_topk_in_ranges = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    try:
        results = {}
        for fused in (None, False):
            leaves = [t.transpose(0, 1).contiguous().requires_grad_() for t in (q, k, w)]
            score, index = v4_lighting_indexer(*leaves, 4, topk, ks=ks, ke=ke, fused_topk=fused)
            grad = torch.randn(score.shape, generator=torch.Generator().manual_seed(9)).cuda()
            torch.autograd.backward(score, torch.where(torch.isfinite(score), grad, 0.0))
            results[fused] = (score.detach(), index, *(t.grad for t in leaves))
            assert len(calls) == 1, "the default path streams once; fused_topk=False must not stream"
    finally:
        fused_interface.v4_select_topk_in_ranges = original
    streamed, full = results[None], results[False]
    assert torch.equal(streamed[0], full[0]) and torch.equal(streamed[1], full[1])
    # Same indices and scores: dq and dw come out bitwise equal; dk sums fp32 atomics in a
    # run-dependent order before its bf16 rounding, so it may differ by one bf16 step.
    assert torch.equal(streamed[2], full[2]) and torch.equal(streamed[4], full[4])
    dk, dk_full = streamed[3].float(), full[3].float()
    # One bf16 step is at most 2^-7 of the value; cancellation near zero gets a small absolute slack.
    assert bool(((dk - dk_full).abs() <= 2**-7 * dk_full.abs() + 1e-5 * dk_full.abs().max()).all())
