"""Exact row selection with the documented tie rule: the building blocks of every torch top-k path.

docs/semantics.md "Top-k selection": keep the best T = min(topk, K) *finite* scores, ties going to the
smaller key index, -1 padding when a query has fewer than T finite scores. torch.topk leaves ties
unspecified, so selection runs on a unique key per score

    key = (order-preserving integer image of the score) << b  |  (2^b - 1 - index)

(b = 32 for fp32, int64 keys; b = 16 for bf16 rows of at most 65536 keys, int32 keys) whose
descending order is "score descending, then index ascending": ordering by unique keys is exact and
deterministic on every device. Keys for every score would cost 4-8 bytes each, so ``select_rows``
first takes T + TIE_MARGIN candidates per row with one torch.topk (a radix select) and keys only
those; the rare rows the candidates cannot decide (a longer run of ties at the cut, NaN/+inf)
are redone with a key per score, chunked over queries within the byte budget.
"""

from __future__ import annotations

import torch

from nemo_dsa.ops.chunking import DEFAULT_BUDGET_BYTES, query_chunk_size, query_chunks

SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ORDERS = ("score", "index")
_INT32_MIN = -(2**31)
_INT16_MIN = -(2**15)
# bf16 keys fit int32 while the 16 index bits can number the row.
MAX_INT32_KEY_WIDTH = 2**16
# Candidates taken past the T-th best score: a row whose T-th score has more copies than this
# beyond the cut is redone with full-row keys (select_rows).
TIE_MARGIN = 64


def orderable_image(scores: torch.Tensor) -> torch.Tensor:
    """Integer image of fp32 (int32) or bf16/fp16 (int16) scores whose integer order is the float order.

    IEEE floats order like sign-magnitude integers: flipping the magnitude bits of negative
    values turns that into two's-complement order. -0.0 lands on -1 (the only bit pattern that
    does) and is folded onto +0.0's 0 so the two zeros tie as equal scores do; non-finite
    scores get the type's minimum, which no finite score reaches, so they are never preferred.
    fp16 is first widened to fp32 (exact), since its exponent field differs from bf16's.
    """
    if scores.dtype == torch.float16:
        scores = scores.float()
    int_dtype, sign_shift, magnitude, minimum = (
        (torch.int32, 31, 0x7FFFFFFF, _INT32_MIN) if scores.dtype == torch.float32 else (torch.int16, 15, 0x7FFF, _INT16_MIN)
    )
    bits = scores.view(int_dtype)
    image = bits >> sign_shift  # -1 for negative scores, 0 otherwise
    image &= magnitude
    image ^= bits
    image.masked_fill_(image == -1, 0)
    image.masked_fill_(~torch.isfinite(scores), minimum)
    return image


def orderable_int32(scores: torch.Tensor) -> torch.Tensor:
    """:func:`orderable_image` of the scores widened to fp32 (exact), as an int64 tensor."""
    return orderable_image(scores.float()).to(torch.int64)


def selection_keys(values: torch.Tensor, index: torch.Tensor | None = None, num_keys: int | None = None) -> torch.Tensor:
    """Unique keys of scores ``values [N, m]`` at key indices ``index`` (default: a whole row, the
    column numbers) in rows of ``num_keys`` keys (default m).

    Descending key = descending score, then ascending index; non-finite scores lowest. int32
    (bf16 image << 16 | 65535 - index) when the scores are bf16 and a row has at most 65536 keys,
    int64 (fp32 image << 32 | 2^32 - 1 - index) otherwise. Built in place: the peak is the key
    tensor plus the image.
    """
    if index is None:
        index = torch.arange(values.shape[-1], device=values.device)  # broadcast, no [N, m] copy
    num_keys = values.shape[-1] if num_keys is None else num_keys
    if values.dtype == torch.bfloat16 and num_keys <= MAX_INT32_KEY_WIDTH:
        key = orderable_image(values).to(torch.int32)
        key *= 1 << 16  # no overflow (the image has 16 bits); avoids shifting negative values
        return key.bitwise_or_((MAX_INT32_KEY_WIDTH - 1) - index.to(torch.int32))
    key = orderable_int32(values)
    key *= 1 << 32
    return key.bitwise_or_((2**32 - 1) - index.long())


def select_rows(scores: torch.Tensor, count: int, order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``count`` of every row of ``scores [N, W]`` (count <= W) without a host sync.

    Returns (chosen int64 ``[N, count]``, -1 padded; redo bool ``[N]``): rows flagged ``redo``
    are not decided here and must be recomputed with :func:`select_rows_exact`; on real scores
    there are almost none.

    One torch.topk (a radix select) takes the best count + TIE_MARGIN scores, unordered; unique
    keys (score, then index) over those few candidates order them exactly, ties to the smaller
    index. That is exact whenever every copy of the T-th best score is among the candidates:
    a row is flagged when the worst candidate still equals the T-th best (a run of more than
    TIE_MARGIN ties at the cut), or when it holds NaN/+inf (they sort above every number, are
    not selectable, and would take candidate slots).
    """
    num_keys = scores.shape[-1]
    width = min(count + TIE_MARGIN, num_keys)
    values, index = torch.topk(scores, width, dim=-1, largest=True, sorted=False)
    redo = (torch.isnan(values) | (values == float("inf"))).any(-1)
    rank = selection_keys(values, index, num_keys).sort(dim=-1, descending=True).indices[:, :count]
    chosen = torch.gather(index, -1, rank)
    picked = torch.gather(values, -1, rank)
    cut = picked[:, -1]
    redo |= torch.isfinite(cut) & (values.amin(-1) == cut) & (width < num_keys)
    finite = torch.isfinite(picked)  # non-finite candidates sort last: -1 padding at the end
    if order == "index":
        past_end = torch.iinfo(torch.int64).max
        chosen = torch.where(finite, chosen, past_end).sort(dim=-1).values
        return torch.where(chosen == past_end, -1, chosen), redo
    return torch.where(finite, chosen, -1), redo


def select_rows_exact(
    scores: torch.Tensor, count: int, order: str, *, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> torch.Tensor:
    """:func:`select_rows` with its flagged rows redone right away (one host sync), int64."""
    chosen, redo = select_rows(scores, count, order)
    redo_rows(scores, chosen, redo, count, order, budget_bytes)
    return chosen


def redo_rows(scores, chosen, redo, count: int, order: str, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
    """Recompute in place the rows of ``chosen`` flagged in ``redo`` with unique keys per score."""
    if not bool(redo.any()):
        return
    rows = redo.nonzero().squeeze(1)
    # The key path holds a score copy, its integer image and the keys: ~16 bytes per score.
    group = query_chunk_size(rows.numel(), 16 * scores.shape[-1], budget_bytes)
    for part in query_chunks(rows.numel(), group):
        picked = rows[part]
        chosen[picked] = select_rows_by_keys(scores[picked], count, order).to(chosen.dtype)


def select_rows_by_keys(scores: torch.Tensor, count: int, order: str) -> torch.Tensor:
    """Exact selection through unique keys (score image, then reversed index), int64 indices."""
    num_keys = scores.shape[-1]
    chosen = torch.topk(selection_keys(scores), count, dim=-1, largest=True, sorted=True).indices
    finite = torch.isfinite(torch.gather(scores, -1, chosen))
    chosen = torch.where(finite, chosen, -1)  # non-finite keys sort last, so -1s trail
    if order == "index":
        # Ascending index among the selected; -1 (mapped to num_keys) stays at the end.
        chosen = torch.where(finite, chosen, num_keys).sort(dim=-1).values
        chosen = torch.where(chosen == num_keys, -1, chosen)
    return chosen
