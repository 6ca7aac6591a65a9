"""The offline corpus, byte tokenizer and packing (nemo_dsa.data)."""

from __future__ import annotations

import random

import pytest
import torch

from _support.packing_invariants import check_row_invariants
from nemo_dsa.data import (
    BOS_ID,
    EOS_ID,
    VOCAB_SIZE,
    ByteTokenizer,
    Document,
    PackedBatches,
    build_streams,
    is_validation,
    split_documents,
    stdlib_documents,
)

SMALL_CORPUS = ("json", "textwrap", "heapq")


def _random_docs(seed: int, n: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        body = [rng.randrange(256) for _ in range(rng.randrange(0, max_len))]
        docs.append([BOS_ID, *body, EOS_ID])
    return docs


def test_tokenizer_roundtrip_and_vocab():
    tok = ByteTokenizer()
    text = "naïve — ∑ café\nline two"
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID and max(ids) < VOCAB_SIZE == 259
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special=False) == list(text.encode("utf-8"))


def test_corpus_is_real_deterministic_text():
    docs = stdlib_documents(SMALL_CORPUS)
    again = stdlib_documents(SMALL_CORPUS)
    assert docs == again and len(docs) > 10
    titles = [d.title for d in docs]
    assert "json.dumps" in titles and len(set(titles)) == len(titles)
    dumps = docs[titles.index("json.dumps")].text
    assert dumps.startswith("json.dumps(") and "JSON" in dumps


def test_split_is_deterministic_and_disjoint():
    docs = stdlib_documents()
    train, val = split_documents(docs, val_percent=5)
    assert len(train) + len(val) == len(docs) and val and train
    assert not {d.title for d in train} & {d.title for d in val}
    assert split_documents(docs, 5) == (train, val)
    with pytest.raises(ValueError, match="val_percent"):
        split_documents(docs, 100)


@pytest.mark.parametrize("seq_len,batch_size,min_piece", [(37, 3, 5), (64, 2, 8), (16, 5, 2)])
def test_packing_invariants_and_no_token_lost(seq_len, batch_size, min_piece):
    docs = _random_docs(seq_len, n=23, max_len=3 * seq_len)  # some documents span several rows
    stream = PackedBatches(docs, seq_len=seq_len, batch_size=batch_size, shuffle=False, min_piece=min_piece)
    pieces = []
    for _ in range(12):
        pieces += check_row_invariants(next(stream), seq_len, min_piece)
    # Concatenated pieces reproduce the documents in order (wrapping around epochs).
    flat = [t for p in pieces for t in p]
    stream_tokens = [t for _ in range(len(flat) // sum(map(len, docs)) + 1) for d in docs for t in d]
    assert flat == stream_tokens[: len(flat)]


def test_real_corpus_batches_and_metadata_agree():
    train, val = build_streams(seq_len=96, batch_size=3, seed=3, val_batches=2, modules=SMALL_CORPUS, val_percent=20)
    batch = next(train)
    check_row_invariants(batch, 96, 8)
    assert len(val) == 2
    for v in val:
        check_row_invariants(v, 96, 8)
    # The THD fields and the per-token ids describe the same documents to the model's metadata.
    from nemo_dsa.metadata import build_attention_metadata

    a = build_attention_metadata(compress_ratio=4, position_ids=batch["position_ids"], seq_lens=batch["seq_lens"],
                                 seq_lens_padded=batch["seq_lens_padded"])
    b = build_attention_metadata(compress_ratio=4, packed_seq_ids=batch["packed_seq_ids"],
                                 attention_mask=batch["attention_mask"])
    assert torch.equal(a.token_valid, batch["attention_mask"].bool())
    assert torch.equal(a.ks, b.ks) and torch.equal(a.ke, b.ke)
    assert torch.equal(a.local_positions[a.token_valid], batch["position_ids"][a.token_valid])


def test_stream_seeded_and_resumable_across_epochs():
    docs = _random_docs(0, n=9, max_len=40)
    make = lambda seed: PackedBatches(docs, seq_len=32, batch_size=2, seed=seed)  # noqa: E731
    a, b, c = make(1), make(1), make(2)
    first_a = [next(a) for _ in range(5)]
    first_b = [next(b) for _ in range(5)]
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(first_a, first_b))
    assert any(not torch.equal(x["input_ids"], next(c)["input_ids"]) for x in first_a)
    state = a.state_dict()
    later = [next(a) for _ in range(8)]  # 9 short documents: this crosses epoch boundaries
    assert a.epoch >= 2
    resumed = make(1)
    resumed.load_state_dict(state)
    for x in later:
        y = next(resumed)
        assert all(torch.equal(x[k], y[k]) for k in x)
    with pytest.raises(ValueError, match="seed"):
        make(5).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seq_len=1, batch_size=2), "seq_len"),
        (dict(seq_len=8, batch_size=0), "batch_size"),
        (dict(seq_len=8, batch_size=1, min_piece=9), "min_piece"),
    ],
)
def test_stream_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackedBatches(_random_docs(0, 3, 10), **kwargs)
    with pytest.raises(ValueError, match="documents"):
        PackedBatches([], seq_len=8, batch_size=1)


def test_corpus_fingerprint_names_the_exact_documents():
    from nemo_dsa.data import corpus_fingerprint

    tok = ByteTokenizer()
    docs = [tok.encode(d.text) for d in stdlib_documents(SMALL_CORPUS)]
    again = [tok.encode(d.text) for d in stdlib_documents(SMALL_CORPUS)]
    assert corpus_fingerprint(docs) == corpus_fingerprint(again)
    changed = [list(d) for d in docs]
    changed[-1][-2] ^= 1
    assert corpus_fingerprint(changed) != corpus_fingerprint(docs)
    # document boundaries count: the same tokens split differently are a different corpus
    assert corpus_fingerprint([docs[0] + docs[1]]) != corpus_fingerprint(docs[:2])


def test_corpus_fingerprint_takes_ids_of_large_vocabularies():
    from array import array
    import hashlib

    from nemo_dsa.data import corpus_fingerprint

    byte_docs = [[256, 72, 105, 257], [256, 33, 257]]
    expected = hashlib.sha256()
    for doc in byte_docs:  # the 16-bit form byte-tokenizer checkpoints were saved with
        expected.update(len(doc).to_bytes(8, "little"))
        expected.update(array("H", doc).tobytes())
    assert corpus_fingerprint(byte_docs) == expected.hexdigest()
    large = [[128_000, 5, 151_642], [3]]  # ids of Llama 3 / Qwen-sized vocabularies
    assert corpus_fingerprint(large) != corpus_fingerprint([[128_000 % 65_536, 5, 151_642 % 65_536], [3]])
    assert corpus_fingerprint(large) == corpus_fingerprint([list(d) for d in large])


@pytest.mark.parametrize("val_percent", [1, 20, 95])
def test_a_split_of_two_or_more_documents_has_both_sides(val_percent):
    """Titles that all hash to one side: the one nearest the other side moves there; a split that
    already has both sides is the hash's alone."""
    rng = random.Random(val_percent)
    for n in (2, 3, 17):
        for side in (False, True):
            if side and val_percent == 1 or not side and val_percent == 95:
                continue  # too rare a side to draw n titles from quickly: covered by the other case
            titles = []
            while len(titles) < n:
                t = f"doc-{rng.random()}"
                if is_validation(t, val_percent) == side:
                    titles.append(t)
            docs = [Document(t, f"text {t}") for t in titles]
            train, val = split_documents(docs, val_percent)
            assert train and val and len(train) + len(val) == n
            assert sorted(d.title for d in train + val) == sorted(titles)
            moved = val if not side else train
            assert len(moved) == 1 and split_documents(list(reversed(docs)), val_percent)[1 if not side else 0] == moved
    mixed = [Document(f"t{i}", "x") for i in range(200)]
    train, val = split_documents(mixed, 20)
    assert [d.title for d in val] == [d.title for d in mixed if is_validation(d.title, 20)] and train
    for one in ([d] for d in mixed[:6]):  # one document: on its hash's side, nothing moved
        assert split_documents(one, 20) == (([], one) if is_validation(one[0].title, 20) else (one, []))
    assert split_documents(mixed[:5], 0)[1] == []  # val_percent=0 holds out nothing
