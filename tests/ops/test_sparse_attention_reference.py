"""The window + compressed attention reference against a dense float64 softmax with sinks (CPU).

The oracle scores every query against every raw and compressed row, weights each row by how
many of the query's slots name it (0 = unseen: selected away, never multiplied), and adds the
sink to the denominator only. Covers packed documents (window_start), context-parallel shards
(N_raw > S), index lists with -1 padding and repeats, the [ks, ke) range, rows that see nothing,
NaN/inf in rows nobody sees, autograd gradients, and argument validation.
"""

import pytest
import torch
from _support.helpers import stable_seed

from nemo_dsa.ops.sparse_attention import sparse_window_attention, window_compressed_attention_reference


def _slot_counts(batch, seq_len, num_raw, num_comp, window_start, window, indices=None, ks=None, ke=None):
    """[B, S, N_raw + K] float64: how many of each query's slots name each row."""
    counts = torch.zeros(batch, seq_len, num_raw + num_comp, dtype=torch.float64)
    for b in range(batch):
        for i in range(seq_len):
            own = i + num_raw - seq_len
            for row in range(max(int(window_start[b, i]), own - window + 1, 0), own + 1):
                counts[b, i, row] += 1
            if indices is not None:
                for j in indices[b, i].tolist():
                    if j >= 0:
                        counts[b, i, num_raw + j] += 1
            elif ks is not None:
                for j in range(int(ks[b, i]), int(ke[b, i])):
                    counts[b, i, num_raw + j] += 1
    return counts


def _dense(q, kv, counts, sink, scale):
    """Dense float64 softmax over the rows with counts > 0 (each counted that often), sink in the
    denominator; (out, lse), lse = -inf and out = 0 for a row with neither keys nor sink."""
    logits = torch.einsum("bshd,bnd->bshn", q, kv) * scale
    seen = (counts > 0).unsqueeze(2)
    terms = [torch.where(seen, logits, float("-inf"))]
    if sink is not None:
        terms.append(sink.view(1, 1, -1, 1).expand(*logits.shape[:3], 1))
    stacked = torch.cat(terms, dim=-1)
    top = stacked.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.where(seen, counts.unsqueeze(2) * torch.exp(logits - top), torch.zeros_like(logits))
    denominator = weights.sum(-1, keepdim=True)
    if sink is not None:
        denominator = denominator + torch.exp(sink.view(1, 1, -1, 1) - top)
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    out = torch.einsum("bshn,bnd->bshd", weights / safe, kv)
    lse = torch.where(denominator > 0, torch.log(safe) + top, torch.full_like(top, float("-inf")))
    return out, lse.squeeze(-1)


def _problem(gen, *, batch=2, seq_len=9, history=0, heads=3, dim=8, num_comp=7, window=4, mode="indices",
             slots=5, dtype=torch.float64):
    num_raw = seq_len + history
    q = torch.randn(batch, seq_len, heads, dim, generator=gen, dtype=torch.float64).to(dtype)
    raw = torch.randn(batch, num_raw, dim, generator=gen, dtype=torch.float64).to(dtype)
    comp = torch.randn(batch, num_comp, dim, generator=gen, dtype=torch.float64).to(dtype)
    sink = torch.randn(heads, generator=gen, dtype=torch.float64).float()
    # Packed documents starting anywhere: each query's document starts at or before its own row.
    own = torch.arange(seq_len) + history
    window_start = (own - torch.randint(0, 6, (batch, seq_len), generator=gen)).clamp_min(0).to(torch.int32)
    window_start[0, 1] = own[1] + 1  # a padding query: no window keys
    kwargs = {}
    if mode == "indices":
        indices = torch.randint(-1, num_comp, (batch, seq_len, slots), generator=gen, dtype=torch.int32)
        indices[:, :, -1] = indices[:, :, 0]  # repeats count as separate slots
        indices[0, 1] = -1  # ... and that padding query selects nothing either
        kwargs["indices"] = indices
    else:
        ks = torch.randint(0, num_comp + 1, (batch, seq_len), generator=gen, dtype=torch.int32)
        ke = torch.minimum(ks + torch.randint(0, 5, (batch, seq_len), generator=gen, dtype=torch.int32),
                           torch.tensor(num_comp, dtype=torch.int32))
        ks[0, 1] = ke[0, 1] = 3
        kwargs["ks"], kwargs["ke"] = ks, ke
    return q, raw, comp, window_start, window, sink, kwargs


@pytest.mark.parametrize("mode", ["indices", "range"])
@pytest.mark.parametrize("history,window", [(0, 4), (5, 4), (3, 1), (0, 16)])
@pytest.mark.parametrize("with_sink", [True, False])
def test_reference_matches_dense_float64(mode, history, window, with_sink):
    gen = torch.Generator().manual_seed(stable_seed(mode, history, window, with_sink))
    q, raw, comp, ws, window, sink, kw = _problem(gen, history=history, window=window, mode=mode)
    sink = sink if with_sink else None
    scale = 0.37
    out, lse = window_compressed_attention_reference(q, raw, ws, window, comp, sink=sink, scale=scale, **kw)
    counts = _slot_counts(*q.shape[:2], raw.shape[1], comp.shape[1], ws, window, **kw)
    want_out, want_lse = _dense(q, torch.cat((raw, comp), 1), counts, None if sink is None else sink.double(), scale)
    # The reference computes in fp32 (whatever the input dtype): fp32 rounding only.
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    # The padding query sees nothing: zero output; lse is the sink alone, or -inf.
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    if sink is None:
        assert torch.isneginf(lse[0, 1]).all()
    else:
        torch.testing.assert_close(lse[0, 1], sink)


def test_window_only_and_public_torch_backend_agree():
    gen = torch.Generator().manual_seed(1)
    q, raw, comp, ws, window, sink, kw = _problem(gen, history=2, window=3)
    out, lse = sparse_window_attention(q, raw, ws, window, None, sink=sink, scale=0.5, backend="auto")
    counts = _slot_counts(*q.shape[:2], raw.shape[1], 0, ws, window)
    want_out, want_lse = _dense(q, raw, counts, sink.double(), 0.5)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)


def test_repeated_indices_count_once_per_slot():
    gen = torch.Generator().manual_seed(2)
    q, raw, comp, ws, window, sink, _ = _problem(gen, seq_len=4, history=0, window=1)
    once = torch.tensor([[[2, -1]] * 4, [[5, -1]] * 4], dtype=torch.int32)
    twice = torch.tensor([[[2, 2]] * 4, [[5, 5]] * 4], dtype=torch.int32)
    out_once, _ = window_compressed_attention_reference(q, raw, ws, 1, comp, indices=once, sink=None, scale=1.0)
    out_twice, _ = window_compressed_attention_reference(q, raw, ws, 1, comp, indices=twice, sink=None, scale=1.0)
    assert not torch.allclose(out_once, out_twice)
    counts = _slot_counts(2, 4, raw.shape[1], comp.shape[1], ws, 1, indices=twice)
    want, _ = _dense(q, torch.cat((raw, comp), 1), counts, None, 1.0)
    torch.testing.assert_close(out_twice, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("mode", ["indices", "range"])
def test_nan_and_inf_in_unseen_rows_reach_nothing(mode):
    gen = torch.Generator().manual_seed(3)
    q, raw, comp, ws, window, sink, kw = _problem(gen, seq_len=8, history=0, mode=mode, dtype=torch.float32)
    unseen = [5, 6]  # compressed rows no query sees
    if mode == "indices":
        kw["indices"][kw["indices"] >= 5] = -1
    else:
        kw["ke"].clamp_(max=5)
        kw["ks"] = torch.minimum(kw["ks"], kw["ke"])
    # Raw row 1 of batch 0 belongs to the padding query only if no later query's window reaches it.
    ws[0, 2:] = torch.clamp_min(ws[0, 2:], 2)
    leaves = [t.clone().requires_grad_(True) for t in (q, raw, comp, sink)]
    clean_out, clean_lse = window_compressed_attention_reference(*leaves[:2], ws, window, leaves[2], sink=leaves[3], scale=0.3, **kw)
    clean_out.square().sum().backward()
    clean_grads = [t.grad for t in leaves]

    raw_p, comp_p = raw.clone(), comp.clone()
    raw_p[0, 1] = float("nan")
    comp_p[:, unseen[0]] = float("inf")
    comp_p[:, unseen[1]] = float("nan")
    leaves = [t.clone().requires_grad_(True) for t in (q, raw_p, comp_p, sink)]
    out, lse = window_compressed_attention_reference(*leaves[:2], ws, window, leaves[2], sink=leaves[3], scale=0.3, **kw)
    out.square().sum().backward()
    assert torch.equal(out, clean_out) and torch.equal(lse, clean_lse)
    for got, want in zip((t.grad for t in leaves), clean_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rows_that_see_nothing_have_zero_gradients():
    gen = torch.Generator().manual_seed(4)
    q, raw, comp, ws, window, sink, kw = _problem(gen, seq_len=5, mode="indices", dtype=torch.float32)
    ws[:] = torch.arange(5, dtype=torch.int32) + 1  # every query is padding
    kw["indices"][:] = -1
    leaves = [t.clone().requires_grad_(True) for t in (q, raw, comp)]
    out, lse = window_compressed_attention_reference(*leaves[:2], ws, window, leaves[2], sink=None, scale=1.0, **kw)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    (out * torch.randn_like(out)).sum().backward()
    for leaf in leaves:
        assert torch.equal(leaf.grad, torch.zeros_like(leaf))


@pytest.mark.parametrize("mode", ["indices", "range"])
def test_autograd_gradients_match_dense_float64(mode):
    gen = torch.Generator().manual_seed(5)
    q, raw, comp, ws, window, sink, kw = _problem(gen, history=3, mode=mode, dtype=torch.float32)
    grad_out = torch.randn(q.shape, generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (q, raw, comp, sink)]
    out, _ = sparse_window_attention(*leaves[:2], ws, window, leaves[2], sink=leaves[3], scale=0.4, backend="torch", **kw)
    (out * grad_out).sum().backward()

    counts = _slot_counts(*q.shape[:2], raw.shape[1], comp.shape[1], ws, window, **kw)
    dense = [t.double().requires_grad_(True) for t in (q, raw, comp, sink)]
    want, _ = _dense(dense[0], torch.cat((dense[1], dense[2]), 1), counts, dense[3], 0.4)
    (want * grad_out.double()).sum().backward()
    for leaf, ref in zip(leaves, dense):
        torch.testing.assert_close(leaf.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)


def _args():
    gen = torch.Generator().manual_seed(6)
    q, raw, comp, ws, window, sink, kw = _problem(gen, dtype=torch.bfloat16)
    return dict(q=q, raw_kv=raw, window_start=ws, window=window, compressed_kv=comp, sink=sink, scale=0.5, **kw)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(q=torch.zeros(2, 9, 3)), ValueError, "q must have 4 dimensions"),
        (dict(raw_kv=torch.zeros(2, 9, 8)), TypeError, "raw_kv must have dtype bfloat16"),
        (dict(raw_kv=torch.zeros(2, 4, 8, dtype=torch.bfloat16)), ValueError, "raw_kv must hold at least"),
        (dict(window_start=torch.zeros(2, 9, dtype=torch.int64)), TypeError, "window_start must have dtype int32"),
        (dict(window=0), ValueError, "window must be >= 1"),
        (dict(window=2.0), TypeError, "window must be an int"),
        (dict(scale="x"), TypeError, "scale must be a float"),
        (dict(sink=torch.zeros(4)), ValueError, "sink must have shape"),
        (dict(indices=torch.full((2, 9, 3), 7, dtype=torch.int32)), ValueError, "indices must lie in"),
        (dict(indices=torch.full((2, 9, 3), -2, dtype=torch.int32)), ValueError, "indices must lie in"),
        (dict(indices=None), ValueError, "needs indices or"),
        (dict(ks=torch.zeros(2, 9, dtype=torch.int32), ke=torch.zeros(2, 9, dtype=torch.int32)), ValueError, "not both"),
        (dict(compressed_kv=None), ValueError, "need compressed_kv"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
        (dict(backend="tilelang"), ValueError, "needs CUDA tensors"),
    ],
)
def test_validation_names_the_argument(change, error, match):
    args = _args()
    args.update(change)
    with pytest.raises(error, match=match):
        sparse_window_attention(**args)


def test_range_mode_validates_ks_ke():
    args = _args()
    args.pop("indices")
    ks = torch.zeros(2, 9, dtype=torch.int32)
    with pytest.raises(ValueError, match="ke must be <="):
        sparse_window_attention(**args, ks=ks, ke=ks + 8)
    with pytest.raises(ValueError, match="ks and ke must be given together"):
        sparse_window_attention(**args, ks=ks, ke=None)
