"""build_attention_metadata against a brute-force oracle of the causal rule, CP shards, and every check."""

from __future__ import annotations

import random

import pytest
import torch
from _support.oracles import oracle_batch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from _support.helpers import indexer_inputs
from nemo_dsa.metadata import AttentionMetadata, build_attention_metadata
from nemo_dsa.ops.v4_indexer import v4_indexer_bshd
from nemo_dsa.visibility import check_ks_ke

SENTINEL = -1000  # nemo-automodel's THD collater pads seq_lens with this

# flavour -> (may the layout hold padding?, one document from position 0 only?)
FLAVOURS = {
    "position_ids": (False, False),
    "position_ids+attention_mask": (True, False),
    "seq_lens": (False, False),
    "seq_lens+padded": (True, False),
    "thd": (True, False),  # seq_lens + seq_lens_padded + position_ids, as the THD collater emits
    "cu_seqlens": (False, False),
    "cu_seqlens+seq_lens+position_ids": (False, False),
    "packed_seq_ids": (True, False),
    "v41": (True, False),  # position_ids + packed_seq_ids + attention_mask, as the V4.1 CP path emits
    "attention_mask": (True, True),
    "shape_only": (False, True),
}


# ------------------------------------------------------------------------------------------------
# layouts and the inputs that describe them
# ------------------------------------------------------------------------------------------------


def draw_row(rng: random.Random, length: int, ratio: int, allow_padding: bool, single_doc: bool) -> list[int]:
    """Per-token labels of one global row: 0 = padding, k > 0 = the k-th document.

    Document lengths are either arbitrary or multiples of R, so starts are both aligned and not.
    """
    if single_doc:
        real = rng.randint(0, length) if allow_padding else length
        return [1] * real + [0] * (length - real)
    labels: list[int] = []
    label = 0
    while len(labels) < length:
        remaining = length - len(labels)
        if allow_padding and rng.random() < 0.25:
            labels += [0] * rng.randint(1, min(remaining, 2 * ratio))
            continue
        if rng.random() < 0.5 and remaining >= ratio:
            n = ratio * rng.randint(1, remaining // ratio)
        else:
            n = rng.randint(1, remaining)
        label += 1
        labels += [label] * n
    return labels


def spans_of(row: list[int]) -> tuple[list[int], list[int]]:
    """(seq_lens, seq_lens_padded): each document plus the padding after it; leading padding is a 0-length doc."""
    lens, padded = [], []
    for i, label in enumerate(row):
        starts_doc = label != 0 and (i == 0 or row[i - 1] != label)
        if starts_doc or (i == 0 and label == 0):
            lens.append(0)
            padded.append(0)
        if label != 0:
            lens[-1] += 1
        padded[-1] += 1
    return lens, padded


def pad_rows(rows: list[list[int]], fill_last: bool, rng: random.Random) -> torch.Tensor:
    """Stack ragged rows, filling with SENTINEL (or the row's last entry), sometimes wider than needed."""
    width = max(len(r) for r in rows) + rng.randint(0, 2)
    out = []
    for r in rows:
        r = list(r)
        while len(r) < width:
            r.append(r[-1] if fill_last else SENTINEL)
        out.append(r)
    return torch.tensor(out)


def global_inputs(rng: random.Random, flavour: str, labels: list[list[int]], int_dtype: torch.dtype) -> dict:
    """Keyword arguments describing the whole global row (before sharding)."""
    oracle = oracle_batch(labels, 1)
    local = oracle["local_positions"]
    valid = oracle["doc_ids"] > 0
    lens, padded = zip(*(spans_of(row) for row in labels))

    def with_sentinels(a: list[list[int]], b: list[list[int]] | None):
        # Insert the same random SENTINEL entries into both lists of every row.
        a2, b2 = [], []
        for k, row in enumerate(a):
            ra, rb = list(row), list(b[k]) if b is not None else None
            for _ in range(rng.randint(0, 2)):
                at = rng.randint(0, len(ra))
                ra.insert(at, SENTINEL)
                if rb is not None:
                    rb.insert(at, SENTINEL)
            a2.append(ra)
            b2.append(rb)
        return a2, b2

    kwargs: dict = {}
    garbage = torch.tensor([[rng.randint(0, 4) for _ in row] for row in labels])  # collaters write anything here
    pids = torch.where(valid, local, garbage).to(int_dtype)
    mask = valid if rng.random() < 0.5 else valid.to(torch.int64)
    if flavour in ("position_ids", "position_ids+attention_mask", "thd", "cu_seqlens+seq_lens+position_ids", "v41"):
        kwargs["position_ids"] = pids
    if flavour in ("position_ids+attention_mask", "attention_mask", "v41"):
        kwargs["attention_mask"] = mask
    if flavour in ("seq_lens", "cu_seqlens+seq_lens+position_ids"):
        a, _ = with_sentinels(list(lens), None)
        kwargs["seq_lens"] = pad_rows(a, False, rng).to(int_dtype)
    if flavour in ("seq_lens+padded", "thd"):
        a, b = with_sentinels(list(lens), list(padded))
        width = max(len(r) for r in a)
        a = [r + [SENTINEL] * (width - len(r)) for r in a]
        b = [r + [SENTINEL] * (width - len(r)) for r in b]
        kwargs["seq_lens"] = torch.tensor(a, dtype=int_dtype)
        kwargs["seq_lens_padded"] = torch.tensor(b, dtype=int_dtype)
    if flavour.startswith("cu_seqlens"):
        cu = [[0] + torch.tensor(row).cumsum(0).tolist() for row in lens]
        cu = pad_rows(cu, True, rng).to(int_dtype)
        kwargs["cu_seqlens"] = cu[0] if cu.shape[0] == 1 and rng.random() < 0.5 else cu
    if flavour in ("packed_seq_ids", "v41"):
        # Arbitrary distinct positive ids: the builder must only use them to tell documents apart.
        num_docs = max(max(row) for row in labels)
        remap = torch.tensor([0] + rng.sample(range(1, 3 * num_docs + 2), num_docs))
        kwargs["packed_seq_ids"] = remap[torch.tensor(labels)].to(int_dtype)
    if flavour == "shape_only":
        kwargs["batch_size"], kwargs["seq_len"] = len(labels), len(labels[0])
    return kwargs


def shard(kwargs: dict, rank: int, seq_len: int, local_positions: torch.Tensor) -> dict:
    """The inputs rank ``rank`` sees: [B, G] token tensors sliced, global lengths kept."""
    out = {}
    for key, value in kwargs.items():
        if key in ("position_ids", "packed_seq_ids", "attention_mask"):
            out[key] = value[:, rank * seq_len : (rank + 1) * seq_len]
        elif key == "seq_len":
            out[key] = seq_len
        else:
            out[key] = value
    if "packed_seq_ids" in out and "position_ids" not in out:  # packed ids alone cannot place documents
        out["position_ids"] = local_positions[:, rank * seq_len : (rank + 1) * seq_len]
    return out


@st.composite
def cases(draw, flavour: str):
    allow_padding, single_doc = FLAVOURS[flavour]
    ratio = draw(st.sampled_from([1, 2, 3, 4, 8]))  # 3: the non-power-of-two path
    cp_size = draw(st.sampled_from([1, 2, 4]))
    seq_len = ratio * draw(st.integers(1, 3)) if cp_size > 1 else draw(st.integers(1, 40))
    batch = draw(st.integers(1, 3))
    int_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    labels = [draw_row(rng, seq_len * cp_size, ratio, allow_padding, single_doc) for _ in range(batch)]
    kwargs = global_inputs(rng, flavour, labels, int_dtype)
    return flavour, ratio, cp_size, seq_len, labels, kwargs


# ------------------------------------------------------------------------------------------------
# property test
# ------------------------------------------------------------------------------------------------


def oracle_ks_ke(labels: list[list[int]], ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ks/ke int32 [B, G] by definition, loops only: ks is the first group starting at or after
    the document's start (K if there is none: the document starts in the trailing partial
    group), ke = ks + the number of visible groups of ``oracle_row``; padding gets 0, 0."""
    num_keys = len(labels[0]) // ratio
    visible = oracle_batch(labels, ratio)["visible"]
    ks = torch.zeros(len(labels), len(labels[0]), dtype=torch.int32)
    ke = torch.zeros_like(ks)
    for b, row in enumerate(labels):
        for p, label in enumerate(row):
            if label == 0:
                continue
            start = row.index(label)
            first = next((j for j in range(num_keys) if j * ratio >= start), num_keys)
            ks[b, p] = first
            ke[b, p] = first + int(visible[b, p].sum())
    return ks, ke


def assert_no_leak(meta: AttentionMetadata, labels: list[list[int]]) -> None:
    """Every visible group holds only real tokens of the query's document at positions <= the query's."""
    R = meta.compress_ratio
    for b, i, j in meta.allowed().nonzero().tolist():
        p = int(meta.positions[b, i])
        tokens = range(j * R, (j + 1) * R)
        assert all(t <= p for t in tokens), (b, i, j)
        assert all(labels[b][t] == labels[b][p] != 0 for t in tokens), (b, i, j)


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_builder_matches_oracle_and_cp_shards(flavour, data):
    flavour, R, P, S, labels, kwargs = data.draw(cases(flavour))
    event(f"cp_size={P}")
    event(f"compress_ratio={R}")
    G = S * P
    full_kwargs = dict(kwargs)
    if "seq_len" in full_kwargs:
        full_kwargs["seq_len"] = G
    full = build_attention_metadata(compress_ratio=R, **full_kwargs)
    oracle = oracle_batch(labels, R)
    B = len(labels)

    # The whole row against the oracle.
    assert (full.batch_size, full.seq_len, full.num_groups, full.first_group) == (B, G, G // R, 0)
    assert full.positions.dtype == full.doc_ids.dtype == full.local_positions.dtype == torch.int64
    assert full.ks.dtype == full.ke.dtype == torch.int32
    assert torch.equal(full.positions, torch.arange(G).expand(B, G))
    assert torch.equal(full.doc_ids, oracle["doc_ids"])
    assert torch.equal(full.local_positions, oracle["local_positions"])
    assert torch.equal(full.token_valid, oracle["doc_ids"] > 0)
    assert torch.equal(full.group_valid, oracle["group_valid"])
    assert torch.equal(full.group_doc_ids, oracle["group_doc_ids"])
    allowed = full.allowed()
    assert torch.equal(allowed, oracle["visible"])  # also proves the visible set is one range
    keys = torch.arange(G // R)
    assert torch.equal(allowed, (full.ks[..., None] <= keys) & (keys < full.ke[..., None]))
    assert bool((full.ks <= full.ke).all())
    oracle_ks, oracle_ke = oracle_ks_ke(labels, R)
    assert torch.equal(full.ks, oracle_ks) and torch.equal(full.ke, oracle_ke)
    assert bool((full.ks >= 0).all()) and bool((full.ke <= G // R).all())
    padding = ~full.token_valid
    assert bool((full.ks[padding] == 0).all()) and bool((full.ke[padding] == 0).all())
    assert_no_leak(full, labels)

    # Every CP shard equals the corresponding slice of the unsharded run.
    if P == 1:
        return
    group_valid, group_docs = [], []
    for r in range(P):
        meta = build_attention_metadata(
            compress_ratio=R, cp_rank=r, cp_size=P, **shard(kwargs, r, S, oracle["local_positions"])
        )
        cols = slice(r * S, (r + 1) * S)
        assert (meta.seq_len, meta.cp_rank, meta.cp_size) == (S, r, P)
        assert (meta.first_group, meta.num_groups) == (r * S // R, G // R)
        for name in ("positions", "doc_ids", "local_positions", "token_valid", "ks", "ke"):
            assert torch.equal(getattr(meta, name), getattr(full, name)[:, cols]), (name, r)
        group_valid.append(meta.group_valid)
        group_docs.append(meta.group_doc_ids)
    assert torch.equal(torch.cat(group_valid, 1), full.group_valid)
    assert torch.equal(torch.cat(group_docs, 1), full.group_doc_ids)


# ------------------------------------------------------------------------------------------------
# fixed examples
# ------------------------------------------------------------------------------------------------


def test_document_in_trailing_partial_group_is_accepted():
    # G = 7, R = 4: K = 1; the second document starts at 5, inside the partial group [4, 8).
    meta = build_attention_metadata(compress_ratio=4, seq_lens=torch.tensor([[5, 2]]))
    assert meta.num_groups == 1
    assert meta.ks.tolist() == [[0, 0, 0, 0, 0, 1, 1]] and meta.ke.tolist() == [[0, 0, 0, 1, 1, 1, 1]]
    check_ks_ke(meta.ks, meta.ke, batch=1, queries=7, num_keys=meta.num_groups, device=meta.device)
    q, k, w = indexer_inputs(1, 7, 2, 16, meta.num_groups, 0)
    score, index = v4_indexer_bshd(q, k, w, 4, 2, ks=meta.ks, ke=meta.ke, backend="torch")
    assert index[0, 5:].eq(-1).all() and index[0, 3, 0] == 0


@pytest.mark.parametrize("ratio", [2, 3, 4, 8, 128])
def test_ks_ke_bounds_on_random_layouts_with_partial_groups(ratio):
    """0 <= ks <= ke <= K and the exact oracle, on many rows whose length is not a multiple of R."""
    rng = random.Random(ratio)
    for _ in range(60):
        length = ratio * rng.randint(0, 3) + rng.randint(1, ratio - 1) if ratio > 1 else rng.randint(1, 20)
        labels = [draw_row(rng, length, ratio, rng.random() < 0.5, False) for _ in range(rng.randint(1, 3))]
        lens = [spans_of(row) for row in labels]
        width = max(len(a) for a, _ in lens)
        seq_lens = torch.tensor([a + [0] * (width - len(a)) for a, _ in lens])
        padded = torch.tensor([b + [0] * (width - len(b)) for _, b in lens])
        meta = build_attention_metadata(compress_ratio=ratio, seq_lens=seq_lens, seq_lens_padded=padded)
        num_keys = length // ratio
        assert meta.num_groups == num_keys
        assert bool((0 <= meta.ks).all() & (meta.ks <= meta.ke).all() & (meta.ke <= num_keys).all())
        oracle_ks, oracle_ke = oracle_ks_ke(labels, ratio)
        assert torch.equal(meta.ks, oracle_ks) and torch.equal(meta.ke, oracle_ke), labels


def test_unaligned_document_start_does_not_leak():
    # Document 2 starts at 5 (R = 4): group 1 = tokens 4..7 mixes documents, group 2 = 8..11 is its first.
    meta = build_attention_metadata(compress_ratio=4, seq_lens=torch.tensor([[5, 11]]))
    assert meta.group_valid.tolist() == [[True, False, True, True]]
    assert meta.ks[0, 5:].tolist() == [2] * 11
    assert meta.ke[0, 5:].tolist() == [2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert meta.ks[0, :5].tolist() == [0] * 5 and meta.ke[0, :5].tolist() == [0, 0, 0, 1, 1]


def test_doc_ids_are_canonical_across_inputs():
    ids = torch.tensor([[7, 7, 7, 3, 3, 0, 9, 9]])
    meta = build_attention_metadata(compress_ratio=2, packed_seq_ids=ids)
    assert meta.doc_ids.tolist() == [[1, 1, 1, 4, 4, 0, 7, 7]]
    assert meta.local_positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


def test_position_ids_broadcast_over_batch():
    pids = torch.tensor([[0, 1, 2, 0, 1, 2]])
    mask = torch.ones(3, 6, dtype=torch.bool)
    meta = build_attention_metadata(compress_ratio=1, position_ids=pids, attention_mask=mask)
    assert meta.batch_size == 3 and torch.equal(meta.doc_ids, torch.tensor([[1, 1, 1, 4, 4, 4]] * 3))


def test_unpacked_global_position_ids_under_cp():
    # Rank 1 of 2 of an unpacked row: position_ids are global, so the document starts at 0.
    meta = build_attention_metadata(compress_ratio=2, position_ids=torch.arange(4, 8)[None], cp_rank=1, cp_size=2)
    assert meta.doc_ids.tolist() == [[1] * 4] and meta.ks.tolist() == [[0] * 4]
    assert meta.ke.tolist() == [[2, 3, 3, 4]] and meta.first_group == 2 and meta.num_groups == 4


def test_allowed_num_keys():
    meta = build_attention_metadata(compress_ratio=2, batch_size=1, seq_len=6)
    assert meta.allowed(5)[..., 3:].sum() == 0 and meta.allowed(5).shape == (1, 6, 5)
    with pytest.raises(ValueError, match="num_keys"):
        meta.allowed(2)


def test_large_batch_builds_vectorised():
    # B=8, S=128K of packed documents: only a vectorised builder makes this quick.
    B, S, R = 8, 131072, 4
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 4000, (B, 201), generator=gen)
    lens = torch.where(lens.cumsum(1) < S, lens, SENTINEL)  # documents past the row are absent
    lens[:, -1] = S - lens[:, :-1].clamp_min(0).sum(1)  # the last one fills the row
    pids = torch.cat([torch.arange(n) for n in lens.clamp_min(0).flatten().tolist()]).reshape(B, S)
    meta = build_attention_metadata(compress_ratio=R, seq_lens=lens, position_ids=pids)
    starts = torch.arange(S) - pids
    assert torch.equal(meta.doc_ids, starts + 1)
    assert torch.equal(meta.ks.long(), (starts + R - 1) // R)
    assert torch.equal(meta.ke.long(), torch.maximum((starts + R - 1) // R, (torch.arange(S) + 1) // R))


# ------------------------------------------------------------------------------------------------
# validation: every message names the argument
# ------------------------------------------------------------------------------------------------

I64 = torch.int64


def build(**kwargs):
    kwargs.setdefault("compress_ratio", 2)
    return build_attention_metadata(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(compress_ratio=0, seq_len=4, batch_size=1), ValueError, "compress_ratio must be >= 1"),
        (dict(compress_ratio=2.0, seq_len=4, batch_size=1), TypeError, "compress_ratio must be an int"),
        (dict(compress_ratio=True, seq_len=4, batch_size=1), TypeError, "compress_ratio"),
        (dict(cp_size=0, seq_len=4, batch_size=1), ValueError, "cp_size must be >= 1"),
        (dict(cp_rank=-1, seq_len=4, batch_size=1), ValueError, "cp_rank must be >= 0"),
        (dict(cp_rank=2, cp_size=2, seq_len=4, batch_size=1), ValueError, r"cp_rank must be in \[0, cp_size\)"),
        (dict(), ValueError, "needs the shard's shape"),
        (dict(seq_len=4), ValueError, "needs the shard's shape"),
        (dict(seq_len=0, batch_size=1), ValueError, "seq_len must be >= 1"),
        (dict(seq_len=4, batch_size=1, cp_size=2, compress_ratio=3), ValueError, "seq_len: under context parallelism"),
        # shapes and dtypes
        (dict(position_ids=torch.arange(4)), ValueError, "position_ids must have 2 dimensions"),
        (dict(position_ids=torch.zeros(1, 4)), TypeError, "position_ids must have dtype"),
        (dict(attention_mask=torch.ones(1, 4)), TypeError, "attention_mask must have dtype"),
        (dict(packed_seq_ids=[[1, 1]]), TypeError, "packed_seq_ids must be a torch.Tensor"),
        (dict(seq_lens=torch.ones(1, 2, 2, dtype=I64)), ValueError, "seq_lens must have 1 or 2 dimensions"),
        (dict(position_ids=torch.zeros(2, 4, dtype=I64), batch_size=3),
            ValueError, "position_ids: batch size 2 does not match batch_size"),
        (dict(position_ids=torch.zeros(1, 4, dtype=I64), seq_len=5),
            ValueError, "position_ids: sequence length 4 does not match seq_len"),
        (dict(packed_seq_ids=torch.ones(2, 4, dtype=I64), attention_mask=torch.ones(2, 5, dtype=I64)),
            ValueError, "attention_mask: sequence length 5"),
        (dict(position_ids=torch.zeros(1, 4, dtype=I64), packed_seq_ids=torch.ones(1, 4, device="meta", dtype=I64)),
            ValueError, "packed_seq_ids must be on cpu"),
        # seq_lens / seq_lens_padded
        (dict(seq_lens=torch.tensor([[4, 4], [10, 20]])),
            ValueError, r"seq_lens: lengths of row 1 sum to 30, expected 8 \(= seq_len \* cp_size\)"),
        (dict(seq_lens=torch.tensor([[10, 20]]), seq_len=16, cp_size=2),
            ValueError, r"seq_lens: lengths of row 0 sum to 30, expected 32"),
        (dict(seq_lens=torch.tensor([[3, SENTINEL]]), cp_size=2), ValueError, "seq_lens: row 0 covers 3 tokens"),
        (dict(seq_lens=torch.zeros(1, 0, dtype=I64), seq_len=4), ValueError, "seq_lens has no entries"),
        (dict(seq_lens=torch.tensor([[4, 4]]), seq_lens_padded=torch.tensor([[5, 3]])),
            ValueError, "seq_lens_padded: entry 1 of row 0 is 3, shorter"),
        (dict(seq_lens=torch.tensor([[4, 4]]), seq_lens_padded=torch.tensor([[4, 4, 1]])),
            ValueError, "seq_lens_padded must have the shape of seq_lens"),
        (dict(seq_lens_padded=torch.tensor([[4, 4]])), ValueError, "seq_lens_padded needs seq_lens"),
        (dict(seq_lens=torch.tensor([[2, 2]]), seq_lens_padded=torch.tensor([[4, 4]]), attention_mask=torch.ones(1, 8).bool()),
            ValueError, "attention_mask: token/padding split disagrees with seq_lens"),
        # cu_seqlens
        (dict(cu_seqlens=torch.tensor([1, 4, 8])), ValueError, "cu_seqlens: row 0 starts at 1, expected 0"),
        (dict(cu_seqlens=torch.tensor([[0, 4, 8], [0, 6, 5]]), seq_len=8),
            ValueError, "cu_seqlens must be non-decreasing, row 1 drops from 6 to 5"),
        (dict(cu_seqlens=torch.tensor([[0, 4, 8], [0, 4, 7]])),
            ValueError, r"cu_seqlens: row 1 ends at 7, expected 8 \(= seq_len \* cp_size\)"),
        (dict(cu_seqlens=torch.tensor([0])), ValueError, "cu_seqlens needs at least 2 entries"),
        (dict(cu_seqlens=torch.tensor([0, 4, 8]), position_ids=torch.zeros(2, 8, dtype=I64)),
            ValueError, "cu_seqlens: a 1-D cu_seqlens describes a single row"),
        (dict(cu_seqlens=torch.tensor([[0, 4, 8]]), seq_lens=torch.tensor([[3, 5]])),
            ValueError, "cu_seqlens: document start disagrees with seq_lens at row 0 token 3"),
        # position_ids
        (dict(position_ids=torch.tensor([[0, 1, -1, 0]])),
            ValueError, "position_ids must be >= 0 on real tokens, row 0 token 2"),
        (dict(position_ids=torch.tensor([[1, 2, 3, 4]])),
            ValueError, "position_ids: row 0 token 0 has position_id 1 but global position 0"),
        (dict(position_ids=torch.tensor([[0, 1, 2, 0, 3]])),
            ValueError, "position_ids: row 0 jumps from 0 at token 3 to 3 at token 4"),
        (dict(position_ids=torch.tensor([[0, 1, 2, 3]]), seq_lens=torch.tensor([[2, 2]])),
            ValueError, "position_ids: document start .* disagrees with seq_lens at row 0 token 2"),
        (dict(position_ids=torch.tensor([[0, 1, 2, 3]]), attention_mask=torch.tensor([[1, 0, 1, 1]])),
            ValueError, "attention_mask: token 1 of row 0 is padding but position_ids puts token 2 inside a document"),
        # packed_seq_ids
        (dict(packed_seq_ids=torch.tensor([[1, 1, -2, 0]])), ValueError, "packed_seq_ids must be >= 0"),
        (dict(packed_seq_ids=torch.tensor([[1, 1, 2, 1]])),
            ValueError, "packed_seq_ids: id 1 of row 0 appears again at token 3"),
        (dict(packed_seq_ids=torch.tensor([[1, 0, 1, 1]])),
            ValueError, "packed_seq_ids: id 1 of row 0 appears again at token 2"),
        (dict(packed_seq_ids=torch.tensor([[1, 1, 2, 2]]), cp_size=2),
            ValueError, "packed_seq_ids: under context parallelism"),
        (dict(packed_seq_ids=torch.tensor([[1, 1, 2, 2]]), position_ids=torch.tensor([[0, 1, 2, 3]])),
            ValueError, "packed_seq_ids: tokens 1 and 2 of row 0 have different ids but one document"),
        (dict(packed_seq_ids=torch.tensor([[1, 1, 1, 1]]), position_ids=torch.tensor([[0, 1, 0, 1]])),
            ValueError, "packed_seq_ids: tokens 1 and 2 of row 0 have the same id but different documents"),
        (dict(packed_seq_ids=torch.tensor([[1, 1, 0, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0]])),
            ValueError, "attention_mask: token/padding split disagrees with packed_seq_ids at row 0 token 2"),
        # attention_mask
        (dict(attention_mask=torch.tensor([[1, 2, 1, 0]])), ValueError, "attention_mask must contain only 0 and 1"),
        (dict(attention_mask=torch.tensor([[0, 1, 1, 1]])),
            ValueError, "attention_mask: row 0 has padding before real token 1; an unpacked row may only be right"),
        (dict(attention_mask=torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0]])),
            ValueError, "attention_mask: row 1 has padding before real token 2"),
    ],
)
def test_validation_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        build(**kwargs)


def test_packed_seq_ids_under_cp_with_position_ids_is_accepted():
    # The counterpart of the CP rejection above: with position_ids the shard can place documents.
    ids, pids = torch.tensor([[1, 1, 2, 2]]), torch.tensor([[4, 5, 0, 1]])
    meta = build(packed_seq_ids=ids, position_ids=pids, cp_rank=1, cp_size=2)
    assert meta.doc_ids.tolist() == [[1, 1, 7, 7]] and meta.ks.tolist() == [[0, 0, 3, 3]]


def test_all_padding_and_short_rows():
    # A row of padding sees nothing; a row shorter than R has no groups at all.
    meta = build(packed_seq_ids=torch.zeros(2, 5, dtype=torch.uint8), compress_ratio=4)
    assert not meta.token_valid.any() and not meta.allowed().any() and not meta.group_valid.any()
    assert meta.ks.tolist() == meta.ke.tolist() == [[0] * 5] * 2
    meta = build(attention_mask=torch.tensor([[1, 1, 1, 0, 0]], dtype=torch.uint8), compress_ratio=8)
    assert meta.num_groups == 0 and meta.group_valid.shape == (1, 0) and meta.allowed().shape == (1, 5, 0)


def test_device_argument_places_tensorless_metadata_and_checks_tensors():
    # CPU-only here; tests/models/test_model.py::test_cuda_forward_from_input_ids_alone places it on CUDA.
    meta = build_attention_metadata(compress_ratio=4, batch_size=2, seq_len=8, device="cpu")
    assert meta.ks.device.type == "cpu" and meta.positions.shape == (2, 8)
    with pytest.raises(ValueError, match="device"):
        build_attention_metadata(compress_ratio=4, position_ids=torch.arange(8)[None], device="meta")


def test_lengths_whose_int64_sum_wraps_are_refused():
    """Entries near 2**63 sum (wrapping) to the row's length: refused by name, not laid out."""
    big = 2**62
    for lengths in ([[big, big, big, big, 8]], [[3, 2**63 - 1, 2**63 - 1, 7]]):
        with pytest.raises(ValueError, match=r"seq_lens: entry \d of row 0 is \d+, longer than the row's 8 tokens"):
            build_attention_metadata(compress_ratio=4, seq_lens=torch.tensor(lengths), seq_len=8)
    spans = torch.tensor([[big, big, big, big, 8]])
    with pytest.raises(ValueError, match="seq_lens_padded: entry 0 of row 0"):
        build_attention_metadata(compress_ratio=4, seq_lens=spans.clamp_max(8), seq_lens_padded=spans, seq_len=8)
    with pytest.raises(ValueError, match=r"cu_seqlens: entry 1 of row 0 is 9223372036854775807, outside \[0, 8\]"):
        build_attention_metadata(compress_ratio=4, cu_seqlens=torch.tensor([[0, 2**63 - 1, -(2**63), -(2**62), 0, 8]]),
                                 seq_len=8)
