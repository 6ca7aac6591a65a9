"""DSASparseAttention against a brute-force dense oracle, plus causality, isolation and grads."""

from __future__ import annotations

import math

import pytest
import torch

from _support.dsa_layer_runs import make_layer, packed_ids, run
from _support.helpers import tiny_config
from nemo_dsa.layers.context import LocalContext
from nemo_dsa.layers.shared_state import SharedLayerState
from nemo_dsa.layers.sparse_attention import with_history
from nemo_dsa.metadata import build_attention_metadata
from nemo_dsa.ops.sparse_attention.naive import sparse_attention


# ---------------------------------------------------------------- brute-force oracle (float64)


def _rms(x, weight=None, eps=1e-6):
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


def _rope(v, position, rope_dim, theta, sign=1.0):
    """Interleaved pairs as complex numbers (a different formulation from the module's)."""
    out = v.clone()
    pairs = v[..., -rope_dim:].reshape(*v.shape[:-1], rope_dim // 2, 2)
    z = torch.complex(pairs[..., 0], pairs[..., 1])
    freqs = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    z = z * torch.exp(1j * sign * position * freqs)
    out[..., -rope_dim:] = torch.stack((z.real, z.imag), -1).reshape(*v.shape[:-1], rope_dim)
    return out


def _pool(comp, tokens_x, docs, local_pos, j, cfg):
    """Oracle compressed key j (or None when the group is invalid)."""
    r, d = comp.ratio, comp.head_dim
    span = range(j * r, (j + 1) * r)
    doc = docs[j * r]
    if doc == 0 or any(docs[t] != doc for t in span):
        return None
    wkv, wgate, ape = comp.wkv.weight.double(), comp.wgate.weight.double(), comp.ape.double()
    vals, logits = [], []
    for slot, t in enumerate(span):
        v, g = wkv @ tokens_x[t], wgate @ tokens_x[t] + ape[slot]
        vals.append(v[d:] if comp.overlap else v)
        logits.append(g[d:] if comp.overlap else g)
    if comp.overlap and j > 0 and all(docs[t] == doc for t in range((j - 1) * r, j * r)):
        for slot, t in enumerate(range((j - 1) * r, j * r)):
            vals.append((wkv @ tokens_x[t])[:d])
            logits.append((wgate @ tokens_x[t] + ape[slot])[:d])
    weights = torch.softmax(torch.stack(logits), dim=0)
    pooled = _rms((weights * torch.stack(vals)).sum(0), comp.norm.weight)
    return _rope(pooled, local_pos[j * r], cfg.qk_rope_head_dim, cfg.rope_theta)


def oracle(layer, x, ids):
    """Dense per-query loops straight from docs/semantics.md: window + every visible group + sink."""
    cfg, r = layer.config, layer.ratio
    x = x.double()
    batch, seq, _ = x.shape
    out = torch.zeros(batch, seq, cfg.hidden_size, dtype=torch.float64)
    for b in range(batch):
        docs = ids[b].tolist()
        local = [0] * seq
        for t in range(1, seq):
            local[t] = local[t - 1] + 1 if docs[t] == docs[t - 1] else 0
        q_lat = _rms(x[b] @ layer.wq_a.weight.double().T, layer.q_norm.weight)
        q = _rms((q_lat @ layer.wq_b.weight.double().T).view(seq, layer.n_heads, layer.head_dim))
        kv = _rms(x[b] @ layer.wkv.weight.double().T, layer.kv_norm.weight)
        q = torch.stack([_rope(q[t], local[t], cfg.qk_rope_head_dim, cfg.rope_theta) for t in range(seq)])
        kv = torch.stack([_rope(kv[t], local[t], cfg.qk_rope_head_dim, cfg.rope_theta) for t in range(seq)])
        groups = [_pool(layer.compressor, x[b], docs, local, j, cfg) for j in range(seq // r)] if r else []
        for i in range(seq):
            if docs[i] == 0:
                continue
            keys = [kv[t] for t in range(max(0, i - cfg.sliding_window + 1), i + 1) if docs[t] == docs[i]]
            keys += [g for j, g in enumerate(groups) if g is not None and docs[j * r] == docs[i] and (j + 1) * r - 1 <= i]
            k = torch.stack(keys)
            heads = []
            for h in range(layer.n_heads):
                logits = (k @ q[i, h]) / math.sqrt(layer.head_dim)
                denominator = logits.exp().sum() + layer.attn_sink[h].double().exp()
                heads.append(_rope((logits.exp() / denominator) @ k, local[i], cfg.qk_rope_head_dim, cfg.rope_theta, -1.0))
            out[b, i] = layer.wo.weight.double() @ torch.cat(heads)
    return out


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("layer_idx, ratio", [(0, 0), (2, 2), (1, 4), (1, 8)])
def test_matches_dense_oracle(layer_idx, ratio):
    """Window, visible groups (all of them: topk >= K on ratio 4), sink, padding, unaligned docs."""
    ratios = [0, 4, 2, 4]
    ratios[layer_idx] = ratio
    cfg = tiny_config(compress_ratios=tuple(ratios), index_topk=64, sliding_window=3)
    layer = make_layer(cfg, layer_idx, seed=ratio)
    ids = packed_ids([[5, 14, 3], [23]], seq=26)  # docs start at 0, 5, 19; rows end in padding
    x = torch.randn(2, 26, cfg.hidden_size)
    out, _ = run(layer, x, ids)
    torch.testing.assert_close(out.double(), oracle(layer, x, ids), rtol=1e-4, atol=1e-5)


def test_sink_and_empty_rows():
    cfg = tiny_config()
    layer = make_layer(cfg, 1)
    ids = packed_ids([[7, 9]], seq=19)
    x = torch.randn(1, 19, cfg.hidden_size)
    out, _ = run(layer, x, ids)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 16:], torch.zeros_like(out[0, 16:]))  # padding sees nothing
    # A huge sink takes the whole softmax mass: every real query's output vanishes.
    with torch.no_grad():
        layer.attn_sink.fill_(60.0)
    out, _ = run(layer, x, ids)
    assert out.abs().max() < 1e-12


def test_sparse_attention_op_empty_rows_and_grads():
    q = torch.randn(2, 5, 3, 8, requires_grad=True)
    kv = torch.randn(2, 7, 8, requires_grad=True)
    idx = torch.randint(-1, 7, (2, 5, 4))
    idx[0, 2] = -1
    sink = torch.randn(3, requires_grad=True)
    for s in (sink, None):
        out, lse = sparse_attention(q, kv, idx, s, 0.3, chunk_size=2)
        assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2]))
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, kv))
    grads = []
    for kwargs in (dict(), dict(chunk_size=1), dict(chunk_size=2, recompute=False)):
        for t in (q, kv, sink):
            t.grad = None
        out, lse = sparse_attention(q, kv, idx, sink, 0.3, **kwargs)
        (out.square().sum() + lse.sum()).backward()
        grads.append((out.detach(), lse.detach(), q.grad, kv.grad, sink.grad))
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="indices"):
        sparse_attention(q, kv, torch.full((2, 5, 4), 7), sink, 0.3)
    # No keys at all (kv with N = 0, every index -1): zeros out, lse = the sink, finite grads.
    empty_kv = kv[:, :0].detach().requires_grad_(True)
    out, lse = sparse_attention(q, empty_kv, torch.full((2, 5, 4), -1), sink, 0.3)
    assert torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(lse, sink.detach().expand(2, 5, 3))
    out.sum().backward()
    assert empty_kv.grad.shape == empty_kv.shape
    with pytest.raises(ValueError, match="kv"):
        sparse_attention(q, kv[..., :4], idx, sink, 0.3)


@pytest.mark.parametrize("scoring", ["v4", "v41"])
def test_causality_and_document_isolation(scoring):
    cfg = tiny_config(scoring=scoring, compress_ratios=(4, 4, 2, 0))
    layer = make_layer(cfg, 0, seed=3)
    ids = packed_ids([[6, 17, 7], [3, 27]], seq=31)  # unaligned starts 6 and 23 / 3
    x = torch.randn(2, 31, cfg.hidden_size)
    base, _ = run(layer, x, ids)
    # Perturb a future token: every earlier output is unchanged.
    for t in (9, 20):
        y = x.clone()
        y[:, t] += torch.randn(cfg.hidden_size)
        out, _ = run(layer, y, ids)
        torch.testing.assert_close(out[:, :t], base[:, :t], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, t:], base[:, t:])
    # Perturb document 2 of row 0 (tokens 6..22): documents 1 and 3 do not notice.
    y = x.clone()
    y[0, 6:23] = torch.randn(17, cfg.hidden_size)
    out, _ = run(layer, y, ids)
    torch.testing.assert_close(out[0, :6], base[0, :6], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[0, 23:], base[0, 23:], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1], base[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("scoring", ["v4", "v41"])
def test_packed_equals_per_document(scoring):
    """Documents starting on multiples of every ratio give the same outputs packed or alone."""
    cfg = tiny_config(scoring=scoring, compress_ratios=(4, 8, 4, 0))
    layers = [make_layer(cfg, i, seed=10 + i) for i in range(3)]
    lengths = [[16, 21], [8, 24, 5]]
    ids = packed_ids(lengths, seq=40)
    x = torch.randn(2, 40, cfg.hidden_size)
    packed = []
    shared = SharedLayerState()
    for layer in layers:
        meta = build_attention_metadata(compress_ratio=layer.ratio, packed_seq_ids=ids)
        packed.append(layer(x, meta, LocalContext(), shared)[0])
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            shared = SharedLayerState()
            for layer, full in zip(layers, packed):
                meta = build_attention_metadata(compress_ratio=layer.ratio, batch_size=1, seq_len=n)
                alone, _ = layer(x[b : b + 1, start : start + n], meta, LocalContext(), shared)
                torch.testing.assert_close(full[b, start : start + n], alone[0], rtol=1e-5, atol=1e-5)
            start += n


def _indexer_grads(cfg):
    layer = make_layer(cfg, 1)
    ids = packed_ids([[13, 10]], seq=24)
    x = torch.randn(1, 24, cfg.hidden_size)
    out, aux = run(layer, x, ids)
    loss = out.square().mean() + (aux if aux is not None else 0.0)
    loss.backward()
    return layer, aux


def test_v41_indexer_is_frozen():
    layer, aux = _indexer_grads(tiny_config(scoring="v41", indexer_kl_coef=0.5))
    assert aux is None
    params = list(layer.indexer.parameters())
    assert params and all(not p.requires_grad and p.grad is None for p in params)
    assert layer.wq_a.weight.grad is not None and layer.compressor.wkv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kl_coef, straight_through", [(0.0, True), (0.5, True), (0.5, False)])
def test_v4_indexer_trains(kl_coef, straight_through):
    cfg = tiny_config(scoring="v4", indexer_kl_coef=kl_coef, indexer_straight_through=straight_through)
    layer, aux = _indexer_grads(cfg)
    assert (aux is not None) == (kl_coef > 0)
    if aux is not None:
        assert torch.isfinite(aux) and aux >= 0
    for name, p in layer.indexer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("straight_through", [False, True])
def test_v4_indexer_signals_reach_only_the_indexer(straight_through):
    """The indexer's inputs are detached: the KL loss (and the straight-through term's part of
    the LM gradient) train the indexer's own parameters and nothing else."""
    cfg = tiny_config(scoring="v4", indexer_kl_coef=0.5, indexer_straight_through=straight_through)
    layer = make_layer(cfg, 1)
    ids = packed_ids([[13, 10]], seq=24)
    x = torch.randn(1, 24, cfg.hidden_size, requires_grad=True)
    out, aux = run(layer, x, ids)
    aux.backward()  # the KL loss alone
    indexer = {id(p) for p in layer.indexer.parameters()}
    for name, p in layer.named_parameters():
        if id(p) in indexer:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    assert x.grad is None
    if straight_through:  # the LM gradient through the straight-through term: same split
        layer.zero_grad(set_to_none=True)
        out, _ = run(layer, x, ids)
        lm_only = torch.autograd.grad(out.square().sum(), [p for p in layer.parameters() if id(p) in indexer])
        assert all(g.abs().sum() > 0 for g in lm_only)
        without = tiny_config(scoring="v4", indexer_kl_coef=0.5, indexer_straight_through=False)
        plain = make_layer(without, 1)
        plain.load_state_dict(layer.state_dict())
        x2 = x.detach().clone().requires_grad_()
        x1 = x.detach().clone().requires_grad_()
        run(plain, x2, ids)[0].square().sum().backward()
        run(layer, x1, ids)[0].square().sum().backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)  # nothing reaches the main graph


def test_v4_indexer_without_any_signal_gets_no_grad():
    layer, aux = _indexer_grads(tiny_config(scoring="v4", indexer_straight_through=False))
    assert aux is None
    assert all(p.grad is None for p in layer.indexer.parameters())


def test_straight_through_leaves_forward_unchanged():
    cfg = tiny_config(scoring="v4", indexer_straight_through=True)
    layer = make_layer(cfg, 1)
    ids = packed_ids([[11, 12]], seq=25)
    x = torch.randn(1, 25, cfg.hidden_size)
    with_st, _ = run(layer, x, ids)
    layer.config.indexer_straight_through = False
    without, _ = run(layer, x, ids)
    assert torch.equal(with_st, without)


def test_with_history_local_context_pads_zeros():
    x = torch.randn(2, 4, 3)
    h = with_history(LocalContext(), x, 6)
    assert h.shape == (2, 10, 3) and torch.equal(h[:, 6:], x) and not h[:, :6].any()


def test_indexer_kl_loss_against_dense_formula():
    from nemo_dsa.layers.indexer_loss import indexer_kl_loss

    torch.manual_seed(6)
    batch, seq, heads, dim, window, groups, topk = 2, 6, 3, 8, 4, 5, 3
    q = torch.randn(batch, seq, heads, dim)
    window_kv, compressed_kv = torch.randn(batch, window, dim), torch.randn(batch, groups, dim)
    window_idx = torch.randint(0, window, (batch, seq, 2))
    selected = torch.stack([torch.randperm(groups)[:topk] for _ in range(batch * seq)]).view(batch, seq, topk)
    selected[0, 1, 2] = -1
    selected[1, 3] = -1  # a query without selected groups contributes nothing
    sink = torch.randn(heads)
    score = torch.randn(batch, seq, topk).masked_fill(selected < 0, float("-inf")).requires_grad_()
    indices = torch.cat((window_idx, torch.where(selected >= 0, selected + window, -1)), -1)
    _, lse = sparse_attention(q, torch.cat((window_kv, compressed_kv), 1), indices, sink, 0.5)
    loss = indexer_kl_loss(q, compressed_kv, selected, score, lse, 0.5)
    expected = []
    for b in range(batch):
        for i in range(seq):
            sel = [j for j in selected[b, i].tolist() if j >= 0]
            if not sel:
                continue
            keys = torch.cat((window_kv[b, window_idx[b, i]], compressed_kv[b, sel]))
            logits = q[b, i] @ keys.T * 0.5  # [H, 2 + len(sel)]
            probs = logits.exp() / (logits.exp().sum(-1, keepdim=True) + sink.exp().unsqueeze(-1))
            p = probs[:, 2:].sum(0)
            p = p / p.sum()
            log_q = torch.log_softmax(score[b, i, : len(sel)].detach(), -1)
            expected.append((p * (p.log() - log_q)).sum())
    torch.testing.assert_close(loss, torch.stack(expected).mean())
    loss.backward()
    assert torch.isfinite(score.grad).all() and score.grad.abs().sum() > 0


def test_v41_reindex_layer_keeps_to_candidate_blocks():
    from nemo_dsa.ops.v41_indexer import blocks_to_mask

    cfg = tiny_config(scoring="v41", kv_source_layer_ids=(1,), index_source_layer_ids=(1, 3),
                      candidate_source_layer_id=1, candidate_block_size=2, candidate_topk_blocks=2, index_topk=4)
    source, reindex = make_layer(cfg, 1, seed=1), make_layer(cfg, 3, seed=2)
    assert reindex.compressor is None and reindex.indexer.compressor is None
    ids = packed_ids([[9, 38]], seq=48)
    x = torch.randn(1, 48, cfg.hidden_size)
    meta = build_attention_metadata(compress_ratio=4, packed_seq_ids=ids)
    shared = SharedLayerState()
    source(x, meta, LocalContext(), shared)
    blocks = shared.source.candidate_blocks
    keep = blocks_to_mask(blocks, meta.ks, meta.ke, 2, meta.num_groups)
    assert (keep.sum(-1) < (meta.ke - meta.ks)).any()  # the candidates do exclude visible groups
    reindex(x, meta, LocalContext(), shared)
    chosen = shared.source.selection.topk_indices
    assert (chosen >= 0).any()
    picked = torch.gather(keep, -1, chosen.clamp_min(0))
    assert bool(picked[chosen >= 0].all())


def test_full_precision_selection_equals_the_op_on_bf16_values():
    """fp32 index q/k (fp32 models) take the full-precision path; on values bf16 holds exactly it
    selects what v4_indexer_bshd selects, with the same scores and gradients."""
    from nemo_dsa.layers.indexer import v4_select_full_precision
    from nemo_dsa.ops.v4_indexer import v4_indexer_bshd

    gen = torch.Generator().manual_seed(8)
    ids = packed_ids([[21, 14, 9], [40]], seq=44)
    meta = build_attention_metadata(compress_ratio=4, packed_seq_ids=ids)
    q = torch.randn(2, 44, 4, 32, generator=gen).bfloat16()
    k = torch.randn(2, meta.num_groups, 32, generator=gen).bfloat16()
    w = torch.randn(2, 44, 4, generator=gen) * 0.5
    runs = []
    for full in (True, False):
        qq = (q.float() if full else q.clone()).requires_grad_()
        kk = (k.float() if full else k.clone()).requires_grad_()
        ww = w.clone().requires_grad_()
        fn = v4_select_full_precision if full else (
            lambda *a: v4_indexer_bshd(*a[:3], 4, a[4], ks=a[3].ks, ke=a[3].ke, backend="torch"))
        score, indices = fn(qq, kk, ww, meta.key_ranges, 3)
        weight = torch.randn(score.shape, generator=torch.Generator().manual_seed(9))
        score.masked_fill(indices < 0, 0.0).mul(weight).sum().backward()
        runs.append((score.detach(), indices.long(), qq.grad.float(), kk.grad.float(), ww.grad))
    (s1, i1, *g1), (s2, i2, *g2) = runs
    assert torch.equal(i1, i2) and (i1 >= 0).any() and (i1 < 0).any()
    torch.testing.assert_close(s1, s2, rtol=1e-6, atol=1e-6)
    (dq1, dk1, dw1), (dq2, dk2, dw2) = g1, g2
    torch.testing.assert_close(dw1, dw2, rtol=1e-5, atol=1e-6)
    for a, b in ((dq1, dq2), (dk1, dk2)):  # the op returns q/k gradients in bf16: one rounding apart
        torch.testing.assert_close(a.bfloat16().float(), b, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_overlap_keeps_other_documents_non_finite_values_out(bad):
    """The ratio-4 overlap selects the previous group only inside a document: a NaN / inf in
    document A leaves document B's compressed keys bitwise those of a clean run (the previous
    group's weight 0 is never multiplied with A's values)."""
    cfg = tiny_config()
    layer = make_layer(cfg, 1)  # ratio 4, overlapping compressor
    compressor = layer.compressor
    assert compressor.overlap
    lengths = [12, 16, 8]  # documents start at 0, 12, 28 (multiples of 4): B's first group follows A's last
    ids = packed_ids([lengths], sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    meta = build_attention_metadata(compress_ratio=4, position_ids=positions, seq_lens=torch.tensor([lengths]))
    x = torch.randn(1, sum(lengths), cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    clean = compressor(x, meta, LocalContext())
    dirty_x = x.clone()
    dirty_x[0, 9, 5] = bad  # document A's last group (tokens 8..11)
    dirty_x[0, 11, :] = bad
    dirty = compressor(dirty_x, meta, LocalContext())
    assert not torch.isfinite(dirty[0, 2]).all()  # A's own last group is hit
    assert ids[0, 12] == 2 and ids[0, 28] == 3
    assert torch.equal(dirty[0, 3:], clean[0, 3:])  # document B's (and C's) keys: bitwise clean


def test_casting_keeps_fp32_parameter_values():
    """``.to(bfloat16)`` leaves the fp32 parameters (sinks, compressor projections and biases)
    bitwise as they were, not rounded through bf16."""
    layer = make_layer(tiny_config(), 1)
    kept = {"attn_sink", "compressor.wkv.weight", "compressor.wgate.weight", "compressor.ape",
            "indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight", "indexer.compressor.ape"}  # fmt: skip
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    layer.to(torch.bfloat16)
    for name, p in layer.named_parameters():
        if name in kept:
            assert p.dtype == torch.float32 and torch.equal(p, before[name]), name
        else:
            assert p.dtype == torch.bfloat16, name
    assert not torch.equal(before["wq_a.weight"].bfloat16().float(), before["wq_a.weight"])  # a cast does round


# -- attention backend choice (the CUDA branch is decided on fake device flags: no GPU here) --


def _q(heads=4, dim=64, dtype=torch.bfloat16):
    return torch.zeros(1, 3, heads, dim, dtype=dtype)


@pytest.mark.parametrize(
    "q, slots, expected",
    [
        (_q(), 16, "tilelang"),
        (_q(), None, "tilelang"),  # ks/ke range: no slot limit
        (_q(heads=128, dim=512), 2048, "tilelang"),  # at the kernels' limits
        (_q(heads=129), 16, "torch"),
        (_q(dim=513), 16, "torch"),
        (_q(), 2049, "torch"),
        (_q(dtype=torch.float32), 16, "torch"),
        (_q(dtype=torch.float16), 16, "torch"),
    ],
)
def test_auto_attention_backend_falls_back_where_the_kernels_cannot(q, slots, expected):
    from nemo_dsa.layers.sparse_attention import attention_backend_for

    indices = None if slots is None else torch.zeros(1, 3, slots, dtype=torch.int32)
    assert attention_backend_for("auto", q, indices, on_cuda=True) == expected
    assert attention_backend_for("auto", q, indices, on_cuda=False) == "torch"
    # Explicit choices pass through: the op names the limit (or the CPU tensors) itself.
    assert attention_backend_for("tilelang", q, indices, on_cuda=True) == "tilelang"
    assert attention_backend_for("torch", q, indices, on_cuda=True) == "torch"


def test_tilelang_attention_beyond_the_kernel_limits_names_the_limit():
    from nemo_dsa.ops.sparse_attention.interface import _check_kernel_limits

    with pytest.raises(ValueError, match="at most 128 heads"):
        _check_kernel_limits(_q(heads=129), None)
    with pytest.raises(TypeError, match="bfloat16"):
        _check_kernel_limits(_q(dtype=torch.float32), None)


@pytest.mark.parametrize(
    "attention_backend, backend, heads, expected",
    [
        ("auto", "torch", 2, "tilelang"),  # the attention's own field, not the indexer's
        ("auto", "torch", 130, "torch"),  # more heads than the kernels hold: the reference
        (None, "tilelang", 2, "tilelang"),  # unset: follows the indexer's backend
        ("torch", "tilelang", 2, "torch"),
        ("tilelang", "torch", 130, "tilelang"),  # the op raises for it on a real device
    ],
)
def test_layer_attention_uses_its_own_backend_field(monkeypatch, attention_backend, backend, heads, expected):
    from nemo_dsa.layers import sparse_attention as layer_module

    cfg = tiny_config(num_attention_heads=heads, backend=backend, attention_backend=attention_backend)
    layer = make_layer(cfg, 2).to(torch.bfloat16)  # ratio 8: attends to every visible group (ks/ke)
    seen, op = [], layer_module.attend

    def recording_op(*args, backend, **kwargs):  # records the choice, computes on the CPU reference
        seen.append(backend)
        return op(*args, backend="torch", **kwargs)

    warmed = []  # the kernels' warm-up needs a real device: recorded instead
    monkeypatch.setattr(layer_module, "_on_cuda", lambda *tensors: True)  # as if the tensors were on CUDA
    monkeypatch.setattr(layer_module, "attend", recording_op)
    monkeypatch.setattr(layer_module, "warm_up", warmed.append)
    x = torch.randn(1, 32, cfg.hidden_size, dtype=torch.bfloat16)
    out, _ = run(layer, x, packed_ids([[32]], 32))
    assert seen == [expected] and torch.isfinite(out).all()
    assert [bool(b.attention) for b in warmed] == ([True] if expected == "tilelang" else [])


def test_attention_backend_config_is_checked():
    with pytest.raises(ValueError, match="attention_backend"):
        tiny_config(attention_backend="cuda")
