"""DSAForCausalLM's forward refuses what it would otherwise drop or fail on deep inside: unknown
keyword arguments (a misspelt ``postion_ids=`` would lose the packing), a bogus ``qkv_format``,
token ids and labels outside the vocabulary or not integers; and a sliding window longer than the
sequence costs nothing beyond it (``sliding_window`` up to 2**31 - 1 is a valid config)."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import TINY_VOCAB, tiny_config
from nemo_dsa.models.dsa_lm.modeling import DSAForCausalLM


@pytest.fixture(scope="module")
def model() -> DSAForCausalLM:
    torch.manual_seed(0)
    return DSAForCausalLM(tiny_config()).eval()


def _ids(seq: int = 12) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (2, seq), generator=torch.Generator().manual_seed(3))


def test_a_misspelt_keyword_is_named(model):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'postion_ids' \(did you mean position_ids\?\)"):
        model(_ids(), postion_ids=torch.arange(12)[None])


def test_transformers_generation_flags_are_accepted(model):
    with torch.no_grad():
        out = model(_ids(), use_cache=False, return_dict=True).logits
        assert torch.equal(out, model(_ids()).logits)


def test_a_bogus_qkv_format_is_named(model):
    with pytest.raises(ValueError, match="qkv_format must be one of"):
        model(_ids(), qkv_format="bogus")


@pytest.mark.parametrize("name, value, message", [
    ("input_ids", TINY_VOCAB, rf"input_ids must lie in \[0, vocab_size={TINY_VOCAB}\), got {TINY_VOCAB} at \[1, 4\]"),
    ("input_ids", -3, rf"input_ids must lie in \[0, vocab_size={TINY_VOCAB}\), got -3 at \[1, 4\]"),
    ("labels", TINY_VOCAB + 5, r"labels must lie in .* or -100 \(ignored\), got 66 at \[1, 4\]"),
    ("labels", -2, r"labels must lie in .* or -100 \(ignored\), got -2 at \[1, 4\]"),
])
def test_ids_outside_the_vocabulary_are_named(model, name, value, message):
    ids = _ids()
    labels = _ids().clone()
    target = ids if name == "input_ids" else labels
    target[1, 4] = value
    with pytest.raises(ValueError, match=message):
        model(ids, labels=labels)


@pytest.mark.parametrize("name", ["input_ids", "labels"])
def test_float_ids_are_named(model, name):
    ids = _ids()
    kwargs = {"input_ids": ids.float() if name == "input_ids" else ids, "labels": ids.float() if name == "labels" else ids}
    with pytest.raises(TypeError, match=f"{name} must be an integer tensor of token ids, got float32"):
        model(**kwargs)


def test_labels_of_minus_100_are_still_ignored(model):
    labels = _ids().clone()
    labels[:, :5] = -100
    assert torch.isfinite(model(_ids(), labels=labels).loss)


def test_a_window_longer_than_the_sequence_equals_one_as_long_as_it():
    torch.manual_seed(0)
    exact = DSAForCausalLM(tiny_config(sliding_window=12)).eval()
    huge = DSAForCausalLM(tiny_config(sliding_window=2**31 - 1)).eval()
    huge.load_state_dict(exact.state_dict())
    with torch.no_grad():
        assert torch.equal(exact(_ids()).logits, huge(_ids()).logits)
