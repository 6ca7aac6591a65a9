"""An offline text corpus, a byte-level tokenizer, and document packing for the training recipe.

The corpus is real English/technical prose that exists on every machine without a download: the
docstrings of a fixed list of Python standard-library modules. Documents are tokenized to bytes
and packed into rows of ``seq_len`` tokens with the per-document metadata that nemo-automodel's
THD collater emits (document-local ``position_ids``, ``seq_lens`` padded with -1000), so the model
sees exactly the packed layout it meets in real trainers.

Packing rules (one row = ``seq_len`` tokens):
- each document is ``[BOS] + utf-8 bytes + [EOS]``;
- documents fill a row in order; a document that does not fit is split at the row end and its
  remainder starts the next row as a fresh document (document-local positions restart at 0);
- when fewer than ``min_piece`` tokens are left in a row, the row is padded instead (PAD token,
  label -100, position 0, packed_seq_id 0, attention_mask 0);
- ``labels[t]`` is the next token of the same document piece, -100 at each piece's last token and
  on padding (labels are already shifted: the loss compares ``logits[t]`` with ``labels[t]``).
"""

from __future__ import annotations

from array import array
import hashlib
import importlib
import inspect
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from nemo_dsa._checks import check_positive_int
from nemo_dsa.labels import IGNORE_INDEX

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259  # 256 bytes + BOS/EOS/PAD; equals the tiny model's vocab_size
SEQ_LENS_PAD = -1000  # the sentinel nemo-automodel's packed_sequence_thd_collater pads with


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS=256, EOS=257, PAD=258."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special`` wrapped in BOS ... EOS."""
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids, EOS_ID] if add_special else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped, invalid UTF-8 is replaced."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------

# Fixed and sorted so that the corpus (for a given Python version) is identical on every machine.
CORPUS_MODULES: tuple[str, ...] = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "collections",
    "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "email.message", "enum", "fractions", "functools", "glob", "gzip",
    "hashlib", "heapq", "hmac", "html", "http.client", "inspect", "io", "ipaddress", "itertools",
    "json", "logging", "math", "mimetypes", "operator", "os", "pathlib", "pickle", "pprint",
    "queue", "random", "re", "sched", "secrets", "shlex", "shutil", "socket", "sqlite3",
    "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "time", "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse",
    "uuid", "warnings", "weakref", "zipfile", "zlib",
)


@dataclass(frozen=True)
class Document:
    title: str  # e.g. "json.dumps": also the key of the train/validation split
    text: str


def _doc_of(title: str, obj) -> Document | None:
    doc = inspect.getdoc(obj)
    if not doc or len(doc) < 40:  # one-liners carry little text to learn from
        return None
    try:
        header = f"{title}{_stable_signature(obj)}"
    except (TypeError, ValueError):
        header = title
    return Document(title, f"{header}\n\n{doc}\n")


class _Elided:
    def __repr__(self) -> str:
        return "..."


def _stable_signature(obj) -> inspect.Signature:
    """The signature with non-literal defaults shown as ``...``: their reprs carry memory addresses
    and runtime state (``logging.shutdown(handlerList=[<weakref at 0x...>, ...])``)."""
    sig = inspect.signature(obj)
    literal = (type(None), bool, int, float, str, bytes)
    params = [
        p.replace(default=_Elided()) if p.default is not p.empty and not isinstance(p.default, literal) else p
        for p in sig.parameters.values()
    ]
    return sig.replace(parameters=params)


def stdlib_documents(modules: Sequence[str] = CORPUS_MODULES) -> list[Document]:
    """Documents built from the docstrings of ``modules``, their public functions and classes,
    and the classes' public methods, in a deterministic order. Nothing is downloaded."""
    docs: list[Document] = []
    seen: set[str] = set()

    def add(doc: Document | None) -> None:
        if doc is not None and doc.text not in seen:
            seen.add(doc.text)
            docs.append(doc)

    with warnings.catch_warnings():
        # Touching deprecated attributes (typing.io, ...) warns; the corpus only reads them.
        warnings.simplefilter("ignore", DeprecationWarning)
        for module_name in modules:
            _add_module(module_name, add)
    return docs


def _add_module(module_name: str, add) -> None:
    """Add the docs of one module, its public functions/classes and the classes' methods."""
    module = importlib.import_module(module_name)
    add(_doc_of(module_name, module))
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue  # private, or re-exported from another module (counted there)
        if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
            continue
        add(_doc_of(f"{module_name}.{name}", obj))
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                member = vars(obj)[attr]
                # defined in the class itself: libraries attach methods to stdlib classes
                # (transformers adds logging.Logger.warning_once on import)
                defined_here = getattr(member, "__qualname__", "").startswith(obj.__qualname__ + ".")
                if not attr.startswith("_") and callable(member) and defined_here:
                    add(_doc_of(f"{module_name}.{name}.{attr}", member))


def _bucket(title: str) -> int:
    return zlib.crc32(title.encode("utf-8")) % 100


def is_validation(title: str, val_percent: int) -> bool:
    """Deterministic split by a hash of the title (stable across runs and machines)."""
    return _bucket(title) < val_percent


def split_documents(docs: Sequence[Document], val_percent: int = 5) -> tuple[list[Document], list[Document]]:
    """(train, validation) documents; the split depends only on the documents' titles.

    With ``val_percent > 0`` and at least two documents, both sides get one: a small corpus whose
    titles all hash to one side gives the document whose hash lies nearest the other side to it
    (otherwise 17 files at val_percent=20 hold out none about once in 44 corpora).
    """
    if not 0 <= val_percent < 100:
        raise ValueError(f"val_percent must be in [0, 100), got {val_percent}")
    held_out = [is_validation(d.title, val_percent) for d in docs]
    if val_percent > 0 and len(docs) >= 2 and len(set(held_out)) == 1:
        order = sorted(range(len(docs)), key=lambda i: (_bucket(docs[i].title), docs[i].title, i))
        moved = order[0] if not held_out[0] else order[-1]  # nearest the validation side, or the training side
        held_out[moved] = not held_out[moved]
    train = [d for d, v in zip(docs, held_out, strict=True) if not v]
    val = [d for d, v in zip(docs, held_out, strict=True) if v]
    return train, val


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


def collate_rows(rows: Sequence[list[tuple[list[int], bool]]], seq_len: int, *, pad_id: int = PAD_ID) -> dict[str, torch.Tensor]:
    """Turn packed rows into a batch (``pad_id``: the token id of padding positions).

    Each row is a list of pieces ``(token_ids, is_padding)`` whose lengths sum to ``seq_len``.
    Returns ``input_ids``, ``labels``, ``position_ids`` (int64 [B,S]), ``packed_seq_ids``
    (int32 [B,S], 1-based, 0 = padding), ``attention_mask`` (int64 [B,S]), ``seq_lens`` and
    ``seq_lens_padded`` (int32 [B, max docs], padded with -1000; trailing row padding is folded
    into the last document's ``seq_lens_padded`` entry as the THD collater does).
    """
    b = len(rows)
    input_ids = torch.full((b, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_len), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((b, seq_len), dtype=torch.long)
    packed_seq_ids = torch.zeros((b, seq_len), dtype=torch.int32)
    attention_mask = torch.zeros((b, seq_len), dtype=torch.long)
    lens: list[list[int]] = []
    lens_padded: list[list[int]] = []
    for r, row in enumerate(rows):
        t, doc = 0, 0
        row_lens: list[int] = []
        row_padded: list[int] = []
        for ids, is_padding in row:
            n = len(ids)
            if is_padding:
                if row_padded:
                    row_padded[-1] += n
                else:  # a row of padding only: one empty document that owns the padding
                    row_lens.append(0)
                    row_padded.append(n)
                t += n
                continue
            doc += 1
            piece = torch.tensor(ids, dtype=torch.long)
            input_ids[r, t : t + n] = piece
            labels[r, t : t + n - 1] = piece[1:]
            position_ids[r, t : t + n] = torch.arange(n)
            packed_seq_ids[r, t : t + n] = doc
            attention_mask[r, t : t + n] = 1
            row_lens.append(n)
            row_padded.append(n)
            t += n
        if t != seq_len:
            raise ValueError(f"rows must hold exactly seq_len={seq_len} tokens, row {r} holds {t}")
        lens.append(row_lens)
        lens_padded.append(row_padded)
    width = max(len(x) for x in lens)
    seq_lens = torch.full((b, width), SEQ_LENS_PAD, dtype=torch.int32)
    seq_lens_padded = torch.full((b, width), SEQ_LENS_PAD, dtype=torch.int32)
    for r in range(b):
        seq_lens[r, : len(lens[r])] = torch.tensor(lens[r], dtype=torch.int32)
        seq_lens_padded[r, : len(lens_padded[r])] = torch.tensor(lens_padded[r], dtype=torch.int32)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "packed_seq_ids": packed_seq_ids,
        "attention_mask": attention_mask,
        "seq_lens": seq_lens,
        "seq_lens_padded": seq_lens_padded,
    }


class PackedBatches:
    """An endless, resumable stream of packed batches over tokenized documents.

    Each epoch visits every document once in an order drawn from ``seed`` and the epoch number
    (``shuffle=False`` keeps corpus order). ``state_dict()`` captures the exact read position, so a
    restored stream continues with the very batch the original would have produced next.
    """

    def __init__(
        self,
        documents: Sequence[Sequence[int]],
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        min_piece: int = 8,
        pad_id: int = PAD_ID,
    ) -> None:
        check_positive_int("seq_len", seq_len, minimum=2)
        check_positive_int("pad_id", pad_id, minimum=0)
        check_positive_int("batch_size", batch_size)
        check_positive_int("min_piece", min_piece, minimum=2)
        if min_piece > seq_len:
            raise ValueError(f"min_piece must be <= seq_len={seq_len}, got {min_piece}")
        if not documents:
            raise ValueError("documents must not be empty")
        if any(len(d) < 2 for d in documents):
            raise ValueError("every document must hold at least 2 tokens (BOS and EOS)")
        self.documents = [list(d) for d in documents]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.seed, self.shuffle, self.min_piece, self.pad_id = seed, shuffle, min_piece, pad_id
        self.epoch, self.cursor, self.offset = 0, 0, 0  # read position: epoch, doc index, token
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.documents)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.documents), generator=g).tolist()

    def _advance_doc(self) -> None:
        self.cursor, self.offset = self.cursor + 1, 0
        if self.cursor == len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)

    def _next_row(self) -> list[tuple[list[int], bool]]:
        row: list[tuple[list[int], bool]] = []
        room = self.seq_len
        while room:
            doc = self.documents[self._order[self.cursor]]
            left = len(doc) - self.offset
            if left <= room:
                row.append((doc[self.offset :], False))
                room -= left
                self._advance_doc()
                if 0 < room < self.min_piece:
                    row.append(([self.pad_id] * room, True))
                    room = 0
            else:  # split: the remainder becomes the first piece of the next row
                row.append((doc[self.offset : self.offset + room], False))
                self.offset += room
                room = 0
        return row

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return collate_rows([self._next_row() for _ in range(self.batch_size)], self.seq_len, pad_id=self.pad_id)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "offset": self.offset, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"data state was saved with seed={state['seed']}, this stream has seed={self.seed}")
        self.epoch, self.cursor, self.offset = int(state["epoch"]), int(state["cursor"]), int(state["offset"])
        self._order = self._epoch_order(self.epoch)


def corpus_fingerprint(documents: Sequence[Sequence[int]]) -> str:
    """sha256 of tokenized documents in order: the recipe compares it on resume, because the
    corpus is read from the running interpreter (a different Python, or a library that replaced a
    standard-library function, changes it)."""
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(len(doc).to_bytes(8, "little"))
        if max(doc, default=0) < 2**16:
            digest.update(array("H", doc).tobytes())  # byte-tokenizer runs keep their old digests
        else:  # ids of large vocabularies (Llama 3, DeepSeek, Qwen): 32 bits, marked as such
            digest.update(b"L" + array("L", doc).tobytes())
    return digest.hexdigest()


def fixed_batches(stream: PackedBatches, n: int) -> list[dict[str, torch.Tensor]]:
    """The first ``n`` batches of a stream (used for a validation set that never changes)."""
    return [next(stream) for _ in range(n)]


def build_streams(
    *,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    val_percent: int = 5,
    val_batches: int = 4,
    min_piece: int = 8,
    modules: Sequence[str] = CORPUS_MODULES,
) -> tuple[PackedBatches, list[dict[str, torch.Tensor]]]:
    """The shuffled training stream and a fixed list of validation batches over the stdlib corpus."""
    return pack_documents(stdlib_documents(modules), ByteTokenizer(), seq_len=seq_len, batch_size=batch_size,
                          seed=seed, val_percent=val_percent, val_batches=val_batches, min_piece=min_piece)


def _documents(n: int) -> str:
    return f"{n} document" if n == 1 else f"{n} documents"


def pack_documents(
    documents: Sequence[Document],
    tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    val_percent: int = 5,
    val_batches: int = 4,
    min_piece: int = 8,
) -> tuple[PackedBatches, list[dict[str, torch.Tensor]]]:
    """Split ``documents`` by title hash, tokenize them (``tokenizer.encode(text)``: BOS ... EOS) and
    pack them: the shuffled training stream and a fixed list of validation batches.

    ``tokenizer`` is anything with ``encode(text) -> list[int]`` and ``pad_id`` (``ByteTokenizer`` or
    ``nemo_dsa.recipe.data_sources.HFTokenizer``). A document that tokenizes to fewer than 2 tokens
    carries nothing to learn from and is dropped.
    """
    train_docs, val_docs = split_documents(documents, val_percent)

    def tokenized(docs: Sequence[Document]) -> list[list[int]]:
        return [ids for ids in (tokenizer.encode(d.text) for d in docs) if len(ids) >= 2]

    train_ids = tokenized(train_docs)
    if not train_ids:
        raise ValueError(f"the corpus has no training documents (of {_documents(len(documents))}, {len(train_docs)} for "
                         f"training at val_percent={val_percent}, none of 2 tokens or more): add documents or lower "
                         "val_percent (recipe.val_percent)")
    train = PackedBatches(train_ids, seq_len=seq_len, batch_size=batch_size, seed=seed, shuffle=True,
                          min_piece=min_piece, pad_id=tokenizer.pad_id)
    val: list[dict[str, torch.Tensor]] = []
    if val_batches > 0:
        val_ids = tokenized(val_docs)
        if not val_ids:
            raise ValueError(f"the corpus has no validation documents (of {_documents(len(documents))}, {len(val_docs)} held "
                             f"out at val_percent={val_percent}, none of 2 tokens or more; a corpus of one document "
                             "holds none out): add documents, raise val_percent (recipe.val_percent) or set "
                             "val_batches=0 (recipe.val_batches=0)")
        val_stream = PackedBatches(val_ids, seq_len=seq_len, batch_size=batch_size, shuffle=False,
                                   min_piece=min_piece, pad_id=tokenizer.pad_id)
        val = fixed_batches(val_stream, val_batches)
    return train, val
