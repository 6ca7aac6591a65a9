"""NaN/inf never crosses a document: masked slots contribute exact zeros (select, never multiply).

Each test packs two documents per row, runs once on clean inputs and once with NaN and inf
written into one document (keys, values and one query), and asserts that the other document's
outputs and gradients are bitwise those of the clean run. The V4 indexer tests also check the
poisoned document itself: it never selects a non-finite logit, so no gradient of it is NaN and
the keys it never selected get exactly zero.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import generator, indexer_inputs, packed_ks_ke
from nemo_dsa.ops.sparse_attention import sparse_attention, sparse_window_attention
from nemo_dsa.ops.v4_indexer import v4_indexer_bshd
from nemo_dsa.ops.v4_indexer.kernels import dead_slots_to_zero_row
from nemo_dsa.ops.v4_indexer.naive import v4_backward

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    if actual.dtype in _INT_VIEW:
        actual, expected = actual.contiguous().view(_INT_VIEW[actual.dtype]), expected.contiguous().view(_INT_VIEW[expected.dtype])
    assert torch.equal(actual, expected), f"{what} differs from the clean run"


def poison_rows(t: torch.Tensor, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """A copy of ``t`` with NaN, +inf and -inf cycling through the given rows along ``dim``."""
    out = t.detach().clone()
    values = (float("nan"), float("inf"), float("-inf"))
    for n, r in enumerate(rows.tolist()):
        out.select(dim, r).select(-1, n % out.shape[-1]).fill_(values[n % 3])
        out.select(dim, r).select(-1, (n + 1) % out.shape[-1]).fill_(values[(n + 1) % 3])
    return out


# ----------------------------------------------------------------------------------------------
# Sparse attention (index lists, -1 slots)
# ----------------------------------------------------------------------------------------------

DOCS = [[10, 14], [15, 9]]  # two documents per row, S = 24
SEQ = 24


def _doc_bounds(row: list[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for length in row:
        bounds.append((start, start + length))
        start += length
    return bounds


def _doc_mask(poisoned: int) -> torch.Tensor:
    """bool [B, S]: the tokens of each row's document number ``poisoned``."""
    mask = torch.zeros(len(DOCS), SEQ, dtype=torch.bool)
    for b, row in enumerate(DOCS):
        a, e = _doc_bounds(row)[poisoned]
        mask[b, a:e] = True
    return mask


def _document_indices(width: int, g: torch.Generator) -> torch.Tensor:
    """int32 [B, S, width]: each query's keys drawn from its own document's rows <= itself, -1 in
    random slots (a -1 slot gathers row 0, which belongs to the first document)."""
    indices = torch.full((len(DOCS), SEQ, width), -1, dtype=torch.int32)
    for b, row in enumerate(DOCS):
        for a, e in _doc_bounds(row):
            for i in range(a, e):
                seen = torch.arange(a, i + 1)[torch.randperm(i + 1 - a, generator=g)][: width - 2]
                slots = torch.randperm(width, generator=g)[: seen.numel()]
                indices[b, i, slots] = seen.to(torch.int32)
    return indices


@pytest.mark.parametrize("poisoned", [0, 1], ids=["first_doc_owns_row_0", "second_doc"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_sparse_attention_reference_isolates_documents(poisoned, with_bias):
    g = generator(20 + poisoned)
    heads, dim, width = 3, 8, 6
    q = torch.randn(len(DOCS), SEQ, heads, dim, generator=g)
    kv = torch.randn(len(DOCS), SEQ, dim, generator=g)
    sink = torch.randn(heads, generator=g)
    bias = torch.randn(len(DOCS), SEQ, width, generator=g) if with_bias else None
    indices = _document_indices(width, g)
    upstream = torch.randn(len(DOCS), SEQ, heads, dim, generator=g)
    bad = _doc_mask(poisoned)
    bad_rows = bad.nonzero()

    def run(q_in, kv_in, bias_in):
        q_in, kv_in = q_in.clone().requires_grad_(), kv_in.clone().requires_grad_()
        out, lse = sparse_attention(q_in, kv_in, indices, sink, 0.5, bias=bias_in, chunk_size=7)
        (out * upstream).sum().backward()
        return out.detach(), lse, q_in.grad, kv_in.grad

    clean = run(q, kv, bias)
    q_bad, kv_bad = q.clone(), kv.clone()
    for b, i in bad_rows.tolist():
        kv_bad[b, i] = poison_rows(kv[b, i : i + 1], torch.tensor([0]), 0)[0]
    b0, i0 = bad_rows[0].tolist()
    q_bad[b0, i0, 0, 0] = float("nan")
    bias_bad = None
    if bias is not None:
        bias_bad = bias.clone()
        bias_bad[bad] = float("nan")
        bias_bad[indices < 0] = float("inf")  # bias is ignored at -1 slots, even when not finite
    poisoned_run = run(q_bad, kv_bad, bias_bad)
    good = ~bad
    for name, c, p in zip(("out", "lse", "dq", "dkv"), clean, poisoned_run):
        assert_bitwise(p[good], c[good], name)
    assert torch.isnan(poisoned_run[0][bad]).any()  # the poison did reach its own document


@pytest.mark.parametrize("poisoned", [0, 1])
@pytest.mark.parametrize("selection", ["ranges", "indices"])
def test_sparse_window_attention_reference_isolates_documents(poisoned, selection):
    ratio, window, heads, dim = 4, 5, 2, 8
    g = generator(40 + poisoned)
    ks, ke = packed_ks_ke(DOCS, SEQ, ratio)
    num_keys = SEQ // ratio
    q = torch.randn(len(DOCS), SEQ, heads, dim, generator=g)
    raw_kv = torch.randn(len(DOCS), SEQ, dim, generator=g)
    compressed = torch.randn(len(DOCS), num_keys, dim, generator=g)
    sink = torch.randn(heads, generator=g)
    window_start = torch.zeros(len(DOCS), SEQ, dtype=torch.int32)
    bad = _doc_mask(poisoned)
    bad_keys = torch.zeros(len(DOCS), num_keys, dtype=torch.bool)
    for b, row in enumerate(DOCS):
        for n, (a, e) in enumerate(_doc_bounds(row)):
            window_start[b, a:e] = a
            if n == poisoned:  # its groups, and the group straddling into it (visible to nobody)
                bad_keys[b, a // ratio : -(-e // ratio)] = True
    kwargs = dict(ks=ks, ke=ke)
    if selection == "indices":
        full = torch.arange(num_keys, dtype=torch.int32).expand(len(DOCS), SEQ, num_keys)
        picks = torch.where((full >= ks[..., None]) & (full < ke[..., None]), full, -1)
        kwargs = dict(indices=picks.flip(-1).contiguous())  # -1s first, then descending rows
    upstream = torch.randn(len(DOCS), SEQ, heads, dim, generator=g)

    def run(q_in, raw_in, comp_in):
        q_in, raw_in, comp_in = (t.clone().requires_grad_() for t in (q_in, raw_in, comp_in))
        out, lse = sparse_window_attention(q_in, raw_in, window_start, window, comp_in, sink=sink, scale=0.3,
                                           backend="torch", **kwargs)  # fmt: skip
        (out * upstream).sum().backward()
        return out.detach(), lse, q_in.grad, raw_in.grad, comp_in.grad

    clean = run(q, raw_kv, compressed)
    q_bad, raw_bad, comp_bad = q.clone(), raw_kv.clone(), compressed.clone()
    raw_bad[bad] = float("nan")
    raw_bad[bad.nonzero()[0].tolist()[0], bad.nonzero()[0].tolist()[1], 1] = float("inf")
    comp_bad[bad_keys] = float("inf")
    q_bad[bad] = float("nan")
    poisoned_run = run(q_bad, raw_bad, comp_bad)
    good, good_keys = ~bad, ~bad_keys
    for name, c, p in zip(("out", "lse", "dq", "draw_kv"), clean[:4], poisoned_run[:4]):
        assert_bitwise(p[good], c[good], name)
    assert_bitwise(poisoned_run[4][good_keys], clean[4][good_keys], "dcompressed_kv")


# ----------------------------------------------------------------------------------------------
# V4 indexer: selection never takes a non-finite logit; backward sends nothing to dead slots
# ----------------------------------------------------------------------------------------------

V4_DOCS = [[13, 19], [18, 14]]  # S = 32, R = 4: the group [12, 16) of row 0 straddles both documents
V4_SEQ, V4_RATIO = 32, 4


def _v4_case(seed: int):
    batch, heads, dim, num_keys = len(V4_DOCS), 4, 16, V4_SEQ // V4_RATIO
    q, k, w = indexer_inputs(batch, V4_SEQ, heads, dim, num_keys, seed)
    ks, ke = packed_ks_ke(V4_DOCS, V4_SEQ, V4_RATIO)
    doc = torch.zeros(batch, V4_SEQ, dtype=torch.long)
    key_doc = torch.full((batch, num_keys), -1, dtype=torch.long)  # -1: a group no document owns
    for b, row in enumerate(V4_DOCS):
        for n, (a, e) in enumerate(_doc_bounds(row)):
            doc[b, a:e] = n
            key_doc[b, -(-a // V4_RATIO) : e // V4_RATIO] = n
    return q, k, w, ks, ke, doc, key_doc


@pytest.mark.parametrize("poisoned", [0, 1])
@pytest.mark.parametrize("fused_topk", [False, True])
def test_v4_indexer_isolates_documents_and_dead_keys(poisoned, fused_topk):
    q, k, w, ks, ke, doc, key_doc = _v4_case(60 + poisoned)
    bad, good = doc == poisoned, doc != poisoned
    bad_keys = (key_doc == poisoned) | (key_doc < 0)  # the straddling group too (nobody sees it)
    topk = 3
    upstream = torch.randn(q.shape[0], V4_SEQ, topk, generator=generator(7))

    def run(q_in, k_in, w_in):
        q_in, k_in, w_in = (t.clone().requires_grad_() for t in (q_in, k_in, w_in))
        score, index = v4_indexer_bshd(q_in, k_in, w_in, V4_RATIO, topk, ks=ks, ke=ke, backend="torch",
                                       fused_topk=fused_topk)  # fmt: skip
        torch.where(index >= 0, score * upstream, 0.0).sum().backward()
        return score.detach(), index, q_in.grad, k_in.grad, w_in.grad

    clean = run(q, k, w)
    k_bad = k.detach().clone()
    poison_keys = bad_keys.nonzero()
    for n, (b, j) in enumerate(poison_keys.tolist()):
        # Whole rows of NaN or +inf: every logit over them is NaN (q has mixed signs), so no
        # query may select them.
        k_bad[b, j] = (float("nan"), float("inf"))[n % 2]
    q_bad = q.detach().clone()
    b0, i0 = bad.nonzero()[-1].tolist()  # the poisoned document's last query: it sees keys
    q_bad[b0, i0, 1, 3] = float("nan")
    score, index, dq, dk, dw = run(q_bad, k_bad, w)

    for name, c, p in zip(("index_score", "topk_indices", "dq", "dw"), clean[:2] + (clean[2], clean[4]), (score, index, dq, dw)):
        assert_bitwise(p[good], c[good], name)
    assert_bitwise(dk[~bad_keys], clean[3][~bad_keys], "dk")
    # Inside the poisoned document: nothing non-finite is selected, so no gradient is NaN, the
    # keys it never selected get exactly zero, and the all-NaN query selects nothing.
    for b in range(q.shape[0]):
        chosen = set(index[b][index[b] >= 0].tolist())
        assert not chosen & set(torch.nonzero(bad_keys[b]).flatten().tolist())
    assert bool((index[b0, i0] == -1).all())
    assert torch.isfinite(score[index >= 0]).all()
    for name, grad in (("dq", dq), ("dk", dk), ("dw", dw)):
        assert torch.isfinite(grad.float()).all(), f"{name} holds NaN/inf"
    assert bool((dk[bad_keys] == 0).all())
    assert bool((dq[b0, i0] == 0).all()) and bool((dw[b0, i0] == 0).all())


def test_v4_backward_reference_dead_slots_read_non_finite_key_zero():
    """Given indices: -1 and out-of-range slots (which read key 0 or an invisible key) add exact
    zeros even when those keys are NaN/inf and the query is NaN where it has no live slot."""
    q, k, w, ks, ke, doc, key_doc = _v4_case(3)
    g = generator(4)
    count = 4
    indices = torch.randint(-1, k.shape[1], (q.shape[0], V4_SEQ, count), generator=g, dtype=torch.int32)
    grad = torch.randn(q.shape[0], V4_SEQ, count, generator=g)
    live = (indices >= ks[..., None]) & (indices < ke[..., None])
    dead_keys = torch.ones(k.shape[:2], dtype=torch.bool)
    for b in range(k.shape[0]):
        dead_keys[b, indices[b][live[b]].long()] = False
    k_bad = k.clone()
    k_bad[dead_keys] = float("nan")
    q_bad = q.clone()
    no_live = ~live.any(-1)
    q_bad[no_live] = float("inf")
    clean = v4_backward(q, k, w, ks, ke, indices, grad)
    poisoned = v4_backward(q_bad, k_bad, w, ks, ke, indices, grad)
    for name, c, p in zip(("dq", "dk", "dw"), clean, poisoned):
        assert_bitwise(p, c, name)
    assert bool((clean[1][dead_keys] == 0).all()) and bool((clean[0][no_live] == 0).all())


def _emulated_backward_kernel(q, k, w, ks, ke, indices, grad):
    """The arithmetic of ``v4_topk_backward_kernel`` in torch, multiplications as it does them:
    every slot gathers row clamp(index, 0, K - 1), dead slots get g = 0 (multiplied, not selected),
    dk is added only for live slots."""
    num_keys = k.shape[1]
    start, end = ks.clamp_min(0)[..., None], ke.clamp_max(num_keys)[..., None]
    live = (indices >= start) & (indices < end)
    g = torch.where(live, grad, 0.0).double()
    rows = indices.long().clamp(0, num_keys - 1)
    gathered = torch.stack([k[b, rows[b]] for b in range(k.shape[0])]).double()  # [B, S, T, D]
    s = torch.einsum("bstd,bshd->bsth", gathered, q.double())
    dw = (g[..., None] * s.clamp_min(0)).sum(2)
    p = torch.where(s > 0, g[..., None] * w.double()[:, :, None, :], 0.0)  # [B, S, T, H]
    dq = torch.einsum("bstd,bsth->bshd", gathered, p)
    dkg = torch.einsum("bsth,bshd->bstd", p, q.double())
    dk = torch.zeros(k.shape, dtype=torch.float64)
    for b in range(k.shape[0]):
        dk[b].index_put_((rows[b][live[b]],), dkg[b][live[b]], accumulate=True)
    return dq, dk, dw


def test_v4_kernel_wrapper_points_dead_slots_at_a_zero_row():
    """The launch wrapper's remapping, checked with a torch emulation of the kernel's arithmetic
    (the kernel itself runs only on Hopper): without it a NaN key 0 read by a -1 slot makes dq
    NaN; with it the result equals the reference and no NaN crosses."""
    q, k, w, ks, ke, _, _ = _v4_case(5)
    g = generator(6)
    indices = torch.randint(-1, k.shape[1], (q.shape[0], V4_SEQ, 4), generator=g, dtype=torch.int32)
    grad = torch.randn(q.shape[0], V4_SEQ, 4, generator=g)
    live = (indices >= ks[..., None]) & (indices < ke[..., None])
    k_bad = k.clone()
    dead_keys = torch.ones(k.shape[:2], dtype=torch.bool)
    for b in range(k.shape[0]):
        dead_keys[b, indices[b][live[b]].long()] = False
    dead_keys[:, 0] = True  # key 0 is read by every -1 slot
    indices[live & (indices == 0)] = -1
    k_bad[dead_keys] = float("nan")

    unprotected, _, _ = _emulated_backward_kernel(q.float(), k_bad.float(), w, ks, ke, indices, grad)
    assert torch.isnan(unprotected).any()  # the defect the wrapper removes

    k_rows, idx_rows, ks_rows, ke_rows = dead_slots_to_zero_row(k_bad, indices, ks, ke)
    assert torch.equal(k_rows[:, 1:].view(torch.int16), k_bad.view(torch.int16)) and bool((k_rows[:, 0] == 0).all())
    dq, dk_rows, dw = _emulated_backward_kernel(q.float(), k_rows.float(), w, ks_rows, ke_rows, idx_rows, grad)
    ref_dq, ref_dk, ref_dw = v4_backward(q.double(), k.double(), w.double(), ks, ke, indices, grad.double())
    assert bool((dk_rows[:, 0] == 0).all())
    torch.testing.assert_close(dq, ref_dq, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dk_rows[:, 1:], ref_dk, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------------------------
# V4.1: scores and the streamed selection (forward only)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("poisoned", [0, 1])
def test_v41_scores_and_fused_selection_isolate_documents(poisoned):
    from nemo_dsa.ops.fused_selection import v41_select_topk
    from nemo_dsa.ops.v41_indexer import indexer_scores

    q, k, _, ks, ke, doc, key_doc = _v4_case(80 + poisoned)
    w = torch.randn(q.shape[:3], generator=generator(81)).bfloat16()
    bad, good = doc == poisoned, doc != poisoned
    bad_keys = (key_doc == poisoned) | (key_doc < 0)
    k_bad, q_bad = k.clone(), q.clone()
    k_bad[bad_keys] = float("nan")
    k_bad[bad_keys.nonzero()[0].tolist()[0], bad_keys.nonzero()[0].tolist()[1]] = float("inf")
    q_bad[bad] = float("inf")
    for name, run in (
        ("scores", lambda qq, kk: indexer_scores(qq, kk, w, ks=ks, ke=ke, backend="torch")),
        ("indices", lambda qq, kk: v41_select_topk(qq, kk, w, ks, ke, 3, backend="torch", chunk_bytes=4096)),
    ):
        clean, dirty = run(q, k), run(q_bad, k_bad)
        assert_bitwise(dirty[good], clean[good], name)
