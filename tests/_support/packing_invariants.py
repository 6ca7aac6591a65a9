"""The packing contract every packed batch row keeps (nemo_dsa.data's PackedBatches, whatever the
corpus and tokenizer)."""

from __future__ import annotations

import torch

from nemo_dsa.data import IGNORE_INDEX, PAD_ID, SEQ_LENS_PAD


def check_row_invariants(batch: dict[str, torch.Tensor], seq_len: int, min_piece: int, pad_id: int = PAD_ID) -> list[list[int]]:
    """Assert the packing contract on every row; return the pieces (token lists) in order."""
    pieces = []
    b = batch["input_ids"].shape[0]
    for key in ("input_ids", "labels", "position_ids", "packed_seq_ids", "attention_mask"):
        assert batch[key].shape == (b, seq_len), key
    for r in range(b):
        ids, labels = batch["input_ids"][r], batch["labels"][r]
        pos, doc, mask = batch["position_ids"][r], batch["packed_seq_ids"][r], batch["attention_mask"][r]
        lens = [int(x) for x in batch["seq_lens"][r] if x > 0]
        padded = [int(x) for x in batch["seq_lens_padded"][r] if x != SEQ_LENS_PAD]
        assert all(x == SEQ_LENS_PAD for x in batch["seq_lens"][r][len(lens):].tolist())
        assert lens, "every row starts with a document piece"
        assert sum(padded) == seq_len and padded[:-1] == lens[:-1] and padded[-1] >= lens[-1]
        t = 0
        for d, n in enumerate(lens, start=1):
            seg = slice(t, t + n)
            assert (doc[seg] == d).all() and (mask[seg] == 1).all()
            assert torch.equal(pos[seg], torch.arange(n))
            assert torch.equal(labels[t : t + n - 1], ids[t + 1 : t + n])  # next token, same piece
            assert labels[t + n - 1] == IGNORE_INDEX  # piece end: the next token is another document
            pieces.append(ids[seg].tolist())
            t += n
        pad = seq_len - t
        assert pad < min_piece  # padding only when the room left is too small for a new piece
        tail = slice(t, seq_len)
        assert (ids[tail] == pad_id).all() and (labels[tail] == IGNORE_INDEX).all()
        assert (doc[tail] == 0).all() and (mask[tail] == 0).all() and (pos[tail] == 0).all()
    return pieces
