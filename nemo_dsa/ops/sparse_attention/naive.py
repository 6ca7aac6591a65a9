"""Readable sparse multi-query attention: every query attends to its own list of keys.

One shared KV head (MQA): ``kv`` is both key and value, as in DeepSeek-V4. Each query gathers
the keys named by its row of ``indices`` (-1 = no key), so work and memory are
O(S * M * D) instead of O(S * N). A learned per-head ``sink`` logit joins the softmax
denominator only (it has no value), so a query that sees nothing returns zeros, never NaN.

:func:`sparse_attention` and :func:`window_compressed_attention_reference` validate their
arguments (the index range with one host read); :func:`attend_to_indices` and
:func:`attend_window_and_compressed` are the same computations on inputs their callers made or
validated, and check nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_dsa._checks import check_finite_float, check_has_data, check_index_range, check_positive_int, check_tensor
from nemo_dsa.ops.chunking import DEFAULT_BUDGET_BYTES

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# Peak bytes for one query chunk's gathered keys and logits (fp32).
_CHUNK_BYTES = DEFAULT_BUDGET_BYTES


def _query_chunk(batch: int, width: int, heads: int, dim: int, chunk_size: int | None) -> int:
    if chunk_size is not None:
        return max(1, chunk_size)
    per_query = max(1, batch * width * (dim + heads) * 4)
    return max(1, _CHUNK_BYTES // per_query)


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    recompute: bool = True,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend each query to the keys at its indices.

    Args:
        q: ``[B, S, H, D]`` queries.
        kv: ``[B, N, D]`` the single shared key/value head.
        indices: integer ``[B, S, M]`` positions into ``kv``'s N axis; -1 = no key.
        sink: ``[H]`` per-head sink logits added to the softmax denominator, or None.
        scale: softmax scale applied to ``q . k``.
        bias: optional fp32 ``[B, S, M]`` added to the logits of every head (ignored at -1).
        chunk_size: queries per chunk (default: from a 256 MiB budget).
        recompute: under autograd, rebuild each chunk's gathered keys in backward instead of
            keeping them (activation checkpointing per chunk).
        dropout_p: dropout on the probabilities (each key's, after the softmax whose denominator
            holds the sink), scaled by ``1 / (1 - p)``; the recomputed backward replays the mask.

    Returns:
        ``out [B, S, H, D]`` in q's dtype and the fp32 log-sum-exp ``[B, S, H]`` of the softmax
        denominator (sink included; -inf for a query with neither keys nor sink).
    """
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    batch, seq, heads, dim = q.shape
    check_tensor("kv", kv, ndim=3, dtypes=FLOAT_DTYPES, shape=(batch, None, dim), device=q.device)
    check_tensor("indices", indices, ndim=3, shape=(batch, seq, None), device=q.device,
                 dtypes=(torch.int32, torch.int64))
    scale = check_finite_float("scale", scale)
    width, num_keys = indices.shape[-1], kv.shape[1]
    check_has_data("q", q)
    check_index_range("indices", indices, num_keys, meaning=f"-1 = no key; kv has {num_keys} keys")
    if sink is not None:
        check_tensor("sink", sink, ndim=1, dtypes=FLOAT_DTYPES, shape=(heads,), device=q.device)
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, shape=(batch, seq, width), device=q.device)
    if chunk_size is not None:
        check_positive_int("chunk_size", chunk_size)
    dropout_p = check_dropout_p(dropout_p)
    return attend_to_indices(q, kv, indices, sink, scale, bias=bias, chunk_size=chunk_size, recompute=recompute,
                             dropout_p=dropout_p)  # fmt: skip


def check_dropout_p(dropout_p) -> float:
    dropout_p = check_finite_float("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return dropout_p


def attend_to_indices(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sink: torch.Tensor | None,
    scale: float,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    recompute: bool = True,
    dropout_p: float = 0.0,
    return_probabilities: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`sparse_attention` on arguments its caller made or validated (indices in [-1, N)):
    nothing is checked, so it reads nothing back.

    ``return_probabilities``: also return each slot's probability ``[B, S, H, M]`` (fp32, after
    the dropout the output used; 0 at -1 slots), the whole sequence as one chunk, without
    recomputation (the caller asked for the probabilities, so they are kept anyway)."""
    batch, seq, heads, dim = q.shape
    width, scale = indices.shape[-1], float(scale)
    if kv.shape[1] == 0:
        # Every index is -1 here; one zero row gives the gathers something to read (masked out).
        kv = torch.cat((kv, kv.new_zeros(batch, 1, dim)), dim=1)
    if return_probabilities:
        with torch.autocast(q.device.type, enabled=False):
            return _attend_chunk(q, kv, indices, sink, bias, scale, dropout_p, return_probabilities=True)

    # fp32 softmax math even under an enclosing autocast (it would run the einsums in bf16).
    step = _query_chunk(batch, width, heads, dim, chunk_size)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, kv, sink, bias)
    )
    outs, lses = [], []
    with torch.autocast(q.device.type, enabled=False):
        for start in range(0, seq, step):
            part = slice(start, min(seq, start + step))
            args = (q[:, part], kv, indices[:, part], sink, None if bias is None else bias[:, part], scale, dropout_p)
            if recompute and needs_grad:
                # Keep only the chunk's inputs for backward: the gathered keys are rebuilt there,
                # so activation memory is O(S * H * D) instead of O(S * M * D).
                from torch.utils.checkpoint import checkpoint

                out, lse = checkpoint(_attend_chunk, *args, use_reentrant=False)
            else:
                out, lse = _attend_chunk(*args)
            outs.append(out)
            lses.append(lse)
    if not outs:
        return q.new_zeros(q.shape), q.new_zeros((batch, seq, heads), dtype=torch.float32)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _attend_chunk(q, kv, indices, sink, bias, scale, dropout_p=0.0, return_probabilities=False):
    """One query chunk: ``q [B, C, H, D]``, ``indices [B, C, M]`` -> (out, lse), and with
    ``return_probabilities`` the slots' probabilities ``[B, C, H, M]``."""
    batch, chunk, heads, dim = q.shape
    width = indices.shape[-1]
    idx = indices.long()
    valid = idx >= 0
    keys = torch.gather(kv, 1, idx.clamp_min(0).flatten(1).unsqueeze(-1).expand(-1, -1, dim))
    # Select, never multiply by a zero probability: the row gathered for a -1 slot may hold
    # NaN or inf, and 0 * inf is NaN in the output and in every gradient.
    keys = torch.where(valid.flatten(1).unsqueeze(-1), keys, torch.zeros((), dtype=keys.dtype, device=keys.device))
    keys = keys.view(batch, chunk, width, dim).float()
    logits = torch.einsum("bchd,bcmd->bchm", q.float(), keys) * scale
    if bias is not None:
        logits = logits + bias.float().unsqueeze(2)
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    denominator_terms = logits
    if sink is not None:
        sink_logit = sink.float().view(1, 1, heads, 1).expand(batch, chunk, heads, 1)
        denominator_terms = torch.cat((logits, sink_logit), dim=-1)
    # A row with no key and no sink has an empty denominator: give logsumexp a dummy 0 there
    # (its gradient would be NaN on an all -inf row), report lse = -inf, and keep
    # exp(-inf - 0) = 0 so the output is zero.
    empty = torch.isneginf(denominator_terms).all(dim=-1, keepdim=True)
    safe_lse = torch.logsumexp(denominator_terms.masked_fill(empty, 0.0), dim=-1)
    safe_lse = safe_lse.masked_fill(empty.squeeze(-1), 0.0)
    lse = safe_lse.masked_fill(empty.squeeze(-1), float("-inf"))
    probs = torch.exp(logits - safe_lse.unsqueeze(-1))
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p, training=True)
    out = torch.einsum("bchm,bcmd->bchd", probs, keys).to(q.dtype)
    if return_probabilities:
        return out, lse, probs
    return out, lse


def window_key_indices(window_start: torch.Tensor, window: int, seq_len: int, num_raw: int) -> torch.Tensor:
    """Raw-row indices ``[B, S, window]`` of each query's sliding window, -1 where not visible.

    Query i owns raw row ``own = i + num_raw - seq_len`` (the rows in front are history, e.g. the
    previous context-parallel rank's tail) and sees rows ``[max(window_start, own - window + 1),
    own]``: none when ``window_start > own`` (a padding query).
    """
    own = torch.arange(seq_len, device=window_start.device) + (num_raw - seq_len)
    rows = own[:, None] - window + 1 + torch.arange(window, device=window_start.device)  # [S, W]
    seen = (rows[None] >= window_start[..., None].long()) & (rows[None] >= 0)
    return torch.where(seen, rows[None], -1)


def range_key_indices(ks: torch.Tensor, ke: torch.Tensor) -> torch.Tensor:
    """Index lists ``[B, S, max(ke - ks)]`` of every key j with ks <= j < ke, -1 padded."""
    width = int((ke - ks).max()) if ks.numel() else 0
    slots = ks[..., None].long() + torch.arange(width, device=ks.device)
    return torch.where(slots < ke[..., None].long(), slots, -1)


def dense_probabilities(probabilities: torch.Tensor, columns: torch.Tensor, width: int) -> torch.Tensor:
    """Slot probabilities ``[B, S, H, M]`` laid out densely as ``[B, H, S, width]``: slot m of
    query s lands in column ``columns[b, s, m]`` (-1 = nowhere); slots naming the same column add
    up, other columns are 0. The probabilities' dtype; differentiable in them."""
    batch, seq, heads, _ = probabilities.shape
    safe = torch.where(columns >= 0, columns.long(), width)  # one spare column takes the -1 slots
    dense = probabilities.new_zeros(batch, seq, heads, width + 1)
    dense = dense.scatter_add(-1, safe.unsqueeze(2).expand(-1, -1, heads, -1), probabilities)
    return dense[..., :width].transpose(1, 2)


def window_compressed_attention_reference(
    q: torch.Tensor,
    raw_kv: torch.Tensor,
    window_start: torch.Tensor,
    window: int,
    compressed_kv: torch.Tensor | None,
    *,
    indices: torch.Tensor | None = None,
    ks: torch.Tensor | None = None,
    ke: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    scale: float,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window + compressed attention contract, written as one index-list attention.

    Each query's keys are its sliding window of ``raw_kv`` (:func:`window_key_indices`) and the
    compressed rows of ``compressed_kv`` named by ``indices [B, S, T]`` (-1 = none; a repeated
    index counts once per slot) or the range ``[ks, ke)``; one softmax over all of them with the
    sink in the denominator only. Returns (out [B, S, H, D] in q's dtype, lse fp32 [B, S, H]).
    Differentiable in q, raw_kv, compressed_kv and sink (autograd through the gather).
    ``dropout_p``: dropout on the probabilities (``sparse_attention``). ``indices``' range is
    checked (one host read).
    """
    if compressed_kv is not None and indices is not None:
        check_index_range("indices", indices, compressed_kv.shape[1],
                          meaning=f"-1 = none; compressed_kv has {compressed_kv.shape[1]} rows")  # fmt: skip
    return attend_window_and_compressed(
        q, raw_kv, window_start, window, compressed_kv, indices=indices, ks=ks, ke=ke, sink=sink, scale=scale,
        dropout_p=check_dropout_p(dropout_p),
    )


def attend_window_and_compressed(
    q: torch.Tensor,
    raw_kv: torch.Tensor,
    window_start: torch.Tensor,
    window: int,
    compressed_kv: torch.Tensor | None,
    *,
    indices: torch.Tensor | None = None,
    ks: torch.Tensor | None = None,
    ke: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    scale: float,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`window_compressed_attention_reference` on arguments its caller made or validated:
    nothing is checked, so it reads nothing back (but the range form's widest row)."""
    seq_len = q.shape[1]
    num_raw = raw_kv.shape[1]
    lists = [window_key_indices(window_start, window, seq_len, num_raw)]
    kv = raw_kv
    if compressed_kv is not None:
        selected = indices.long() if indices is not None else range_key_indices(ks, ke)
        lists.append(torch.where(selected >= 0, selected + num_raw, -1))
        kv = torch.cat((raw_kv, compressed_kv), dim=1)
    all_indices = torch.cat(lists, dim=-1)
    # The window lists are built here; the compressed ones are in range (checked or made).
    return attend_to_indices(q, kv, all_indices, sink, scale, dropout_p=dropout_p)
