"""Split a (packed) batch into contiguous context-parallel shards.

Rank ``r`` of ``P`` keeps global tokens ``[r*S, (r+1)*S)`` of every row. Compressed attention
needs every shard to hold whole compression groups of every ratio, so rows are first right-padded
to a multiple of ``P * lcm(compress ratios)``. Padding tokens belong to no document (masked,
label -100), so they change neither the real tokens' outputs nor the loss. Documents may cross
shard boundaries: the attention module fetches what it needs from the other ranks.

The per-token fields are sharded; fields that describe the whole row (``seq_lens``,
``seq_lens_padded``, ``cu_seqlens``) stay global, as ``build_attention_metadata`` expects.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from nemo_dsa._checks import check_positive_int
from nemo_dsa.labels import IGNORE_INDEX

# Per-token fields [B, S, ...] and the value their padding gets. position_ids are special: they
# keep counting, so padding never repeats a position. labels use the CE ignore index.
SEQUENCE_PAD_VALUES: dict[str, float | int | bool] = {
    "input_ids": 0,  # replaced by pad_token_id
    "inputs_embeds": 0.0,
    "labels": IGNORE_INDEX,
    "attention_mask": 0,
    "padding_mask": True,  # True = padding (nemo-automodel's convention)
    "loss_mask": 0,
    "packed_seq_ids": 0,
    "position_ids": 0,  # see _pad_positions
}
# Fields describing the global row: passed to every rank unchanged (seq_lens_padded grows).
ROW_FIELDS = ("seq_lens", "seq_lens_padded", "cu_seqlens")
# Any of these tells real tokens from padding; without them the sharder adds an attention_mask.
_TOKEN_MASK_FIELDS = ("seq_lens", "seq_lens_padded", "cu_seqlens", "packed_seq_ids", "attention_mask", "padding_mask")


def cp_shard_multiple(compress_ratios: Iterable[int], cp_size: int) -> int:
    """The row-length multiple under CP: ``cp_size * lcm`` of the positive compression ratios."""
    check_positive_int("cp_size", cp_size)
    ratios = [int(r) for r in compress_ratios if int(r) > 0]
    return cp_size * (math.lcm(*ratios) if ratios else 1)


def cp_padded_length(seq_len: int, compress_ratios: Iterable[int], cp_size: int) -> int:
    """Global row length after CP padding (``seq_len`` itself when ``cp_size == 1``)."""
    if cp_size == 1:
        return seq_len
    multiple = cp_shard_multiple(compress_ratios, cp_size)
    return -(-seq_len // multiple) * multiple


def _pad_positions(position_ids: torch.Tensor, pad: int) -> torch.Tensor:
    """Continue each row's last position for the padding tokens."""
    steps = torch.arange(1, pad + 1, dtype=position_ids.dtype, device=position_ids.device)
    return torch.cat([position_ids, position_ids[:, -1:] + steps], dim=1)


def _extend_last_document(seq_lens: torch.Tensor, pad: int, name: str, seq_len: int) -> torch.Tensor:
    """Grow each row's last document slot by ``pad`` (its padded tail becomes longer).

    Keeps the caller's rank: a 1-D ``[ndocs]`` (one row) stays 1-D, matching ``seq_lens``.
    """
    if seq_lens.ndim == 1:
        return _extend_last_document(seq_lens.unsqueeze(0), pad, name, seq_len).squeeze(0)
    valid = seq_lens > 0
    totals = torch.where(valid, seq_lens, 0).sum(dim=1)
    bad = (totals != seq_len).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        raise ValueError(f"{name}: lengths of row {row} sum to {int(totals[row])}, expected the row length {seq_len}")
    if not bool(valid.any(dim=1).all()):
        raise ValueError(f"{name}: every row needs at least one positive length")
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(dim=1)
    out = seq_lens.clone()
    out[torch.arange(out.shape[0], device=out.device), last] += pad
    return out


def shard_batch(
    batch: Mapping[str, Any],
    cp_group=None,
    *,
    compress_ratios: Iterable[int] = (),
    pad_token_id: int = 0,
    cp_rank: int | None = None,
    cp_size: int | None = None,
    extra_sequence_keys: Mapping[str, float | int | bool] | None = None,
) -> dict[str, Any]:
    """This rank's contiguous shard of ``batch`` (a dict of [B, S, ...] per-token tensors).

    Args:
        batch: the full global batch, identical on every rank of the group. Per-token fields:
            ``input_ids`` (or ``inputs_embeds``), ``labels``, ``position_ids``, ``attention_mask``,
            ``padding_mask``, ``loss_mask``, ``packed_seq_ids`` and ``extra_sequence_keys``;
            row fields ``seq_lens`` / ``seq_lens_padded`` / ``cu_seqlens`` are kept whole.
            Labels must already be aligned with the tokens (nemo-automodel convention): a
            shard cannot shift labels across its boundary.
        cp_group: the CP process group (rank and size are read from it), or None together
            with explicit ``cp_rank`` / ``cp_size`` (tests, dry runs). None alone = no CP.
        compress_ratios: the model's per-layer ratios (0 = window only); shards hold whole groups.
        pad_token_id: the token id written into padding.
        extra_sequence_keys: further per-token fields and their padding values.

    Returns:
        A new dict: per-token fields sliced to ``[B, G/P, ...]`` with ``G`` the padded length,
        row fields (``seq_lens_padded`` grown by the padding), other entries unchanged.
        ``seq_lens`` without ``seq_lens_padded`` gains a ``seq_lens_padded`` when padding is added.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a mapping of field name to tensor, got {type(batch).__name__}")
    if cp_group is not None:
        import torch.distributed as dist

        rank, size = dist.get_rank(cp_group), dist.get_world_size(cp_group)
        if (cp_rank is not None and cp_rank != rank) or (cp_size is not None and cp_size != size):
            raise ValueError(f"cp_rank/cp_size ({cp_rank}, {cp_size}) contradict cp_group ({rank}, {size})")
    else:
        rank = 0 if cp_rank is None else cp_rank
        size = 1 if cp_size is None else cp_size
    check_positive_int("cp_size", size)
    check_positive_int("cp_rank", rank, minimum=0)
    if rank >= size:
        raise ValueError(f"cp_rank must be < cp_size={size}, got {rank}")
    pad_values = dict(SEQUENCE_PAD_VALUES, input_ids=pad_token_id)
    pad_values.update(extra_sequence_keys or {})

    primary = "inputs_embeds" if "inputs_embeds" in batch else "input_ids"
    if primary not in batch or not isinstance(batch[primary], torch.Tensor) or batch[primary].ndim < 2:
        raise ValueError("batch must hold input_ids [B, S] (or inputs_embeds [B, S, hidden])")
    rows, seq_len = batch[primary].shape[:2]
    out = dict(batch)
    if size == 1:
        return out

    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or key in ROW_FIELDS:
            continue
        if key not in pad_values:
            if value.ndim >= 2 and tuple(value.shape[:2]) == (rows, seq_len):
                raise ValueError(
                    f"batch[{key!r}] looks per-token {tuple(value.shape)} but is not a known field: "
                    "pass extra_sequence_keys={key: pad_value} so it is padded and sharded"
                )
            continue
        broadcast_rows = key == "position_ids" and value.ndim == 2 and value.shape[0] == 1  # [1, S] is allowed
        if value.ndim < 2 or value.shape[1] != seq_len or (value.shape[0] != rows and not broadcast_rows):
            raise ValueError(
                f"batch[{key!r}] must have shape [{rows}, {seq_len}, ...] like {primary}, got {tuple(value.shape)}"
            )

    padded = cp_padded_length(seq_len, compress_ratios, size)
    pad = padded - seq_len
    if pad:
        for key in ROW_FIELDS:
            if key == "cu_seqlens" and key in batch:
                raise ValueError(
                    f"cu_seqlens: the row length {seq_len} must be padded to {padded} for cp_size={size}; "
                    "pass seq_lens/seq_lens_padded instead, or pre-pad the rows"
                )
        if "seq_lens_padded" in batch:
            out["seq_lens_padded"] = _extend_last_document(batch["seq_lens_padded"], pad, "seq_lens_padded", seq_len)
        elif "seq_lens" in batch:
            out["seq_lens_padded"] = _extend_last_document(batch["seq_lens"], pad, "seq_lens", seq_len)
        if not any(key in batch for key in _TOKEN_MASK_FIELDS):
            # Nothing would tell the padding apart from the row's last document: add a mask.
            device = batch[primary].device
            out["attention_mask"] = torch.ones(rows, seq_len, dtype=torch.long, device=device)

    local = padded // size
    start = rank * local
    for key, value in list(out.items()):
        if key not in pad_values or not isinstance(value, torch.Tensor):
            continue
        if pad and key == "position_ids":
            value = _pad_positions(value, pad)
        elif pad:
            filler = torch.full((rows, pad, *value.shape[2:]), pad_values[key], dtype=value.dtype, device=value.device)
            value = torch.cat([value, filler], dim=1)
        out[key] = value[:, start : start + local].contiguous()
    return out
