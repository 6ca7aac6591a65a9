"""Torch references of the hyper-connection parts, in nemo-automodel 0.7.0's arithmetic.

Shapes: ``streams`` ``[..., M, D]`` (M streams of width D, bf16 in training), ``fn`` ``[W, M*D]``
fp32, ``pre`` / ``post`` ``[..., M]`` fp32, ``comb`` ``[..., M, M]`` fp32 indexed ``[source
stream, target stream]``, ``sublayer_out`` ``[..., D]``.

The two families round differently, and each reference keeps its family's order:
- the mix: V4 normalises the fp32 streams and then projects them (``norm_first``), V4.1 projects
  and then scales by the RMS (``project_first``); equal in exact arithmetic;
- the expand: V4 computes in the streams' dtype, rounding ``post * out`` and the comb product
  each once before their sum (``rounding="terms"``); V4.1 computes the whole sum in fp32 and rounds
  once (``rounding="once"``, also DeepSeek's released kernel's rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MIX_ORDERS = ("norm_first", "project_first")
ROUNDINGS = ("terms", "once")


def stream_mix_reference(streams: torch.Tensor, fn: torch.Tensor, eps: float, order: str) -> torch.Tensor:
    """``fn`` applied to the RMS-normalised flattened streams, in fp32: ``[..., W]``."""
    flat = streams.flatten(-2).float()
    if order == "norm_first":
        return F.linear(F.rms_norm(flat, (flat.shape[-1],), eps=eps), fn.float())
    if order == "project_first":
        return F.linear(flat, fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    raise ValueError(f"order must be one of {MIX_ORDERS}, got {order!r}")


def collapse_reference(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_m pre[m] * streams[m]`` in fp32, rounded once to the streams' dtype: ``[..., D]``."""
    return (pre.unsqueeze(-1) * streams.float()).sum(-2).to(streams.dtype)


def expand_reference(
    sublayer_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, rounding: str
) -> torch.Tensor:
    """New streams ``[..., M, D]``: ``post[n] * sublayer_out + sum_m comb[m, n] * streams[m]``."""
    if rounding == "terms":
        dtype = streams.dtype
        mixed = torch.matmul(comb.transpose(-1, -2).to(dtype), streams)
        return post.to(dtype).unsqueeze(-1) * sublayer_out.unsqueeze(-2) + mixed
    if rounding == "once":
        update = post.unsqueeze(-1) * sublayer_out.float().unsqueeze(-2)
        mixed = (comb.unsqueeze(-1) * streams.float().unsqueeze(-2)).sum(-3)
        return (update + mixed).to(sublayer_out.dtype)
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")


def sinkhorn_reference(logits: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """DeepSeek-V4's doubly stochastic ``comb`` from ``[..., M, M]`` logits: a row softmax plus
    ``eps``, then alternating column and row normalisations (``iterations`` column passes)."""
    comb = logits.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb
