"""The lightning indexer: scores every visible compressed group for each query and keeps top-k.

Index queries come from the attention's query latent (``wq_b``), index keys from the indexer's
own ratio-4 compressor (DeepSeek-V4, ``index_keys = "compressor"``) or as ``k_norm(wk(latent))``
from the layer's compressed latent, the normalised pooled KV before RoPE (DeepSeek-V4.1,
``index_keys = "latent"``), rotated at the groups' first-token positions; per-head weights from ``weights_proj`` with the released scaling
``index_head_dim^-0.5 * index_n_heads^-0.5`` folded in (DeepSeek-V3.2/V4 inference code). RoPE is
applied to the trailing ``qk_rope_head_dim`` channels of both, with the compressed layers' RoPE
(``compress_rope_theta`` and YaRN in the released model) at the queries' document-local positions.

The ops are called through their ``*_in_ranges`` entries with the metadata's
:class:`~nemo_dsa.visibility.KeyRanges` and tensors made here: nothing is validated (or read
back) again in a step.

The indexer's inputs (the attention input and the query latent) are detached from the main graph,
as in DeepSeek's sparse-attention training (arXiv 2512.02556): whatever trains the indexer (the KL
loss, the opt-in straight-through term) reaches only the indexer's own parameters.

Scoring (docs/semantics.md "Index scoring"):
- ``v4``: trainable fp32 logits through ``v4_indexer_bshd``; returns the gathered
  ``index_score`` so the caller can train the indexer. q and k are in the model's precision, as in
  the release: bf16 in bf16 models (and under bf16 autocast), fp32 in fp32 models (the V4 op takes
  bf16 only, so fp32 q/k are scored by the op's fp32 reference and the selected scores gathered
  here, differentiably; ``fused_topk`` applies to bf16 scoring).
- ``v41``: frozen (``requires_grad=False``) scores with MXFP4 quantize-dequantize of q and k after
  RoPE, selection in ascending key order, optional V4.1 candidate blocks. In the model's
  precision, as the release: bf16 models score with the op's BF16 boundaries (the products and
  the weighted head terms rounded to bf16, summed in fp32); fp32 models score in fp32
  (``v41_scores_full_precision``: ``sum_h w_h relu(q_h . k_j)``, nothing rounded; MXFP4 values
  are exact in either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nemo_dsa.layers.context import SequenceContext
from nemo_dsa.layers.compressor import OVERLAP_RATIO, Compressor
from nemo_dsa.layers.norm import RMSNorm
from nemo_dsa.layers.rope import apply_rope, rope_angles
from nemo_dsa.ops.dispatch import resolve_backend, resolve_fused_topk
from nemo_dsa.ops.fused_selection import interface as fused_selection
from nemo_dsa.ops.quant import mxfp4_quant_dequant
from nemo_dsa.ops.topk import select_topk
from nemo_dsa.ops.v41_indexer import blocks_to_mask
from nemo_dsa.ops.v41_indexer import kernel_refusal as v41_kernel_refusal
from nemo_dsa.ops.v41_indexer.candidates import candidate_blocks_in_ranges
from nemo_dsa.ops.v41_indexer import indexer_scores_in_ranges
from nemo_dsa.ops.v4_indexer import v4_indexer_in_ranges, v4_logits_in_ranges
from nemo_dsa.visibility import KeyRanges


@dataclass
class Selection:
    """What an indexer layer publishes (and later layers may reuse)."""

    index_keys: torch.Tensor  # [B, K, D] bf16, global compressed axis
    topk_indices: torch.Tensor  # int64 [B, S, T], -1 = nothing
    index_score: torch.Tensor | None  # fp32 [B, S, T] (v4 only), -inf at -1
    candidate_blocks: torch.Tensor | None = None  # int32 [B, S, NB] kept blocks (v41 candidate source)


class Indexer(nn.Module):
    """Per-layer indexer. ``owns_keys=False`` layers reuse another layer's index keys."""

    def __init__(self, config, owns_keys: bool = True) -> None:
        super().__init__()
        self.scoring = config.scoring
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.backend = config.backend
        self.fused_topk = config.fused_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.rope_dim = config.qk_rope_head_dim
        self.rope_theta, self.rope_scaling = config.rope_parameters(compressed=True)
        self.keys_from_latent = config.index_keys == "latent"
        self.compressor = None
        if owns_keys and self.keys_from_latent:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        elif owns_keys:
            self.compressor = Compressor(
                config.hidden_size, self.head_dim, OVERLAP_RATIO, config.qk_rope_head_dim, self.rope_theta,
                config.rms_norm_eps, self.rope_scaling, overlap=config.compressor_overlap, ape=config.compressor_ape,
            )  # fmt: skip
        self.owns_keys = owns_keys
        if self.scoring == "v41":
            # The V4.1 indexer is released frozen: it is never trained.
            self.requires_grad_(False)

    @property
    def frozen(self) -> bool:
        return self.scoring == "v41"

    def index_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype of index q and k, the model's precision: bf16 in bf16 models and under bf16
        autocast, else fp32 (both scorings, as the releases score)."""
        low_precision = x.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled(x.device.type)
        return torch.bfloat16 if low_precision else torch.float32

    def index_keys(
        self, x: torch.Tensor, meta, ctx: SequenceContext, latent: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Index keys ``[B, K, D]`` (:meth:`index_dtype`) on the global compressed axis (gathered under CP).

        ``latent`` (``index_keys = "latent"``): the layer compressor's local unrotated groups
        ``[B, S // R, head_dim]``; ``meta`` is that ratio's metadata.
        """
        if not self.owns_keys:
            raise ValueError("this indexer layer does not own index keys; pass keys from its source layer")
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            if self.keys_from_latent:
                if latent is None:
                    raise ValueError("latent: an index_keys='latent' indexer needs its layer's compressed latent")
                keys = self._keys_from_latent(latent.detach(), meta)
            else:
                keys = self.compressor(x.detach(), meta, ctx)
            keys = keys.to(self.index_dtype(x))
            if self.frozen:
                keys = _mxfp4(keys)
            return ctx.gather_sequence(keys, 1)

    def _keys_from_latent(self, latent: torch.Tensor, meta) -> torch.Tensor:
        """``k_norm(wk(latent))`` rotated at each group's first token's document-local position."""
        groups, ratio = latent.shape[1], meta.compress_ratio
        positions = meta.local_positions[:, : groups * ratio : ratio]
        angles = rope_angles(positions, self.rope_dim, self.rope_theta, self.rope_scaling)
        return apply_rope(self.k_norm(self.wk(latent)), angles)

    def forward(
        self,
        x: torch.Tensor,
        query_latent: torch.Tensor,
        angles: torch.Tensor,
        meta,
        index_keys: torch.Tensor,
        *,
        candidate_source: bool = False,
        candidate_blocks: torch.Tensor | None = None,
        block_size: int = 8,
        topk_blocks: int = 1,
    ) -> Selection:
        """Score ``index_keys`` for the local queries and select top-k.

        Args:
            x: ``[B, S, hidden]`` the attention input (for the head weights; detached here).
            query_latent: ``[B, S, q_lora_rank]`` the normalised query latent (detached here).
            angles: RoPE angles ``[B, S, rope_dim/2]`` at the queries' document-local positions.
            meta: ratio-4 ``AttentionMetadata`` (ks/ke on the global compressed axis).
            index_keys: ``[B, K, D]`` keys from :meth:`index_keys` (this or a source layer).
            candidate_source: (v41) also compute the candidate blocks that later layers keep.
            candidate_blocks: (v41) blocks from the candidate-source layer: scores outside them
                are masked before top-k.
        """
        x, query_latent = x.detach(), query_latent.detach()
        batch, seq, _ = x.shape
        num_keys = index_keys.shape[1]
        if num_keys == 0:
            empty = torch.full((batch, seq, 0), -1, dtype=torch.long, device=x.device)
            score = x.new_zeros((batch, seq, 0), dtype=torch.float32) if not self.frozen else None
            return Selection(index_keys, empty, score, None)
        if self.frozen:
            return self._select_v41(x, query_latent, angles, meta, index_keys, candidate_source,
                                    candidate_blocks, block_size, topk_blocks)
        return self._select_v4(x, query_latent, angles, meta, index_keys)

    def _queries(self, x, query_latent, angles):
        q = self.wq_b(query_latent).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rope(q, angles).to(self.index_dtype(x))
        weights = self.weights_proj(x).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return q, weights

    def _select_v4(self, x, query_latent, angles, meta, index_keys) -> Selection:
        q, weights = self._queries(x, query_latent, angles)
        index_keys = index_keys.to(q.dtype)
        if q.dtype == torch.bfloat16:
            score, indices = v4_indexer_in_ranges(
                q, index_keys, weights, meta.key_ranges, self.topk, backend=self.backend, fused_topk=self.fused_topk,
            )
        else:
            score, indices = v4_select_full_precision(q, index_keys, weights, meta.key_ranges, self.topk)
        return Selection(index_keys, indices.long(), score, None)

    @torch.no_grad()
    def _select_v41(self, x, query_latent, angles, meta, index_keys, candidate_source,
                    kept_blocks, block_size, topk_blocks) -> Selection:
        q, weights = self._queries(x, query_latent, angles)
        if q.dtype == torch.float32:  # an fp32 model scores in fp32, as the release does
            scores = v41_scores_full_precision(_mxfp4(q), index_keys.to(q.dtype), weights, meta.ks, meta.ke)
            return self._select_from_v41_scores(scores, meta, index_keys, candidate_source, kept_blocks,
                                                block_size, topk_blocks)  # fmt: skip
        backend = resolve_backend(self.backend, q, kernel_refusal=v41_kernel_refusal(self.n_heads, self.head_dim))
        if resolve_fused_topk(self.fused_topk, backend):  # no [B, S, K] scores
            # Kept blocks come from the candidate-source layer's selection (either path), in its form.
            picked = fused_selection.v41_select_topk_in_ranges(
                _mxfp4(q), index_keys, weights.to(torch.bfloat16), meta.key_ranges, self.topk, backend,
                candidate_block_size=block_size if candidate_source or kept_blocks is not None else None,
                candidate_topk_blocks=topk_blocks if candidate_source else None,
                candidate_blocks=None if candidate_source else kept_blocks, blocks_from_source=True,
            )
            indices, blocks = picked if candidate_source else (picked, None)
            return Selection(index_keys, indices.long(), None, blocks)
        scores = indexer_scores_in_ranges(_mxfp4(q), index_keys, weights.to(torch.bfloat16), meta.key_ranges,
                                          backend=self.backend)  # fmt: skip
        return self._select_from_v41_scores(scores, meta, index_keys, candidate_source, kept_blocks,
                                            block_size, topk_blocks)  # fmt: skip

    def _select_from_v41_scores(self, scores, meta, index_keys, candidate_source, kept_blocks,
                                block_size, topk_blocks) -> Selection:  # fmt: skip
        blocks = None
        if candidate_source:
            blocks = candidate_blocks_in_ranges(scores, meta.key_ranges, block_size, topk_blocks)
        elif kept_blocks is not None:
            keep = blocks_to_mask(kept_blocks, meta.ks, meta.ke, block_size, scores.shape[-1])
            scores = scores.masked_fill(~keep, float("-inf"))
        indices = select_topk(scores, self.topk, order="index", backend=self.backend)
        return Selection(index_keys, indices.long(), None, blocks)


def v4_select_full_precision(q, k, w, ranges: KeyRanges, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``v4_indexer_bshd`` for fp32 q/k (the op takes bf16 only): ``(index_score, topk_indices)``.

    The op's fp32 reference logits select (same order and tie rule), and the selected scores
    ``sum_h w_h relu(q_h . k_j)`` are recomputed here with autograd (-inf at -1), so gradients
    reach q, k and w through the gathered scores only, as the op's backward sends them."""
    with torch.no_grad():
        indices = select_topk(v4_logits_in_ranges(q, k, w, ranges), topk, order="score")
    batch, seq, width = indices.shape
    picked = indices.long().clamp_min(0).flatten(1).unsqueeze(-1).expand(-1, -1, k.shape[-1])
    keys = torch.gather(k, 1, picked).view(batch, seq, width, k.shape[-1])
    score = (torch.einsum("bshd,bstd->bsht", q, keys).relu() * w.unsqueeze(-1)).sum(2)
    return score.masked_fill(indices < 0, float("-inf")), indices


def v41_scores_full_precision(q, k, w, ks, ke) -> torch.Tensor:
    """V4.1 index scores of fp32 ``q [B, S, H, D]``, ``k [B, K, D]``, ``w [B, S, H]``: fp32
    ``[B, S, K]`` = ``sum_h w_h relu(q_h . k_j)`` inside ``[ks, ke)``, -inf outside (the release's
    fp32 arithmetic: per-head products, ReLU, weighted, summed over heads)."""
    scores = (torch.einsum("bshd,btd->bsht", q, k).relu() * w.unsqueeze(-1)).sum(dim=2)
    keys = torch.arange(k.shape[1], device=k.device)
    visible = (keys >= ks.unsqueeze(-1)) & (keys < ke.unsqueeze(-1))
    return scores.masked_fill(~visible, float("-inf"))


def _mxfp4(x: torch.Tensor) -> torch.Tensor:
    return mxfp4_quant_dequant(x)
