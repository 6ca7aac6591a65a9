"""Where the recipe's documents come from (the ``data`` group) and how they become tokens (``tokenizer``).

Sources (``data.source``):
- ``stdlib``: the embedded corpus of ``nemo_dsa.data`` (the default; nothing is read from disk);
- ``text``: text files (``data.paths``: files, directories of ``*.txt``, or globs), one document
  per file, or split at ``data.separator`` (e.g. a blank line, ``"\\n\\n"``);
- ``jsonl``: JSON-lines files, one document per line, its text under ``data.text_key``;
- ``hf``: a Hugging Face ``datasets`` dataset, offline only: ``data.dataset`` is a directory written
  by ``save_to_disk`` or the name of a dataset already in the local cache (nothing is downloaded).

Every source yields ``nemo_dsa.data.Document``s that are packed the same way (document
boundaries, document-local positions, padding), so the model's metadata sees the same layout as
with the embedded corpus. Documents from files and datasets are split into train and validation
by a hash of their text (stable when files move or are reordered).

Tokenizers (``tokenizer.kind``): ``byte`` (``nemo_dsa.data.ByteTokenizer``, the default) or ``hf``:
a Hugging Face ``tokenizers`` file (``tokenizer.path``: ``tokenizer.json`` or a directory holding
one), its BOS/EOS/PAD tokens named in the config or in the directory's ``tokenizer_config.json``.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from nemo_dsa import data as corpus
from nemo_dsa._untrusted import describe_mode, open_regular
from nemo_dsa.data import ByteTokenizer, Document

SOURCES = ("stdlib", "text", "jsonl", "hf")
REPLACEMENT = "\ufffd"
log = logging.getLogger("nemo_dsa.recipe")
TOKENIZER_KINDS = ("byte", "hf")


def _content_title(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _files(paths: Sequence[str], suffixes: tuple[str, ...]) -> list[Path]:
    """Every file ``paths`` names (directories: their files ending in ``suffixes``, sorted)."""
    if not paths:
        raise ValueError("data.paths must name at least one file, directory or glob, e.g. data.paths=[notes/*.txt]")
    found: list[Path] = []
    for entry in paths:
        entry = os.path.expanduser(str(entry))
        matches = sorted(glob.glob(entry, recursive=True)) if glob.has_magic(entry) else [entry]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise FileNotFoundError(f"data.paths: {entry} does not exist (relative paths are taken from {os.getcwd()})")
        for match in map(Path, matches):
            if match.is_dir():
                found += sorted(p for p in match.rglob("*") if p.is_file() and p.name.endswith(suffixes))
            elif not match.is_file():  # a FIFO would block the read, a device (/dev/zero) never end it
                kind = describe_mode(os.stat(match).st_mode)
                raise ValueError(f"data.paths: {match} is {kind}, not a regular file; only files are read")
            else:
                found.append(match)
    if not found:
        raise FileNotFoundError(f"data.paths: no {' or '.join(suffixes)} files in {list(paths)}")
    return found


def text_documents(paths: Sequence[str], separator: str | None = None) -> list[Document]:
    """One document per file, or per ``separator``-delimited part of each file (empty parts dropped)."""
    docs = []
    if separator:  # typed on a command line, where Hydra keeps "\n" as two characters
        separator = separator.replace("\\n", "\n").replace("\\t", "\t")
    for path in _files(paths, (".txt", ".md")):
        fd, _ = open_regular(path, follow_links=True)  # still a regular file when it is opened
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8", errors="replace")
        # U+FFFD the file did not hold itself: bytes that are not UTF-8 (a binary or Latin-1 file?)
        replaced = text.count(REPLACEMENT) - raw.count(REPLACEMENT.encode("utf-8"))
        if replaced:
            log.warning("data.paths: %s is not valid UTF-8: %d replacement character%s (U+FFFD) stand for its "
                        "undecodable bytes", path, replaced, "" if replaced == 1 else "s")
        parts = text.split(separator) if separator else [text]
        docs += [Document(_content_title(p), p) for p in parts if p.strip()]
    return docs


def jsonl_documents(paths: Sequence[str], text_key: str = "text") -> list[Document]:
    """One document per JSON line of each file: the string under ``text_key``."""
    docs = []
    # Directories contribute *.jsonl only (a config or dataset_info.json is not a corpus); a .json
    # file named explicitly is read as JSON lines.
    for path in _files(paths, (".jsonl",)):
        with os.fdopen(open_regular(path, follow_links=True)[0], "rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"data.paths: {path} line {n} is not UTF-8 text (byte {raw[e.start]:#04x} at column "
                                     f"{e.start + 1}); JSON lines files are UTF-8") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"data.paths: {path} line {n} is not JSON ({e})") from None
                text = record.get(text_key) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(f"data.text_key={text_key!r}: {path} line {n} has no string under it; keys: {keys}")
                if text.strip():
                    docs.append(Document(_content_title(text), text))
    return docs


def hf_documents(dataset: str | None, split: str = "train", text_key: str = "text",
                 dataset_config: str | None = None) -> list[Document]:
    """The ``text_key`` column of a ``datasets`` dataset, offline: a ``save_to_disk`` directory first,
    then the local Hugging Face cache. Nothing is downloaded."""
    if not dataset:
        raise ValueError("data.dataset must name a directory written by save_to_disk or a dataset in the local "
                         "Hugging Face cache, e.g. data.dataset=/data/my_corpus")
    with _offline() as datasets:
        return _load_hf_documents(datasets, dataset, split, text_key, dataset_config)


@contextlib.contextmanager
def _offline():
    """``datasets`` with every download switched off for the duration of one load, and the
    process's own settings (environment and ``datasets.config``) restored after it."""
    names = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    saved_env = {name: os.environ.get(name) for name in names}
    try:
        for name in names:
            os.environ.setdefault(name, "1")  # read by datasets / huggingface_hub when first imported
        try:
            import datasets
        except ImportError:
            raise ValueError("data.source=hf needs the 'datasets' package: pip install datasets") from None
        saved_config = {name: getattr(datasets.config, name, None) for name in names}
        try:
            for name in names:  # also when datasets was imported before this load
                setattr(datasets.config, name, True)
            yield datasets
        finally:
            for name, value in saved_config.items():
                setattr(datasets.config, name, value)
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _load_hf_documents(datasets, dataset: str, split: str, text_key: str, dataset_config: str | None) -> list[Document]:
    path = Path(os.path.expanduser(dataset))
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
    else:
        try:
            loaded = datasets.load_dataset(dataset, dataset_config, split=split)
        except Exception as e:  # noqa: BLE001 - datasets raises many types for "not available offline"
            raise ValueError(
                f"data.dataset={dataset!r}: not a directory written by save_to_disk and not in the local Hugging Face "
                f"cache (loading offline, nothing is downloaded: {type(e).__name__}: {str(e).splitlines()[0][:200]})"
            ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"data.split={split!r}: {dataset} has splits {sorted(loaded)}")
        loaded = loaded[split]
    if text_key not in loaded.column_names:
        raise ValueError(f"data.text_key={text_key!r}: {dataset} has columns {loaded.column_names}")
    return [Document(_content_title(t), t) for t in loaded[text_key] if isinstance(t, str) and t.strip()]


def load_documents(data) -> list[Document]:
    """The documents the ``data`` config node names."""
    if data.source not in SOURCES:
        raise ValueError(f"data.source must be one of {SOURCES}, got {data.source!r}")
    if data.source == "stdlib":
        docs = corpus.stdlib_documents()  # looked up on the module, where a test may replace it
    elif data.source == "text":
        docs = text_documents(list(data.paths), data.separator)
    elif data.source == "jsonl":
        docs = jsonl_documents(list(data.paths), data.text_key)
    else:
        docs = hf_documents(data.dataset, data.split, data.text_key, data.dataset_config)
    if not docs:
        raise ValueError(f"data: {data.source} source {list(data.paths) or data.dataset!r} holds no non-empty documents")
    return docs


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer with the special tokens the packing needs.

    ``encode(text)`` is ``[BOS] + tokens + [EOS]`` (without BOS if the tokenizer has none), as the
    byte tokenizer's; the tokenizer's own post-processor is not applied, so BOS/EOS appear once.
    Padding uses ``pad_token``, or EOS when the tokenizer has no pad token (padding carries no label).
    """

    def __init__(self, path: str, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("tokenizer.kind=hf needs the 'tokenizers' package: pip install tokenizers") from None
        if not path:
            raise ValueError("tokenizer=hf needs tokenizer.path=<a tokenizer.json file or a directory holding one>")
        file = Path(os.path.expanduser(path))
        file = file / "tokenizer.json" if file.is_dir() else file
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer.path: no tokenizer file at {file}")
        self.path = str(file)
        try:
            self._tok = Tokenizer.from_file(self.path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for any unreadable file
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(f"tokenizer.path: {self.path} is not a tokenizers JSON file ({detail})") from None
        named = _special_tokens(file.parent)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._token_id("bos_token", bos_token or named.get("bos_token"), required=False)
        self.eos_id = self._token_id("eos_token", eos_token or named.get("eos_token"), required=True)
        pad = self._token_id("pad_token", pad_token or named.get("pad_token"), required=False)
        self.pad_id = self.eos_id if pad is None else pad

    def _token_id(self, key: str, token: str | None, *, required: bool) -> int | None:
        if token is None:
            if required:
                raise ValueError(f"tokenizer.{key}: {self.path} names no {key} (no tokenizer_config.json beside it "
                                 f"says one): set tokenizer.{key}=<the token>, quoted for the shell and Hydra: "
                                 f"\"tokenizer.{key}='</s>'\"")
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"tokenizer.{key}={token!r} is not in the vocabulary of {self.path}")
        return token_id

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if not add_special:
            return ids
        return ([] if self.bos_id is None else [self.bos_id]) + ids + [self.eos_id]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _special_tokens(directory: Path) -> dict[str, str]:
    """bos/eos/pad tokens named by ``tokenizer_config.json`` or ``special_tokens_map.json`` in ``directory``."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        try:
            config = json.loads((directory / name).read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:  # there, but not readable JSON (UnicodeDecodeError is a ValueError)
            detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(f"tokenizer.path: {directory / name} is not readable JSON ({detail})") from None
        if not isinstance(config, dict):
            raise ValueError(f"tokenizer.path: {directory / name} holds a JSON {type(config).__name__}, not an object")
        for key in ("bos_token", "eos_token", "pad_token"):
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                found[key] = value
    return found


def build_tokenizer(tokenizer):
    """The tokenizer the ``tokenizer`` config node names."""
    if tokenizer.kind not in TOKENIZER_KINDS:
        raise ValueError(f"tokenizer.kind must be one of {TOKENIZER_KINDS}, got {tokenizer.kind!r}")
    if tokenizer.kind == "byte":
        return ByteTokenizer()
    return HFTokenizer(tokenizer.path, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                       pad_token=tokenizer.pad_token)
