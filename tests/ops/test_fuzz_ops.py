"""Property-based fuzzing of the public ops and the metadata builder on CPU (hypothesis).

Valid inputs equal an independent oracle written from the contract (loops and float64 math);
invalid inputs raise a ValueError/TypeError that names the argument; nothing else escapes.
Bounded: few examples, small shapes, derandomised (the same cases on every run).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_dsa.metadata import build_attention_metadata
from nemo_dsa.ops.sparse_attention import sparse_attention, sparse_window_attention
from nemo_dsa.ops.topk import pytorch_extract_topk_scores, select_topk
from nemo_dsa.ops.v41_indexer import indexer_scores
from nemo_dsa.ops.v4_indexer import v4_indexer_bshd, v4_lighting_indexer

FUZZ = settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
NAMED_ERRORS = (ValueError, TypeError)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ranges(batch: int, queries: int, num_keys: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.randint(0, num_keys + 1, (batch, queries), generator=g)
    b = torch.randint(0, num_keys + 1, (batch, queries), generator=g)
    return torch.minimum(a, b).to(torch.int32), torch.maximum(a, b).to(torch.int32)


# ----------------------------------------------------------------------------------------------
# oracles (loops over rows, float64)
# ----------------------------------------------------------------------------------------------


def oracle_topk_row(row: list[float], count: int, order: str) -> list[int]:
    """Best ``count`` finite scores, ties to the smaller index, -1 padded; then ``order``."""
    finite = [(s, j) for j, s in enumerate(row) if math.isfinite(s)]
    chosen = [j for _, j in sorted(finite, key=lambda p: (-p[0], p[1]))[:count]]
    if order == "index":
        chosen.sort()
    return chosen + [-1] * (count - len(chosen))


def oracle_select(scores: torch.Tensor, topk: int, order: str, ks=None, ke=None) -> torch.Tensor:
    rows_total = math.prod(scores.shape[:-1])
    flat = scores.double().reshape(rows_total, scores.shape[-1])
    count = min(topk, scores.shape[-1])
    rows = []
    for r, row in enumerate(flat.tolist()):
        if ks is not None:
            lo, hi = int(ks.reshape(-1)[r]), int(ke.reshape(-1)[r])
            row = [s if lo <= j < hi else -math.inf for j, s in enumerate(row)]
        rows.append(oracle_topk_row(row, count, order))
    return torch.tensor(rows, dtype=torch.int32).reshape(*scores.shape[:-1], count) if rows else torch.full(
        (*scores.shape[:-1], count), -1, dtype=torch.int32
    )


def oracle_v4_logits(q, k, w, ks, ke) -> torch.Tensor:
    dots = torch.einsum("bshd,bkd->bshk", q.double(), k.double()).relu()
    logits = (dots * w.double()[..., None]).sum(2)
    keys = torch.arange(k.shape[1])
    visible = (keys >= ks[..., None]) & (keys < ke[..., None])
    return torch.where(visible, logits, -math.inf)


def oracle_sparse_attention(q, kv, indices, sink, scale) -> torch.Tensor:
    batch, seq, heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        for i in range(seq):
            rows = [j for j in indices[b, i].tolist() if j >= 0]
            keys = kv[b, rows].double()  # [m, D]
            logits = q[b, i].double() @ keys.T * scale  # [H, m]
            extra = sink.double()[:, None] if sink is not None else torch.empty(heads, 0, dtype=torch.float64)
            denominator = torch.cat((logits, extra), dim=1)
            if denominator.shape[1] == 0:
                continue
            weights = torch.exp(logits - torch.logsumexp(denominator, dim=1, keepdim=True))
            out[b, i] = weights @ keys
    return out


# ----------------------------------------------------------------------------------------------
# valid inputs equal the oracles
# ----------------------------------------------------------------------------------------------

shapes = st.tuples(st.integers(1, 2), st.integers(0, 9), st.integers(0, 11))  # B, S, K


@FUZZ
@given(shape=shapes, topk=st.integers(1, 14), order=st.sampled_from(["score", "index"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), use_range=st.booleans(),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_select_topk_equals_oracle(shape, topk, order, dtype, use_range, seed):
    batch, seq, num_keys = shape
    g = seeded(seed)
    # Few distinct values: many ties; NaN and +-inf sprinkled in.
    scores = torch.randint(-3, 4, (batch, seq, num_keys), generator=g).to(dtype)
    special = torch.rand(scores.shape, generator=g)
    scores[special < 0.1] = float("nan")
    scores[(special >= 0.1) & (special < 0.15)] = float("inf")
    scores[(special >= 0.15) & (special < 0.2)] = float("-inf")
    ks, ke = ranges(batch, seq, num_keys, g) if use_range else (None, None)
    got = select_topk(scores, topk, order, ks=ks, ke=ke, backend="torch")
    assert torch.equal(got, oracle_select(scores, topk, order, ks, ke))


@FUZZ
@given(shape=shapes, width=st.integers(0, 5), dim=st.sampled_from([-1, 2, -2, 1]), seed=st.integers(0, 2**16))
def test_extract_topk_scores_equals_oracle(shape, width, dim, seed):
    batch, seq, num_keys = shape
    g = seeded(seed)
    logits = torch.randn(batch, seq, num_keys, generator=g)
    axis = dim % 3
    size = logits.shape[axis]
    index_shape = list(logits.shape)
    index_shape[axis] = width
    indices = torch.randint(-1, max(size, 0), index_shape, generator=g, dtype=torch.int64) if size else torch.full(index_shape, -1)
    got = pytorch_extract_topk_scores(logits, indices, dim=dim)
    want = torch.full(index_shape, -math.inf)
    for pos in torch.cartesian_prod(*(torch.arange(n) for n in index_shape)).tolist() if indices.numel() else []:
        j = int(indices[tuple(pos)])
        if j >= 0:
            src = list(pos)
            src[axis] = j
            want[tuple(pos)] = logits[tuple(src)]
    assert torch.equal(got, want)


@FUZZ
@given(batch=st.integers(0, 2), seq=st.integers(0, 10), heads=st.integers(1, 4), num_keys=st.integers(0, 6),
       topk=st.integers(1, 8), fused=st.booleans(), seq_first=st.booleans(), seed=st.integers(0, 2**16))  # fmt: skip
def test_v4_indexer_equals_oracle(batch, seq, heads, num_keys, topk, fused, seq_first, seed):
    g = seeded(seed)
    dim = 16
    # {-1, 0, 1} inputs and quarter-step weights: every product and sum is exact in fp32.
    q = torch.randint(-1, 2, (batch, seq, heads, dim), generator=g).bfloat16()
    k = torch.randint(-1, 2, (batch, num_keys, dim), generator=g).bfloat16()
    w = torch.randint(-2, 3, (batch, seq, heads), generator=g) / 4
    ks, ke = ranges(batch, seq, num_keys, g)
    if seq_first:
        score, index = v4_lighting_indexer(q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1), 4, topk,
                                           ks=ks, ke=ke, backend="torch", fused_topk=fused)  # fmt: skip
    else:
        score, index = v4_indexer_bshd(q, k, w, 4, topk, ks=ks, ke=ke, backend="torch", fused_topk=fused)
    logits = oracle_v4_logits(q, k, w, ks, ke)
    assert torch.equal(index, oracle_select(logits, topk, "score"))
    want = torch.where(index >= 0, logits.gather(-1, index.long().clamp_min(0)), -math.inf)
    assert torch.equal(score.double(), want)


@FUZZ
@given(batch=st.integers(1, 2), seq=st.integers(0, 8), heads=st.sampled_from([1, 2, 4, 8]), num_keys=st.integers(0, 6),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_v41_indexer_scores_equal_oracle(batch, seq, heads, num_keys, seed):
    g = seeded(seed)
    q = torch.randint(-1, 2, (batch, seq, heads, 16), generator=g).bfloat16()
    k = torch.randint(-1, 2, (batch, num_keys, 16), generator=g).bfloat16()
    w = (torch.randint(-2, 3, (batch, seq, heads), generator=g) / 4).bfloat16()
    ks, ke = ranges(batch, seq, num_keys, g)
    got = indexer_scores(q, k, w, ks=ks, ke=ke, backend="torch")
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.double(), oracle_v4_logits(q, k, w, ks, ke))


@FUZZ
@given(batch=st.integers(1, 2), seq=st.integers(0, 6), heads=st.integers(1, 3), num_keys=st.integers(0, 7),
       width=st.integers(0, 5), with_sink=st.booleans(), scale=st.floats(-2, 2, allow_nan=False),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_sparse_attention_equals_oracle(batch, seq, heads, num_keys, width, with_sink, scale, seed):
    g = seeded(seed)
    q = torch.randn(batch, seq, heads, 8, generator=g)
    kv = torch.randn(batch, num_keys, 8, generator=g)
    indices = torch.randint(-1, max(num_keys, 0), (batch, seq, width), generator=g) if num_keys else torch.full((batch, seq, width), -1)
    sink = torch.randn(heads, generator=g) if with_sink else None
    out, lse = sparse_attention(q, kv, indices.to(torch.int32), sink, scale)
    assert out.shape == q.shape and lse.shape == (batch, seq, heads)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), oracle_sparse_attention(q, kv, indices, sink, scale), rtol=1e-5, atol=1e-5)


@FUZZ
@given(batch=st.integers(1, 2), seq=st.integers(1, 7), history=st.integers(0, 3), window=st.integers(1, 5),
       num_keys=st.integers(0, 4), ranged=st.booleans(), seed=st.integers(0, 2**16))  # fmt: skip
def test_sparse_window_attention_equals_oracle(batch, seq, history, window, num_keys, ranged, seed):
    g = seeded(seed)
    heads, dim = 2, 8
    q = torch.randn(batch, seq, heads, dim, generator=g)
    raw = torch.randn(batch, seq + history, dim, generator=g)
    comp = torch.randn(batch, num_keys, dim, generator=g)
    sink = torch.randn(heads, generator=g)
    window_start = torch.randint(0, seq + history + 1, (batch, seq), generator=g, dtype=torch.int32)
    ks, ke = ranges(batch, seq, num_keys, g)
    kwargs = dict(ks=ks, ke=ke) if ranged else dict(indices=torch.randint(-1, max(num_keys, 1), (batch, seq, 3), generator=g, dtype=torch.int32).clamp_max(num_keys - 1))
    out, _ = sparse_window_attention(q, raw, window_start, window, comp, sink=sink, scale=0.5, backend="torch", **kwargs)
    # Oracle: every query's raw window rows by the contract, then its compressed rows.
    lists = []
    for b in range(batch):
        for i in range(seq):
            own = i + history
            rows = [r for r in range(own - window + 1, own + 1) if r >= max(int(window_start[b, i]), 0)]
            picks = list(range(int(ks[b, i]), int(ke[b, i]))) if ranged else [j for j in kwargs["indices"][b, i].tolist() if j >= 0]
            lists.append(rows + [seq + history + j for j in picks])
    width = max(len(r) for r in lists)
    indices = torch.tensor([r + [-1] * (width - len(r)) for r in lists]).view(batch, seq, width)
    want = oracle_sparse_attention(q, torch.cat((raw, comp), 1), indices, sink, 0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# invalid inputs: a named ValueError/TypeError, nothing else
# ----------------------------------------------------------------------------------------------

# topk is clamped to K, so only the bounded counts reject 2**70.
BAD_COUNTS = [0, -1, -(2**40), True, 1.5, "4", torch.tensor(4)]
BAD_SIZES = BAD_COUNTS + [2**70]


def _v4_args():
    g = seeded(0)
    q = torch.randint(-1, 2, (2, 8, 2, 16), generator=g).bfloat16()
    k = torch.randint(-1, 2, (2, 2, 16), generator=g).bfloat16()
    w = torch.randn(2, 8, 2, generator=g)
    return dict(q=q, k=k, w=w, compress_ratio=4, topk=2)


V4_MUTATIONS = {
    "q": [torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16, dtype=torch.int64), torch.zeros(2, 8, 32).bfloat16(),
          [1.0], None],
    "head_dim": [24, 8, 40],  # q with another head dim than k's 16 (any dim runs; the two must agree)
    "k": [torch.zeros(2, 2, 16), torch.zeros(3, 2, 16).bfloat16(), torch.zeros(2, 2, 32).bfloat16(), "k"],
    "w": [torch.zeros(2, 8, 2).bfloat16(), torch.zeros(2, 8, 3), torch.zeros(2, 9, 2), 1.0],
    "compress_ratio": BAD_SIZES,
    "topk": BAD_COUNTS,
    "ks": [torch.zeros(2, 8), torch.full((2, 8), -1, dtype=torch.int32), torch.zeros(2, 7, dtype=torch.int32)],
    "topk_indices": [torch.full((2, 8, 2), 2, dtype=torch.int32), torch.zeros(2, 8, 2), torch.zeros(2, 8, 3, dtype=torch.int32),
                     torch.full((2, 8, 2), -2, dtype=torch.int32)],
    "backend": ["cuda", 1, "tilelang"],
    "fused_topk": [1, "yes"],
}


@FUZZ
@given(data=st.data())
def test_v4_indexer_bad_inputs_are_named(data):
    name = data.draw(st.sampled_from(sorted(V4_MUTATIONS)))
    value = data.draw(st.sampled_from(V4_MUTATIONS[name]))
    args = _v4_args()
    extra = dict(backend="torch")
    if name in ("q", "k", "w", "compress_ratio", "topk"):
        args[name] = value
    elif name == "head_dim":
        args["q"] = torch.zeros(2, 8, 2, value).bfloat16()
    elif name == "ks":
        extra.update(ks=value, ke=torch.full((2, 8), 2, dtype=torch.int32))
    else:
        extra[name] = value
    with pytest.raises(NAMED_ERRORS) as error:
        v4_indexer_bshd(args["q"], args["k"], args["w"], args["compress_ratio"], args["topk"], **extra)
    wanted = {"ks": ("ks", "ke"), "head_dim": ("k must have shape",)}.get(name, (name,))
    assert any(w in str(error.value) for w in wanted), (name, str(error.value))


SPARSE_MUTATIONS = {
    "q": [torch.zeros(1, 4, 2, 8, dtype=torch.int32), torch.zeros(1, 4, 16), "q"],
    "kv": [torch.zeros(1, 4, 9), torch.zeros(2, 4, 8), torch.zeros(1, 4, 8, dtype=torch.int64)],
    "indices": [torch.zeros(1, 4, 2), torch.full((1, 4, 2), 4, dtype=torch.int32), torch.full((1, 4, 2), -3, dtype=torch.int32),
                torch.zeros(1, 5, 2, dtype=torch.int32)],
    "sink": [torch.zeros(3), torch.zeros(2, dtype=torch.int64), 1.0],
    "scale": [float("nan"), float("inf"), torch.tensor(1.0), True, None, "1", 10**400],
    "chunk_size": [0, -1, 1.5, True],
}


@FUZZ
@given(data=st.data())
def test_sparse_attention_bad_inputs_are_named(data):
    name = data.draw(st.sampled_from(sorted(SPARSE_MUTATIONS)))
    value = data.draw(st.sampled_from(SPARSE_MUTATIONS[name]))
    args = dict(q=torch.zeros(1, 4, 2, 8), kv=torch.zeros(1, 4, 8), indices=torch.zeros(1, 4, 2, dtype=torch.int32),
                sink=torch.zeros(2), scale=1.0, chunk_size=None)  # fmt: skip
    args[name] = value
    with pytest.raises(NAMED_ERRORS) as error:
        sparse_attention(args["q"], args["kv"], args["indices"], args["sink"], args["scale"], chunk_size=args["chunk_size"])
    assert name in str(error.value), (name, str(error.value))


SELECT_MUTATIONS = {
    "scores": [torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.float64), [1.0], torch.tensor(1.0)],
    "topk": BAD_COUNTS,
    "order": ["ascending", 1],
    "ks": [torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)],
    "backend": ["gpu", None],
}


@FUZZ
@given(data=st.data())
def test_select_topk_bad_inputs_are_named(data):
    name = data.draw(st.sampled_from(sorted(SELECT_MUTATIONS)))
    value = data.draw(st.sampled_from(SELECT_MUTATIONS[name]))
    args = dict(scores=torch.zeros(2, 3), topk=2, order="score")
    extra = {}
    if name in args:
        args[name] = value
    elif name == "ks":
        extra.update(ks=value, ke=torch.zeros(2, dtype=torch.int32))
    else:
        extra[name] = value
    with pytest.raises(NAMED_ERRORS) as error:
        select_topk(args["scores"], args["topk"], args["order"], **extra)
    wanted = {"scores": ("scores",), "backend": ("backend",)}.get(name, (name,))
    assert any(w in str(error.value) for w in wanted), (name, str(error.value))


# Layout values: small, plus a few that no int32 row can hold (rejected before any allocation).
layout_values = st.one_of(st.integers(-3, 12), st.sampled_from([2**40, -(2**40), 2**62]))
layout_tensors = st.builds(
    lambda rows, dtype, values: torch.tensor(values[: rows[0] * rows[1]] + [0] * max(0, rows[0] * rows[1] - len(values)),
                                             dtype=dtype).reshape(rows) if rows[1] else torch.zeros(rows, dtype=dtype),  # fmt: skip
    st.tuples(st.integers(0, 2), st.integers(0, 9)),
    st.sampled_from([torch.int64, torch.int32, torch.bool, torch.float32]),
    st.lists(st.integers(-3, 12), max_size=18),
)
LAYOUT_KEYS = ["position_ids", "seq_lens", "seq_lens_padded", "cu_seqlens", "packed_seq_ids", "attention_mask"]


@FUZZ
@given(
    layout=st.dictionaries(st.sampled_from(LAYOUT_KEYS), st.one_of(layout_tensors, st.none(), layout_values), max_size=3),
    ratio=st.one_of(st.integers(-1, 9), st.sampled_from([2**70, True, 2.0])),
    cp=st.tuples(st.integers(-1, 3), st.integers(0, 4)),
    shape=st.tuples(st.one_of(st.none(), layout_values), st.one_of(st.none(), layout_values)),
)
def test_metadata_builder_accepts_or_names_the_error(layout, ratio, cp, shape):
    """Arbitrary argument mixes: either metadata with 0 <= ks <= ke <= K, or a named error."""
    kwargs = {k: v for k, v in layout.items() if v is not None}
    cp_rank, cp_size = cp
    batch_size, seq_len = shape
    try:
        meta = build_attention_metadata(compress_ratio=ratio, cp_rank=cp_rank, cp_size=cp_size, batch_size=batch_size,
                                        seq_len=seq_len, **kwargs)  # fmt: skip
    except NAMED_ERRORS as error:
        names = ["compress_ratio", "cp_rank", "cp_size", "batch_size", "seq_len", "build_attention_metadata", *LAYOUT_KEYS]
        assert any(n in str(error) for n in names), str(error)
        return
    assert bool((meta.ks >= 0).all() & (meta.ks <= meta.ke).all() & (meta.ke <= meta.num_groups).all())
    assert meta.ks.shape == (meta.batch_size, meta.seq_len)


HUGE_LENGTHS = [2**62, 2**63 - 1, 2**63 - 8, 2**61 + 3]


@FUZZ
@given(seq_len=st.integers(1, 12), small=st.lists(st.integers(0, 6), max_size=4),
       huge=st.lists(st.sampled_from(HUGE_LENGTHS), min_size=1, max_size=4), padded=st.booleans(), order=st.randoms())
def test_metadata_builder_names_lengths_past_int64(seq_len, small, huge, padded, order):
    """``seq_lens`` entries near 2**63, with a last entry that wraps their int64 sum to exactly the
    row's length: a named error, never a layout with documents at negative positions."""
    entries = small + huge
    order.shuffle(entries)
    wrapped = (seq_len - sum(entries)) % 2**64  # the entry that makes the wrapped sum seq_len
    entries.append(wrapped - 2**64 if wrapped >= 2**63 else wrapped)
    lengths = torch.tensor([entries], dtype=torch.int64)
    assert int(lengths.sum()) == seq_len  # the overflow the builder has to see through
    kwargs = {"seq_lens": lengths.clamp_max(seq_len) if padded else lengths}
    if padded:
        kwargs["seq_lens_padded"] = lengths
    name = "seq_lens_padded" if padded else "seq_lens"
    with pytest.raises(ValueError, match=name):
        build_attention_metadata(compress_ratio=4, seq_len=seq_len, **kwargs)
    with pytest.raises(ValueError, match=name):  # the length derived from the lengths alone
        build_attention_metadata(compress_ratio=4, **kwargs)
    cu = torch.cat((torch.zeros(1, 1, dtype=torch.int64), lengths.cumsum(1)), dim=1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        build_attention_metadata(compress_ratio=4, seq_len=seq_len, cu_seqlens=cu)
