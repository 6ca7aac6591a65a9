"""The ``data`` and ``tokenizer`` config groups: local text / JSONL files, an offline Hugging Face
dataset, a local Hugging Face tokenizer; packing keeps the document boundaries the metadata needs."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from nemo_dsa.data import ByteTokenizer, PackedBatches, pack_documents
from nemo_dsa.recipe.data_sources import HFTokenizer, hf_documents, jsonl_documents, load_documents, text_documents
from nemo_dsa.train import load_config, main, read_metrics, train

SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=2", "recipe.ckpt_every=2",
         "recipe.val_every=2", "recipe.warmup_steps=1", "recipe.num_threads=1", "recipe.plot=false",
         "recipe.val_percent=30"]


def _texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    words = ["sparse", "attention", "index", "key", "query", "block", "window", "token", "rank", "shard", "é", "日本"]
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(3, 40))) + "." for _ in range(n)]


@pytest.fixture
def corpus_files(tmp_path):
    texts = _texts(0, 24)
    (tmp_path / "txt").mkdir()
    for i, t in enumerate(texts[:8]):
        (tmp_path / "txt" / f"doc{i}.txt").write_text(t)
    (tmp_path / "parts.txt").write_text("\n\n".join(texts[8:12]) + "\n\n")
    with open(tmp_path / "docs.jsonl", "w") as f:
        for t in texts[12:]:
            f.write(json.dumps({"content": t, "id": 1}) + "\n")
        f.write("\n")  # blank lines are skipped
    return tmp_path, texts


def _tokenizer_dir(tmp_path, texts) -> str:
    """A tiny word-level tokenizer built locally with the tokenizers library (nothing downloaded)."""
    pytest.importorskip("tokenizers", reason="tokenizer=hf needs the tokenizers package (pip install tokenizers)")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<s>", "</s>"]))
    out = tmp_path / "tok"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                                           "pad_token": "<pad>"}))
    return str(out)


def test_text_and_jsonl_files_become_documents(corpus_files):
    root, texts = corpus_files
    assert [d.text for d in text_documents([str(root / "txt")])] == texts[:8]  # sorted by name: doc0..doc7
    assert [d.text for d in text_documents([str(root / "parts.txt")], separator="\n\n")] == texts[8:12]
    assert [d.text for d in text_documents([str(root / "txt" / "doc*.txt"), str(root / "parts.txt")])] == \
        [*texts[:8], "\n\n".join(texts[8:12]) + "\n\n"]
    assert [d.text for d in jsonl_documents([str(root / "docs.jsonl")], text_key="content")] == texts[12:]
    with pytest.raises(ValueError, match=r"data.text_key='text': .* line 1 has no string under it; keys: \['content', 'id'\]"):
        jsonl_documents([str(root / "docs.jsonl")])
    with pytest.raises(FileNotFoundError, match="data.paths: .*nope.txt does not exist"):
        text_documents([str(root / "nope.txt")])
    with pytest.raises(ValueError, match="data.paths must name"):
        text_documents([])


def test_the_split_follows_the_text_not_the_file_order(corpus_files):
    from nemo_dsa.data import split_documents

    root, _ = corpus_files
    docs = jsonl_documents([str(root / "docs.jsonl")], text_key="content")
    train_a, val_a = split_documents(docs, 30)
    train_b, val_b = split_documents(list(reversed(docs)), 30)
    assert {d.text for d in val_a} == {d.text for d in val_b} and val_a and train_a


def test_hf_dataset_from_disk_offline(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = _texts(1, 10)
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"body": texts[:7], "n": list(range(7))}),
        "validation": datasets.Dataset.from_dict({"body": texts[7:], "n": [0] * 3}),
    }).save_to_disk(str(tmp_path / "ds"))
    assert [d.text for d in hf_documents(str(tmp_path / "ds"), "train", "body")] == texts[:7]
    assert [d.text for d in hf_documents(str(tmp_path / "ds"), "validation", "body")] == texts[7:]
    with pytest.raises(ValueError, match=r"data.split='test': .* has splits \['train', 'validation'\]"):
        hf_documents(str(tmp_path / "ds"), "test", "body")
    with pytest.raises(ValueError, match=r"data.text_key='text': .* has columns \['body', 'n'\]"):
        hf_documents(str(tmp_path / "ds"), "train", "text")


def test_hf_loading_leaves_the_process_online_settings_as_they_were(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": _texts(1, 3)}).save_to_disk(str(tmp_path / "ds"))
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    assert len(hf_documents(str(tmp_path / "ds"), "train", "text")) == 3
    assert "HF_HUB_OFFLINE" not in os.environ and "HF_DATASETS_OFFLINE" not in os.environ
    assert datasets.config.HF_HUB_OFFLINE is False and datasets.config.HF_DATASETS_OFFLINE is False


def test_a_jsonl_directory_reads_jsonl_files_only(tmp_path):
    (tmp_path / "corpus.jsonl").write_text(json.dumps({"text": "one document"}) + "\n")
    (tmp_path / "dataset_info.json").write_text('{\n  "pretty": "printed"\n}\n')  # not JSON lines
    assert [d.text for d in jsonl_documents([str(tmp_path)])] == ["one document"]
    assert len(jsonl_documents([str(tmp_path / "corpus.jsonl")])) == 1  # a named file is read whatever its suffix


def test_hf_dataset_not_on_disk_or_in_the_cache_is_named_without_a_download(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    with pytest.raises(ValueError, match=r"data.dataset='someone/never-downloaded': not a directory .* local Hugging Face cache"):
        hf_documents("someone/never-downloaded", "train", "text")


def test_hf_tokenizer_from_a_local_path(tmp_path):
    texts = _texts(2, 30)
    path = _tokenizer_dir(tmp_path, texts)
    tok = HFTokenizer(path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (2, 3, 1)
    ids = tok.encode(texts[0])
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == len(texts[0].split()) + 2 + texts[0].count(".")
    assert tok.decode(ids).replace(" .", ".") == texts[0]
    assert max(max(tok.encode(t)) for t in texts) < tok.vocab_size
    with pytest.raises(ValueError, match=r"tokenizer.eos_token='<eos>' is not in the vocabulary"):
        HFTokenizer(path, eos_token="<eos>")
    (tmp_path / "tok" / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match=r"tokenizer.eos_token: .* names no eos_token"):
        HFTokenizer(path)
    no_pad = HFTokenizer(path, eos_token="</s>")
    assert no_pad.bos_id is None and no_pad.pad_id == no_pad.eos_id and no_pad.encode("key")[-1] == 3
    with pytest.raises(FileNotFoundError, match="tokenizer.path: no tokenizer file"):
        HFTokenizer(str(tmp_path / "missing"))


@pytest.mark.parametrize("seq_len,min_piece", [(16, 2), (37, 5), (64, 8)])
def test_packing_hf_tokens_keeps_document_boundaries(tmp_path, seq_len, min_piece):
    """Packed rows of a foreign tokenizer's ids hold each document whole and in order, with
    document-local positions and the tokenizer's pad id on padding."""
    from _support.packing_invariants import check_row_invariants

    texts = _texts(3, 40)
    tok = HFTokenizer(_tokenizer_dir(tmp_path, texts))
    docs = [tok.encode(t) for t in texts]
    stream = PackedBatches(docs, seq_len=seq_len, batch_size=3, shuffle=False, min_piece=min_piece, pad_id=tok.pad_id)
    pieces = []
    for _ in range(6):
        batch = next(stream)
        pieces += check_row_invariants(batch, seq_len, min_piece, pad_id=tok.pad_id)
    flat = [t for p in pieces for t in p]
    stream_of_docs = [t for d in docs for t in d] * 2  # shuffle=False: the next epoch repeats the order
    assert flat == stream_of_docs[: len(flat)]


def test_a_run_on_jsonl_files_with_a_local_hf_tokenizer(tmp_path, corpus_files, capsys):
    """data=jsonl + tokenizer=hf: the model's vocab_size follows the tokenizer, the run trains,
    resumes, and a changed file is refused on resume (the corpus digest)."""
    root, texts = corpus_files
    tok = _tokenizer_dir(tmp_path, texts)
    args = [*SHORT, "data=jsonl", f"data.paths=[{root / 'docs.jsonl'}]", "data.text_key=content", "tokenizer=hf",
            f"tokenizer.path={tok}", f"run_dir={tmp_path / 'run'}"]
    cfg = load_config(args)
    result = train(cfg)
    assert result.step == 2 and result.val_loss is not None
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_0000002" / "trainer_state.pt", weights_only=False)
    assert state["model_config"]["vocab_size"] == HFTokenizer(tok).vocab_size
    assert "vocab_size: " + str(HFTokenizer(tok).vocab_size) in (tmp_path / "run" / "config.yaml").read_text()
    assert train(load_config([*args, "recipe.max_steps=3"])).resumed_from == 2
    with open(root / "docs.jsonl", "a") as f:
        f.write(json.dumps({"content": "one more document about sparse attention."}) + "\n")
    with pytest.raises(ValueError, match="changed corpus_sha256"):
        train(load_config([*args, "recipe.max_steps=4"]))
    capsys.readouterr()
    assert main([*args, "model.config.vocab_size=8", f"run_dir={tmp_path / 'small'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nemo-dsa-train: error: model.config.vocab_size=8 is smaller than the tokenizer's vocabulary")


def test_a_run_on_text_files_and_on_an_hf_dataset(tmp_path, corpus_files):
    datasets = pytest.importorskip("datasets")
    root, texts = corpus_files
    text_run = train(load_config([*SHORT, "data=text", f"data.paths=[{root / 'txt'},{root / 'parts.txt'}]",
                                  "data.separator='\\n\\n'", f"run_dir={tmp_path / 'text'}"]))
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    hf_run = train(load_config([*SHORT, "data=hf", f"data.dataset={tmp_path / 'ds'}", f"run_dir={tmp_path / 'hf'}"]))
    for run in (text_run, hf_run):
        assert run.step == 2
        losses = [r["loss"] for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r]
        assert len(losses) == 2 and all(0 < x < 10 for x in losses)


def test_data_config_mistakes_are_one_line(tmp_path, capsys):
    cases = [
        (["data=jsonl"], "data.paths must name at least one file"),
        (["data=hf"], "data.dataset must name a directory"),
        (["data=csv"], "data=csv: no such option in config group 'data'; options: hf, jsonl, stdlib, text"),
        (["data.text_kee=x"], "data.text_kee: no such key in data (did you mean text_key?)"),
        (["+data.text_kee=x"], "data.text_kee: no such key in data (did you mean text_key?)"),
        (["tokenizer=hf"], "tokenizer=hf needs tokenizer.path="),
        (["tokenizer.kind=sentencepiece"], "tokenizer.kind must be one of ('byte', 'hf'), got 'sentencepiece'"),
    ]
    for overrides, expected in cases:
        assert main([*SHORT, f"run_dir={tmp_path}", *overrides]) == 2, overrides
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], (overrides, err)


def test_the_default_data_is_the_embedded_corpus():
    cfg = load_config([])
    assert (cfg.data.source, cfg.tokenizer.kind, cfg.model.config.vocab_size) == ("stdlib", "byte", 259)
    assert load_documents(cfg.data)[0].title == "abc"
    train_stream, val = pack_documents(load_documents(cfg.data)[:50], ByteTokenizer(), seq_len=64, batch_size=2,
                                       val_percent=20, val_batches=1)
    assert next(train_stream)["input_ids"].shape == (2, 64) and len(val) == 1


def test_files_that_are_not_utf8_are_named(tmp_path, capsys):
    """A binary .jsonl line, a binary tokenizer.json or tokenizer_config.json: one line naming the file."""
    (tmp_path / "ok.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    (tmp_path / "bad.jsonl").write_bytes(json.dumps({"text": "fine"}).encode() + b"\n\xff\xfe\x00binary\n")
    toks = tmp_path / "binary_tok"
    toks.mkdir()
    (toks / "tokenizer.json").write_bytes(bytes(range(256)) * 4)
    from pathlib import Path

    cfg_toks = Path(_tokenizer_dir(tmp_path, _texts(1, 8)))  # a real tokenizer ...
    (cfg_toks / "tokenizer_config.json").write_bytes(b'{"eos_token": "\xe9"}')  # ... named in Latin-1, not UTF-8
    cases = [
        (["data=jsonl", f"data.paths=[{tmp_path / 'ok.jsonl'},{tmp_path / 'bad.jsonl'}]"],
         f"data.paths: {tmp_path / 'bad.jsonl'} line 2 is not UTF-8 text (byte 0xff at column 1)"),
        (["tokenizer=hf", f"tokenizer.path={toks}"], f"tokenizer.path: {toks / 'tokenizer.json'} is not a tokenizers JSON file"),
        (["tokenizer=hf", f"tokenizer.path={cfg_toks}"], f"tokenizer.path: {cfg_toks / 'tokenizer_config.json'} is not readable JSON"),
    ]
    for overrides, expected in cases:
        assert main([*SHORT, f"run_dir={tmp_path / 'run'}", *overrides]) == 2, overrides
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0], (overrides, err)


def test_a_text_file_that_is_not_utf8_warns_with_the_count_of_replacements(tmp_path, caplog):
    good, bad = tmp_path / "good.txt", tmp_path / "latin1.txt"
    good.write_text("a real \ufffd replacement character, written on purpose\n", encoding="utf-8")
    bad.write_bytes("café crème brûlée".encode("latin-1") + b"\n\x80\x81 binary tail\n")
    with caplog.at_level("WARNING", logger="nemo_dsa.recipe"):
        docs = text_documents([str(good), str(bad)])
    assert len(docs) == 2 and docs[1].text.count("\ufffd") == 6
    (record,) = caplog.records  # the good file's own U+FFFD is not counted
    assert f"data.paths: {bad} is not valid UTF-8: 6 replacement characters (U+FFFD)" in record.getMessage()


def _titles_all_training(n: int, val_percent: int) -> list[str]:
    """``n`` texts whose content hashes all send them to training at ``val_percent``."""
    from nemo_dsa.data import is_validation
    from nemo_dsa.recipe.data_sources import _content_title

    texts, i = [], 0
    while len(texts) < n:
        text = " ".join(_texts(i, 1)) * 3
        i += 1
        if not is_validation(_content_title(text), val_percent) and text not in texts:
            texts.append(text)
    return texts


def test_a_small_corpus_whose_files_all_hash_to_training_still_validates(tmp_path, capsys):
    """17 files at val_percent=20, none held out by its hash: one is, and the run trains and validates."""
    corpus = tmp_path / "notes"
    corpus.mkdir()
    for i, text in enumerate(_titles_all_training(17, 20)):
        (corpus / f"note{i}.txt").write_text(text)
    args = [a for a in SHORT if not a.startswith("recipe.val_percent")]
    assert main([*args, "recipe.val_percent=20", "data=text", f"data.paths=[{corpus}]", f"run_dir={tmp_path / 'run'}"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["val_loss"] is not None and summary["val_loss"] > 0
    capsys.readouterr()
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "only.txt").write_text("a single document of a few words")
    assert main([*args, "data=text", f"data.paths=[{tmp_path / 'one'}]", f"run_dir={tmp_path / 'run1'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the corpus has no validation documents (of 1 document, 0 held out at val_percent=5" in err[0], err
    assert "recipe.val_batches=0" in err[0]
