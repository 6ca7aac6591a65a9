"""Attention metadata: which compressed keys each query may see (docs/semantics.md "Tokens" .. "Visibility").

The builder turns whatever the trainer emits (position_ids, seq_lens[_padded], cu_seqlens,
packed_seq_ids, attention_mask) into one per-token description of the local shard:

* global position ``p`` (rank ``r`` of ``P`` holds global tokens ``[r*S, (r+1)*S)``),
* document start ``a`` (global) for real tokens; padding belongs to no document,
* the visible compressed range ``[ks, ke)`` on the GLOBAL compressed axis.

Conventions fixed here (the rest of nemo_dsa relies on them):

* ``doc_ids = 1 + a`` for real tokens, 0 for padding. The id depends only on where the document
  starts in the global row, so every CP rank names the same document the same way without
  communicating; user-supplied ``packed_seq_ids`` values are only used to tell documents apart.
* padding queries get ``ks = ke = 0``; ``local_positions`` is 0 for padding.
* a document ``[a, b)``: ``ks = min(ceil(a/R), K)``, ``ke = max(ks, floor((p+1)/R))``, so
  ``0 <= ks <= ke <= K = floor(G/R)`` for every layout (a document starting in the row's
  trailing partial group sees nothing, ``ks = ke = K``)
  (``nemo_dsa.visibility.document_ks_ke``, the one definition of the rule): only ``a`` and ``p``
  are needed, so each rank computes its rows from local information.
* ``cu_seqlens`` is ``[ndocs+1]`` (one row, flash-attn style) or ``[B, ndocs+1]`` where a row with
  fewer documents repeats its last entry; it starts at 0 and ends at ``G = S*P`` (every token in a
  document, so it cannot express padding).
* ``seq_lens`` / ``seq_lens_padded`` ``[B, ndocs]`` (or ``[ndocs]`` for one row): entry ``k`` is a
  span of ``seq_lens_padded[k]`` tokens (``seq_lens[k]`` without ``seq_lens_padded``) whose first
  ``seq_lens[k]`` tokens are the document and the rest padding; non-positive entries count as 0
  (nemo-automodel's THD collater pads with -1000). Spans tile the global row from position 0 and
  must sum to ``G`` exactly (docs/semantics.md: lengths that do not sum to S*P raise).

When several inputs are given they must agree: the token/padding split (seq_lens/cu_seqlens,
packed_seq_ids > 0, attention_mask) exactly, and the document starts (seq_lens/cu_seqlens,
``p - position_ids``, packed_seq_ids runs) on every real token. position_ids of padding tokens are
ignored (collaters write anything there). What a shard cannot see (a document continuing from an
earlier rank) is trusted; everything visible locally is checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_dsa._checks import INT32_MAX, check_device, check_has_data, check_positive_int, check_tensor
from nemo_dsa.visibility import KeyRanges, document_ks_ke, visible_mask

__all__ = ["AttentionMetadata", "build_attention_metadata", "build_attention_metadata_for_ratios"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_MASK_DTYPES = (torch.bool,) + _INT_DTYPES


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Per-token visibility of the local shard ``[B, S]`` (tensors on the inputs' device).

    Query ``i`` sees compressed key ``j`` (global compressed axis) iff ``ks[b, i] <= j < ke[b, i]``.
    """

    positions: torch.Tensor  # int64 [B, S] global position p = cp_rank*S + local index
    doc_ids: torch.Tensor  # int64 [B, S] 1 + global start of the token's document, 0 = padding
    local_positions: torch.Tensor  # int64 [B, S] position inside the document, 0 for padding
    token_valid: torch.Tensor  # bool [B, S] real token (doc_ids > 0)
    ks: torch.Tensor  # int32 [B, S] first visible compressed key
    ke: torch.Tensor  # int32 [B, S] one past the last visible key; ks == ke == 0 for padding
    group_valid: torch.Tensor  # bool [B, S // R] groups of this shard's tokens: R real tokens of one doc
    group_doc_ids: torch.Tensor  # int64 [B, S // R] the group's doc id, 0 if invalid
    compress_ratio: int
    cp_rank: int
    cp_size: int
    seq_len: int  # local S
    batch_size: int
    first_group: int  # global index of group_valid[:, 0] (= cp_rank * S // R)
    num_groups: int  # K = floor(S * cp_size / R) on the global compressed axis
    key_ranges: KeyRanges  # (ks, ke) as the ops take them: made by the rule, so never checked again

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def allowed(self, num_keys: int | None = None) -> torch.Tensor:
        """Dense visibility ``bool [B, S, num_keys]`` (``ks <= j < ke``); tests and the V4.1 seed API only.

        ``num_keys`` defaults to ``num_groups``; it may be larger (extra columns are never visible)
        but not smaller, which would silently drop visible keys.
        """
        if num_keys is None:
            num_keys = self.num_groups
        check_positive_int("num_keys", num_keys, minimum=0)
        if num_keys < self.num_groups:
            raise ValueError(
                f"num_keys must be >= num_groups = {self.num_groups} (floor(seq_len * cp_size / "
                f"compress_ratio)), got {num_keys}"
            )
        return visible_mask(self.ks, self.ke, num_keys)


def _same_device(asked: torch.device, actual: torch.device) -> bool:
    return asked.type == actual.type and asked.index in (None, actual.index)


def build_attention_metadata(
    *,
    compress_ratio: int,
    position_ids: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    seq_lens_padded: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    packed_seq_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    batch_size: int | None = None,
    seq_len: int | None = None,
    device: torch.device | str | None = None,
    max_position_embeddings: int | None = None,
) -> AttentionMetadata:
    """Build the visibility metadata of the local shard (see the module docstring for conventions).

    Args:
        compress_ratio: R, tokens per compression group (int >= 1).
        position_ids: ``[B, S]`` or ``[1, S]``; document-local for packs, global (``r*S + i``)
            for unpacked rows. A document's start is ``p - position_ids``.
        seq_lens: ``[B, ndocs]`` document lengths over the GLOBAL row; non-positive = absent.
        seq_lens_padded: same shape; physical span of each document (its tail is padding).
        cu_seqlens: ``[ndocs+1]`` (B = 1) or ``[B, ndocs+1]`` cumulative lengths over the global row.
        packed_seq_ids: ``[B, S]`` 1-based document id, 0 = padding; each id one contiguous run.
            Under CP it needs position_ids, seq_lens or cu_seqlens to place documents.
        attention_mask: ``[B, S]`` 1 = token, 0 = padding. Alone it describes an unpacked row,
            which may only be right-padded.
        cp_rank, cp_size: contiguous context-parallel sharding; requires ``S % R == 0`` when
            ``cp_size > 1``.
        batch_size, seq_len: the local shape, when no tensor fixes it (or as a check).
        device: where the metadata lives when no layout tensor is given (default CPU); with
            layout tensors it must be theirs.
        max_position_embeddings: when given, every real token's position inside its document
            (``local_positions``, what RoPE sees) must be below it; a longer document is a
            ValueError naming it.

    The layout tensors' values are checked with one device-to-host read in all (only the
    shape-only form, global lengths without any ``[B, S]`` tensor or ``seq_len``, reads the
    first row's total once more); :func:`build_attention_metadata_for_ratios` shares that read
    among several ratios.

    Returns:
        AttentionMetadata of the local shard.

    Raises:
        TypeError / ValueError naming the offending argument for every malformed or inconsistent
        input.
    """
    ratio = check_positive_int("compress_ratio", compress_ratio, maximum=INT32_MAX)
    return build_attention_metadata_for_ratios(
        compress_ratios=(ratio,), position_ids=position_ids, seq_lens=seq_lens, seq_lens_padded=seq_lens_padded,
        cu_seqlens=cu_seqlens, packed_seq_ids=packed_seq_ids, attention_mask=attention_mask, cp_rank=cp_rank,
        cp_size=cp_size, batch_size=batch_size, seq_len=seq_len, device=device,
        max_position_embeddings=max_position_embeddings,
    )[ratio]  # fmt: skip


def build_attention_metadata_for_ratios(
    *, compress_ratios, max_position_embeddings: int | None = None, extra_checks=(), **layout
) -> dict[int, AttentionMetadata]:
    """:func:`build_attention_metadata` for every distinct ratio of ``compress_ratios`` at once.

    The layout (the other keywords, as :func:`build_attention_metadata` takes them) is checked
    and resolved once: one host read per model forward, whatever the number of ratios and layers.
    ``extra_checks``: the caller's own input checks, ``(bad, raise_error)`` pairs (``bad`` a bool
    tensor that must be all False, ``raise_error()`` raising the caller's error), read in the
    same host read and reported first. Returns ``{ratio: AttentionMetadata}``.
    """
    if isinstance(compress_ratios, (int, torch.Tensor)) or not hasattr(compress_ratios, "__iter__"):
        raise TypeError(f"compress_ratios must be a sequence of ints >= 1, got {type(compress_ratios).__name__}")
    ratios = sorted({check_positive_int("compress_ratio", r, maximum=INT32_MAX) for r in compress_ratios})
    if not ratios:
        raise ValueError("compress_ratios must name at least one compression ratio")
    if max_position_embeddings is not None:
        check_positive_int("max_position_embeddings", max_position_embeddings)
    deferred = _Checks(eager=False)
    for bad, _ in extra_checks:
        deferred.failed(bad)
    resolved = _resolve_layout(ratios, max_position_embeddings, deferred, **layout)
    failed = deferred.read()  # the one host read
    if any(failed):
        for (_, raise_error), flag in zip(extra_checks, failed):
            if flag:
                raise_error()
        _resolve_layout(ratios, max_position_embeddings, _Checks(eager=True), **layout)  # names the first failure
        raise AssertionError("a deferred check failed that no eager check found")  # pragma: no cover
    return {ratio: _metadata_for_ratio(resolved, ratio) for ratio in ratios}


class _Checks:
    """The layout's value checks: deferred (each adds a flag; one host read for all, at the end)
    or eager (each reads its flag at once, so the first failing check raises its own message)."""

    def __init__(self, eager: bool) -> None:
        self.eager = eager
        self.flags: list[torch.Tensor] = []

    def failed(self, bad: torch.Tensor) -> bool:
        """Eager: whether any element of ``bad`` is set. Deferred: remembered, False for now."""
        if self.eager:
            return bool(bad.any())
        self.flags.append(bad.any())
        return False

    def read(self) -> list[bool]:
        """The deferred flags, in order, with one host read."""
        return torch.stack(self.flags).tolist() if self.flags else []


@dataclass(frozen=True)
class _Layout:
    """The shard's tokens, resolved from the inputs: what every ratio's metadata derives from."""

    pos: torch.Tensor  # int64 [B, S] global positions
    valid: torch.Tensor  # bool [B, S] real tokens
    start: torch.Tensor  # int64 [B, S] global start of each token's document (meaningless on padding)
    cp_rank: int
    cp_size: int
    batch_size: int
    seq_len: int


def _resolve_layout(
    ratios, max_position_embeddings, checks: _Checks, *, position_ids=None, seq_lens=None, seq_lens_padded=None,
    cu_seqlens=None, packed_seq_ids=None, attention_mask=None, cp_rank=0, cp_size=1, batch_size=None, seq_len=None,
    device=None,
) -> _Layout:  # fmt: skip
    cp_size = check_positive_int("cp_size", cp_size, maximum=INT32_MAX)
    cp_rank = check_positive_int("cp_rank", cp_rank, minimum=0, maximum=INT32_MAX)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size) = [0, {cp_size}), got {cp_rank}")

    tensors = _check_input_tensors(position_ids, seq_lens, seq_lens_padded, cu_seqlens, packed_seq_ids, attention_mask)
    given = next((t.device for t in tensors.values()), None)
    device = None if device is None else check_device("device", device)
    if device is not None and given is not None and not _same_device(device, given):
        raise ValueError(f"device: the layout tensors are on {given}, but device={device} was asked for")
    device = given if given is not None else torch.device(device if device is not None else "cpu")
    if seq_lens is not None and seq_lens.ndim == 1:
        seq_lens = seq_lens.unsqueeze(0)
        seq_lens_padded = None if seq_lens_padded is None else seq_lens_padded.unsqueeze(0)
    cu_one_row = cu_seqlens is not None and cu_seqlens.ndim == 1
    if cu_one_row:
        cu_seqlens = cu_seqlens.unsqueeze(0)

    B, S, length_name = _resolve_shape(
        position_ids, seq_lens, seq_lens_padded, cu_seqlens, packed_seq_ids, attention_mask,
        cp_size, batch_size, seq_len, cu_one_row,
    )  # fmt: skip
    G = S * cp_size
    if G > INT32_MAX:  # ks/ke are int32 on the global axis: a larger row would wrap them
        raise ValueError(
            f"{length_name}: the global row (local length {S} x cp_size {cp_size} = {G} tokens) must be at most "
            f"{INT32_MAX} tokens (int32 positions)"
        )
    for ratio in ratios:
        if cp_size > 1 and S % ratio != 0:
            raise ValueError(
                f"{length_name}: under context parallelism the local length must be a multiple of "
                f"compress_ratio so compression groups do not straddle ranks, got local length {S}, "
                f"compress_ratio={ratio}"
            )
    pos = (cp_rank * S + torch.arange(S, device=device, dtype=torch.int64)).expand(B, S)

    # --- global layouts from lengths (seq_lens, cu_seqlens): exact split and starts -------------
    layout_name, layout_valid, layout_start = None, None, None
    for name, lengths, spans in (
        ("seq_lens", seq_lens, seq_lens_padded),
        ("cu_seqlens", None if cu_seqlens is None else _cu_to_lengths(cu_seqlens, G, checks), None),
    ):
        if lengths is None:
            continue
        valid_l, start_l = _layout_from_lengths(name, lengths, spans, pos, G, checks)
        if layout_name is None:
            layout_name, layout_valid, layout_start = name, valid_l, start_l
        else:
            _require_equal(checks, name, layout_name, "token/padding split", valid_l, layout_valid)
            _require_equal(checks, name, layout_name, "document start", start_l, layout_start, where=valid_l)

    # --- token/padding split: the first informative source wins, the others must agree --------
    valid_sources = []
    if layout_name is not None:
        valid_sources.append((layout_name, layout_valid))
    if packed_seq_ids is not None:
        if checks.failed(packed_seq_ids < 0):
            b, i = _first(packed_seq_ids < 0)
            value = int(packed_seq_ids[b, i])
            raise ValueError(f"packed_seq_ids must be >= 0 (0 = padding), row {b} token {i} is {value}")
        valid_sources.append(("packed_seq_ids", packed_seq_ids > 0))
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool and checks.failed((attention_mask != 0) & (attention_mask != 1)):
            b, i = _first((attention_mask != 0) & (attention_mask != 1))
            value = int(attention_mask[b, i])
            raise ValueError(f"attention_mask must contain only 0 and 1, row {b} token {i} is {value}")
        valid_sources.append(("attention_mask", attention_mask.bool()))
    if valid_sources:
        valid_name, valid = valid_sources[0]
        for name, other in valid_sources[1:]:
            _require_equal(checks, name, valid_name, "token/padding split", other, valid)
    else:
        valid_name, valid = None, torch.ones(B, S, dtype=torch.bool, device=device)

    # --- document starts -------------------------------------------------------------------------
    if position_ids is not None:
        position_ids = position_ids.to(torch.int64).expand(B, S)
        bad = valid & (position_ids < 0)
        if checks.failed(bad):
            b, i = _first(bad)
            value = int(position_ids[b, i])
            raise ValueError(f"position_ids must be >= 0 on real tokens, row {b} token {i} is {value}")
        bad = valid & (position_ids > pos)
        if checks.failed(bad):
            b, i = _first(bad)
            raise ValueError(
                f"position_ids: row {b} token {i} has position_id {int(position_ids[b, i])} but global position "
                f"{int(pos[b, i])} (cp_rank={cp_rank}, seq_len={S}); its document would start before the row"
            )
        pid_start = pos - position_ids
    if layout_name is not None:
        start_name, start = layout_name, layout_start
        if position_ids is not None:
            _require_equal(checks, "position_ids", layout_name, "document start (global position - position_id)",
                           pid_start, start, where=valid)  # fmt: skip
    elif position_ids is not None:
        start_name, start = "position_ids", pid_start
    elif packed_seq_ids is not None:
        if cp_size > 1:
            raise ValueError(
                "packed_seq_ids: under context parallelism (cp_size > 1) a shard cannot tell where a document "
                "that began on an earlier rank starts; pass position_ids (or seq_lens / cu_seqlens) with it"
            )
        start_name, start = "packed_seq_ids", _run_starts(packed_seq_ids, pos)
    else:
        # Unpacked rows: one document starting at global position 0.
        start_name, start = None, torch.zeros(B, S, dtype=torch.int64, device=device)

    if packed_seq_ids is not None:
        _check_packed_runs(checks, packed_seq_ids, valid, start, start_name)
    _check_documents_contiguous(checks, valid, start, pos, valid_name, start_name, position_ids)

    if max_position_embeddings is not None:
        local_positions = torch.where(valid, pos - start, 0)
        if checks.failed(local_positions >= max_position_embeddings):
            longest = int(local_positions.max())
            b, i = _first(local_positions == longest)
            raise ValueError(
                f"max_position_embeddings is {max_position_embeddings}, but row {b} token {i} is at position {longest} "
                f"of its document (according to {start_name or 'the unpacked layout'})"
            )
    return _Layout(pos=pos, valid=valid, start=start, cp_rank=cp_rank, cp_size=cp_size, batch_size=B, seq_len=S)


def _metadata_for_ratio(layout: _Layout, ratio: int) -> AttentionMetadata:
    """One ratio's metadata from the resolved (and checked) layout: no host reads."""
    pos, valid, start, B, S = layout.pos, layout.valid, layout.start, layout.batch_size, layout.seq_len
    G = S * layout.cp_size
    doc_ids = torch.where(valid, start + 1, 0)
    local_positions = torch.where(valid, pos - start, 0)
    doc_ks, doc_ke = document_ks_ke(start, pos, ratio, G // ratio)
    ks = torch.where(valid, doc_ks, 0).to(torch.int32)
    ke = torch.where(valid, doc_ke, 0).to(torch.int32)

    n_local = S // ratio
    token_docs = doc_ids[:, : n_local * ratio].reshape(B, n_local, ratio)
    group_valid = (token_docs[..., 0] > 0) & (token_docs == token_docs[..., :1]).all(-1)
    group_doc_ids = torch.where(group_valid, token_docs[..., 0], 0)

    return AttentionMetadata(
        positions=pos.contiguous(),
        doc_ids=doc_ids,
        local_positions=local_positions,
        token_valid=valid.clone(),
        ks=ks,
        ke=ke,
        group_valid=group_valid,
        group_doc_ids=group_doc_ids,
        compress_ratio=ratio,
        cp_rank=layout.cp_rank,
        cp_size=layout.cp_size,
        seq_len=S,
        batch_size=B,
        first_group=layout.cp_rank * n_local,
        num_groups=G // ratio,
        key_ranges=KeyRanges(ks, ke, G // ratio),  # 0 <= ks <= ke <= K by the rule: ops check nothing
    )


# ------------------------------------------------------------------------------------------------
# input checks and shape
# ------------------------------------------------------------------------------------------------


def _check_input_tensors(position_ids, seq_lens, seq_lens_padded, cu_seqlens, packed_seq_ids, attention_mask):
    given = {
        name: value
        for name, value in (
            ("position_ids", position_ids),
            ("seq_lens", seq_lens),
            ("seq_lens_padded", seq_lens_padded),
            ("cu_seqlens", cu_seqlens),
            ("packed_seq_ids", packed_seq_ids),
            ("attention_mask", attention_mask),
        )
        if value is not None
    }
    device = None
    for name, value in given.items():
        dtypes = _MASK_DTYPES if name == "attention_mask" else _INT_DTYPES
        check_tensor(name, value, dtypes=dtypes, device=device)
        check_has_data(name, value)
        device = value.device
        allowed_ndim = (1, 2) if name in ("seq_lens", "seq_lens_padded", "cu_seqlens") else (2,)
        if value.ndim not in allowed_ndim:
            want = " or ".join(str(n) for n in allowed_ndim)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(value.shape)}")
    if cu_seqlens is not None and cu_seqlens.shape[-1] < 2:
        raise ValueError(
            f"cu_seqlens needs at least 2 entries per row ([0, ..., total]), got shape {list(cu_seqlens.shape)}"
        )
    if seq_lens_padded is not None:
        if seq_lens is None:
            raise ValueError("seq_lens_padded needs seq_lens (the real length inside each padded span)")
        if seq_lens_padded.shape != seq_lens.shape:
            raise ValueError(
                f"seq_lens_padded must have the shape of seq_lens {list(seq_lens.shape)}, "
                f"got {list(seq_lens_padded.shape)}"
            )
    return given


def _resolve_shape(position_ids, seq_lens, seq_lens_padded, cu_seqlens, packed_seq_ids, attention_mask,
                   cp_size, batch_size, seq_len, cu_one_row) -> tuple[int, int]:  # fmt: skip
    """Agree on (B, S) across every input; the first source fixes a value, the rest must match."""
    batch: list[tuple[str, int]] = []
    length: list[tuple[str, int]] = []
    if batch_size is not None:
        batch.append(("batch_size", check_positive_int("batch_size", batch_size, maximum=INT32_MAX)))
    if seq_len is not None:
        length.append(("seq_len", check_positive_int("seq_len", seq_len, maximum=INT32_MAX)))
    token_tensors = (("packed_seq_ids", packed_seq_ids), ("attention_mask", attention_mask), ("position_ids", position_ids))
    for name, value in token_tensors:
        if value is not None:
            length.append((name, value.shape[1]))
            if name != "position_ids" or value.shape[0] != 1:  # [1, S] position_ids broadcast
                batch.append((name, value.shape[0]))
    if seq_lens is not None:
        batch.append(("seq_lens", seq_lens.shape[0]))
    if cu_seqlens is not None and not cu_one_row:
        batch.append(("cu_seqlens", cu_seqlens.shape[0]))
    if not batch and (position_ids is not None or cu_one_row):
        batch.append(("position_ids" if position_ids is not None else "cu_seqlens", 1))

    if not length:  # only global lengths: S = G / cp_size from the first row
        for name, lengths in (("seq_lens_padded", seq_lens_padded), ("seq_lens", seq_lens), ("cu_seqlens", cu_seqlens)):
            if lengths is None or lengths.shape[-1] == 0:
                continue
            if lengths.shape[0] == 0:
                raise ValueError(
                    f"{name} has no rows (shape {list(lengths.shape)}), so the local length cannot be derived; "
                    "pass at least one row, or seq_len"
                )
            if name == "cu_seqlens":
                total = int(lengths[0, -1])
            else:
                total = int(lengths[0].clamp_min(0).sum())
            if total <= 0 or total % cp_size != 0:
                raise ValueError(
                    f"{name}: row 0 covers {total} tokens, which is not a positive multiple of cp_size={cp_size}; "
                    "pass seq_len to fix the local length"
                )
            length.append((name, total // cp_size))
            break
    if not batch or not length:
        raise ValueError(
            "build_attention_metadata needs the shard's shape: pass position_ids, packed_seq_ids or "
            "attention_mask [B, S], seq_lens / cu_seqlens, or batch_size and seq_len"
        )
    for what, found in (("batch size", batch), ("sequence length", length)):
        ref_name, ref = found[0]
        for name, value in found[1:]:
            if value != ref:
                raise ValueError(f"{name}: {what} {value} does not match {ref_name}'s {what} {ref}")
    B, S = batch[0][1], length[0][1]
    if S < 1:
        raise ValueError(f"{length[0][0]}: the local sequence length must be >= 1, got {S}")
    if cu_one_row and B != 1:
        raise ValueError(f"cu_seqlens: a 1-D cu_seqlens describes a single row; pass [B, ndocs+1] for batch size {B}")
    return B, S, length[0][0]


# ------------------------------------------------------------------------------------------------
# sources of document starts
# ------------------------------------------------------------------------------------------------


def _cu_to_lengths(cu_seqlens: torch.Tensor, G: int, checks: _Checks) -> torch.Tensor:
    cu = cu_seqlens.to(torch.int64)
    if checks.failed(cu[:, 0] != 0):
        b = int((cu[:, 0] != 0).nonzero()[0])
        raise ValueError(f"cu_seqlens: row {b} starts at {int(cu[b, 0])}, expected 0")
    # Checked before the differences: values past int64's range would wrap them to plausible lengths.
    outside = (cu < 0) | (cu > G)
    if checks.failed(outside):
        b, k = _first(outside)
        raise ValueError(f"cu_seqlens: entry {k} of row {b} is {int(cu[b, k])}, outside [0, {G}] (= seq_len * cp_size)")
    lengths = cu.diff(dim=1)
    if checks.failed(lengths < 0):
        b, k = _first(lengths < 0)
        raise ValueError(
            f"cu_seqlens must be non-decreasing, row {b} drops from {int(cu[b, k])} to {int(cu[b, k + 1])}"
        )
    if checks.failed(cu[:, -1] != G):
        b = int((cu[:, -1] != G).nonzero()[0])
        raise ValueError(f"cu_seqlens: row {b} ends at {int(cu[b, -1])}, expected {G} (= seq_len * cp_size)")
    return lengths


def _layout_from_lengths(name, lengths, spans, pos, G, checks: _Checks):
    """(valid, start) of every local token from per-document lengths over the global row."""
    real = lengths.to(torch.int64).clamp_min(0)
    span_name = name
    if spans is None:
        spans = real
    else:
        span_name = "seq_lens_padded"
        spans = spans.to(torch.int64).clamp_min(0)
        if checks.failed(real > spans):
            b, k = _first(real > spans)
            raise ValueError(
                f"seq_lens_padded: entry {k} of row {b} is {int(spans[b, k])}, shorter than seq_lens' {int(real[b, k])}"
            )
    if spans.shape[1] == 0:
        raise ValueError(f"{span_name} has no entries; the documents must cover {G} (= seq_len * cp_size) tokens")
    ends = spans.cumsum(dim=1)
    if checks.failed(ends[:, -1] != G):
        b = int((ends[:, -1] != G).nonzero()[0])
        raise ValueError(
            f"{span_name}: lengths of row {b} sum to {int(ends[b, -1])}, expected {G} (= seq_len * cp_size)"
        )
    # Entries near 2**63 can wrap the int64 sum to exactly G (documents at negative positions):
    # no entry may be longer than the row.
    if checks.failed(spans > G):
        b, k = _first(spans > G)
        raise ValueError(
            f"{span_name}: entry {k} of row {b} is {int(spans[b, k])}, longer than the row's {G} tokens "
            "(= seq_len * cp_size)"
        )
    # Document k spans [ends[k-1], ends[k]); zero-length entries are skipped by right-searchsorted.
    doc = torch.searchsorted(ends.contiguous(), pos.contiguous(), right=True)
    # Only rows failing the sum check above reach past the last entry: clamped, so that their
    # (deferred) failure is reported instead of an out-of-bounds gather.
    doc = doc.clamp_max(spans.shape[1] - 1)
    start = (ends - spans).gather(1, doc)
    valid = (pos - start) < real.gather(1, doc)
    return valid, start


def _run_starts(packed_seq_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Start (global position) of the run of equal ids each token belongs to."""
    ids = packed_seq_ids
    new_run = torch.ones_like(ids, dtype=torch.bool)
    new_run[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return torch.where(new_run, pos, 0).cummax(dim=1).values


# ------------------------------------------------------------------------------------------------
# consistency checks
# ------------------------------------------------------------------------------------------------


def _first(mask: torch.Tensor) -> tuple[int, int]:
    b, i = mask.nonzero()[0].tolist()
    return b, i


def _require_equal(checks: _Checks, name, ref_name, what, value, ref, where=None):
    bad = value != ref
    if where is not None:
        bad &= where
    if checks.failed(bad):
        b, i = _first(bad)
        raise ValueError(
            f"{name}: {what} disagrees with {ref_name} at row {b} token {i} ({int(value[b, i])} vs {int(ref[b, i])})"
        )


def _check_packed_runs(checks: _Checks, packed_seq_ids, valid, start, start_name):
    """Each id is one contiguous run per row, and runs are exactly the documents."""
    ids = packed_seq_ids.to(torch.int64)
    if not checks.eager:  # the same rule without data-dependent shapes, given valid == (ids > 0)
        checks.failed(_ids_in_several_runs(ids, valid))
    else:
        _name_id_in_several_runs(ids, valid)
    if start_name in (None, "packed_seq_ids"):
        return
    both = valid[:, 1:] & valid[:, :-1]
    same_id = ids[:, 1:] == ids[:, :-1]
    same_doc = start[:, 1:] == start[:, :-1]
    bad = both & (same_id != same_doc)
    if checks.failed(bad):
        b, i = _first(bad)
        i += 1
        if bool(same_id[b, i - 1]):
            relation = "the same id but different documents"
        else:
            relation = "different ids but one document"
        raise ValueError(
            f"packed_seq_ids: tokens {i - 1} and {i} of row {b} have {relation} according to {start_name}"
        )


def _ids_in_several_runs(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """bool [B, S - 1]: somewhere an id's real tokens are not one contiguous run (fixed shapes).

    A stable sort lists each id's tokens in position order; they form one run iff consecutive
    ones are adjacent positions. Padding sorts apart (-1)."""
    key = torch.where(valid, ids, -1)
    sorted_ids, order = torch.sort(key, dim=1, stable=True)
    same_id = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)
    return same_id & (order[:, 1:] - order[:, :-1] != 1)


def _name_id_in_several_runs(ids: torch.Tensor, valid: torch.Tensor) -> None:
    """Raise naming the first id of a row that appears again after a gap (host reads: errors only)."""
    run_start = valid.clone()
    run_start[:, 1:] &= ids[:, 1:] != ids[:, :-1]
    rows, cols = run_start.nonzero(as_tuple=True)
    pairs = torch.stack([rows, ids[rows, cols]], dim=1)
    _, inverse, counts = torch.unique(pairs, dim=0, return_inverse=True, return_counts=True)
    repeated = counts[inverse] > 1
    if repeated.any():
        k = int(repeated.nonzero()[-1])  # the second run of that id
        b, i = int(rows[k]), int(cols[k])
        raise ValueError(
            f"packed_seq_ids: id {int(ids[b, i])} of row {b} appears again at token {i} after a gap; "
            "each document must be one contiguous run"
        )


def _check_documents_contiguous(checks: _Checks, valid, start, pos, valid_name, start_name, position_ids):
    """A real token that is not its document's first must follow a real token of the same document."""
    continues = valid[:, 1:] & (start[:, 1:] < pos[:, 1:])
    prev_padding = continues & ~valid[:, :-1]
    if checks.failed(prev_padding):
        b, i = _first(prev_padding)
        i += 1
        if start_name is None:
            raise ValueError(
                f"attention_mask: row {b} has padding before real token {i}; an unpacked row may only be "
                "right-padded (describe packed rows with position_ids, packed_seq_ids or seq_lens)"
            )
        raise ValueError(
            f"{valid_name}: token {i - 1} of row {b} is padding but {start_name} puts token {i} inside a "
            f"document that started at global position {int(start[b, i])}; padding may not split a document"
        )
    prev_other = continues & valid[:, :-1] & (start[:, :-1] != start[:, 1:])
    if checks.failed(prev_other):  # only position_ids can describe this
        b, i = _first(prev_other)
        i += 1
        raise ValueError(
            f"position_ids: row {b} jumps from {int(position_ids[b, i - 1])} at token {i - 1} to "
            f"{int(position_ids[b, i])} at token {i}; within a document they increase by 1 and a new "
            "document restarts at 0"
        )
