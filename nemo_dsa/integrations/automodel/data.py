"""nemo_dsa's offline corpus as a dataset for nemo-automodel recipes (``train_ft``).

nemo-automodel's LLM datasets yield one example per document: ``input_ids`` and ``labels`` of the
same length with the labels already shifted (``labels[t]`` is the token after ``input_ids[t]``,
-100 where there is none), plus ``attention_mask``. Its THD packer
(``packed_sequence.packed_sequence_size`` in the YAML) then concatenates examples into rows and
writes ``position_ids`` / ``seq_lens`` / ``seq_lens_padded``; without packing the default
collater pads each batch. This module yields exactly that from ``nemo_dsa.data``'s stdlib
docstring corpus and byte tokenizer, so a recipe needs neither a download nor a tokenizer.
The module itself imports neither transformers nor nemo-automodel (its package registers the small
LM's config classes with transformers when imported).
"""

from __future__ import annotations

from collections.abc import Sequence

from nemo_dsa._checks import check_positive_int
from nemo_dsa.data import CORPUS_MODULES, ByteTokenizer, split_documents, stdlib_documents
from nemo_dsa.labels import IGNORE_INDEX

__all__ = ["byte_engram_tokenizer", "document_examples", "stdlib_docstring_dataset"]

SPLITS = ("train", "validation")


def document_examples(token_ids: Sequence[int], max_length: int) -> list[dict[str, list[int]]]:
    """Examples of one tokenized document: consecutive chunks of at most ``max_length`` tokens.

    Chunks do not overlap, so the last token of a chunk gets label -100 (its successor starts
    the next chunk, which the model sees as a separate document). A trailing chunk of a single
    token carries no label and is dropped.
    """
    check_positive_int("max_length", max_length, minimum=2)
    examples = []
    for start in range(0, len(token_ids), max_length):
        chunk = [int(t) for t in token_ids[start : start + max_length]]
        if len(chunk) < 2:
            continue
        examples.append(
            {
                "input_ids": chunk,
                "labels": chunk[1:] + [IGNORE_INDEX],
                "attention_mask": [1] * len(chunk),
            }
        )
    return examples


def stdlib_docstring_dataset(
    split: str = "train",
    max_length: int = 256,
    val_percent: int = 5,
    max_examples: int | None = None,
    modules: Sequence[str] = CORPUS_MODULES,
) -> list[dict[str, list[int]]]:
    """Map-style dataset (a list) of byte-tokenized stdlib docstrings for nemo-automodel.

    Args:
        split: "train" or "validation" (``nemo_dsa.data.split_documents``: by title hash).
        max_length: longest example in tokens; longer documents are cut into several examples.
            Keep it <= ``packed_sequence_size`` when packing (the packer drops longer ones).
        val_percent: share of documents in the validation split.
        max_examples: keep only the first this many examples (corpus order), for short runs.
        modules: stdlib modules whose docstrings form the corpus.

    Returns:
        A list of dicts with ``input_ids``, ``labels`` (already shifted, -100 = no target) and
        ``attention_mask``, each a list of ints of the example's length.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    check_positive_int("max_length", max_length, minimum=2)
    if max_examples is not None:
        check_positive_int("max_examples", max_examples)
    train_docs, val_docs = split_documents(stdlib_documents(tuple(modules)), val_percent)
    docs = train_docs if split == "train" else val_docs
    tokenizer = ByteTokenizer()
    examples: list[dict[str, list[int]]] = []
    for doc in docs:
        examples.extend(document_examples(tokenizer.encode(doc.text), max_length))
        if max_examples is not None and len(examples) >= max_examples:
            return examples[:max_examples]
    if not examples:
        raise ValueError(f"the {split!r} split is empty: adjust val_percent={val_percent} or modules")
    return examples


def byte_engram_tokenizer():
    """A transformers fast tokenizer over ``ByteTokenizer``'s ids, for DeepSeek-V4.1's Engram.

    V4.1's Engram hashes n-grams of token ids after merging ids whose decoded text normalises to
    the same string (``engram_compressed_vocab_size`` of them), so the model takes the tokenizer
    (``tokenizer=`` of the model, or the config's checkpoint). Here every id is one word-level
    token ``<b000>`` .. ``<b258>`` (bytes, then BOS, EOS, PAD), so no two ids merge: a model on this
    corpus sets ``vocab_size`` and ``engram_compressed_vocab_size`` to 259. Imports transformers.
    """
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<b{i:03d}>": i for i in range(ByteTokenizer.vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<b258>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<b258>", pad_token="<b258>")
