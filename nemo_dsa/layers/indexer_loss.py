"""The V4 indexer's distillation loss (DeepSeek sparse-attention training, arXiv 2512.02556)."""

from __future__ import annotations

import torch

from nemo_dsa.layers.context import SequenceContext
from nemo_dsa.ops.chunking import DEFAULT_BUDGET_BYTES

# Query chunks of the target computation bound its gathered keys to this many bytes.
_CHUNK_BYTES = DEFAULT_BUDGET_BYTES


def indexer_kl_loss(
    q: torch.Tensor,
    compressed_kv: torch.Tensor,
    indices: torch.Tensor,
    index_score: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    ctx: SequenceContext | None = None,
) -> torch.Tensor:
    """Mean over queries with a selected group of KL(p_attention || softmax(index_score)).

    Under context parallelism the mean runs over every rank's queries: each rank returns its
    KL sum over the global count (from ``ctx``), so the ranks' losses add up to the global mean.

    ``p_attention`` is the main attention's probability of each selected group (its softmax
    denominator ``lse`` includes the window and the sink), summed over heads and renormalised
    over the selected groups; it is a detached target. Gradient reaches only ``index_score``.
    """
    valid = indices >= 0
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        batch, seq, width = indices.shape
        dim = compressed_kv.shape[-1]
        safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
        probs = torch.empty(indices.shape, dtype=torch.float32, device=q.device)
        step = max(1, _CHUNK_BYTES // max(1, batch * width * (dim + q.shape[2]) * 4))
        for start in range(0, seq, step):
            part = slice(start, min(seq, start + step))
            idx = indices[:, part].clamp_min(0)
            keys = torch.gather(compressed_kv, 1, idx.flatten(1).unsqueeze(-1).expand(-1, -1, dim))
            keys = keys.view(batch, idx.shape[1], width, dim).float()
            logits = torch.einsum("bshd,bstd->bsht", q[:, part].float(), keys) * scale
            probs[:, part] = torch.exp(logits - safe_lse[:, part].unsqueeze(-1)).sum(2)
        probs = probs.masked_fill(~valid, 0.0)
        target = probs / probs.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    rows = valid.any(-1)
    scores = index_score.float().masked_fill(~valid, float("-inf")).masked_fill(~rows.unsqueeze(-1), 0.0)
    log_q = torch.log_softmax(scores, dim=-1).masked_fill(~valid, 0.0)
    kl = (torch.xlogy(target, target) - target * log_q).sum(-1)  # 0 on rows without a selection
    count = rows.sum().to(kl.dtype).reshape(1)
    if ctx is not None:  # every rank takes part, also one whose queries selected nothing
        count = ctx.gather_sequence(count, 0)
    return (kl * rows).sum() / count.sum().clamp_min(1)


class _AuxLossGradient(torch.autograd.Function):
    """Identity on ``output``; the backward also sends ``grad_scale()`` into ``aux`` (a scalar loss)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor, grad_scale) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        ctx.grad_scale = grad_scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        scale = ctx.grad_scale() if callable(ctx.grad_scale) else ctx.grad_scale
        if isinstance(scale, torch.Tensor):  # a 0-dim CPU tensor multiplies as a scalar: no copy, no sync
            scale = scale.to(dtype) if scale.device.type == "cpu" else scale.to(device=device, dtype=dtype)
        return grad_output, torch.ones(shape, dtype=dtype, device=device) * scale, None


def attach_aux_loss(output: torch.Tensor, aux: torch.Tensor, grad_scale=1.0) -> torch.Tensor:
    """``output`` unchanged; whatever loss is backpropagated through it also trains ``aux``.

    For trainers that build their loss from the logits (or hidden states) alone and never see the
    indexer's loss. ``aux`` receives the gradient ``grad_scale`` (a number, a 0-dim tensor, or a
    zero-argument callable read during the backward), independent of the gradient reaching
    ``output``: the trainer's own scale for auxiliary losses, which accounts for how it splits a
    step into micro-batches and ranks.
    """
    return _AuxLossGradient.apply(output, aux, grad_scale)
