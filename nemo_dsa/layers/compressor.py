"""Compressed KV: softmax-gated pooling of every R-token group into one key.

Per group j (global tokens [jR, (j+1)R)), each token projects a value (``wkv``) and per-channel
gate logits (``wgate``) plus, with ``ape`` (DeepSeek-V4), a learned position bias (one row per
slot in the group); the softmax over the group's tokens weights the values. With ``overlap``
(DeepSeek-V4), ratio-4 layers pool 2R tokens, as the released V4 checkpoint does (its ratio-4
``wkv``/``wgate``/``ape`` are twice as wide): the first half of the channels of group j-1's tokens
join group j, but only when group j-1 holds tokens of the same document (otherwise they are
selected away: -inf logits and zero values, so a NaN or inf in another document cannot reach
group j). Ratio 1 (DeepSeek-V4.1) has nothing to pool: the key is ``norm(wkv(x))``, with ``wkv``
applied in the input's dtype as the release does; V4.1's ratio-2 compressors have no overlap and
no ``ape``. Invalid groups (padding or a document boundary inside) pool to zeros; the visibility
rule never shows them to a query. The pooled key is RMS-normalised (the unrotated ``latent``,
from which V4.1 derives its index keys) and rotated at the document-local position of its first
token (with the layer's RoPE: ``compress_rope_theta`` and YaRN in the released models).

Precision, as the released DeepSeek-V4 runs it: ``wkv``, ``wgate`` and ``ape`` are fp32 parameters
(kept fp32 inside bf16 models), the projections and the pooling run in fp32 (also under autocast),
and the pooled key is cast to the input's dtype before the norm. On the GPU the two projections of
bf16 tokens are computed as exact bf16 products with fp32 accumulation (``ops/fp32_linear``), the
fp32 GEMM's value up to the order of its additions. A projection whose module computes more than
its weight (a low-rank adapter added by nemo-automodel's PEFT) is always called as a module, so
the adapter applies on every path.

Position of a pooled key, compared with nemo-automodel 0.7.0's built-in DeepSeek-V4: the built-in
rotates a packed document's key at ``(first-token local position // R) * R``, nemo_dsa at the
first-token local position. On documents that start on a multiple of R the two are the same
number; elsewhere nemo_dsa keeps the group's true position (the built-in's group index there is
also the one that lets a query see a group holding later tokens, see docs/semantics.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nemo_dsa.layers.context import SequenceContext
from nemo_dsa.layers.fp32_parameters import KeepsFP32Parameters
from nemo_dsa.layers.norm import RMSNorm
from nemo_dsa.layers.rope import apply_rope, rope_angles
from nemo_dsa.ops.fp32_linear import fp32_linear_of_bf16, split_applies

OVERLAP_RATIO = 4


def _is_plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes ``x @ weight.T`` and nothing else (no adapter patched in)."""
    return type(module).forward is nn.Linear.forward


class Compressor(KeepsFP32Parameters):
    """Pool this shard's complete R-token groups into ``[B, S // R, head_dim]`` keys."""

    fp32_parameters = ("wkv.weight", "wgate.weight", "ape")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        ratio: int,
        rope_dim: int,
        rope_theta: float,
        eps: float,
        rope_scaling: dict | None = None,
        *,
        overlap: bool = True,
        ape: bool = True,
    ) -> None:
        super().__init__()
        self.ratio = ratio
        self.head_dim = head_dim
        self.rope_dim = rope_dim
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.overlap = overlap and ratio == OVERLAP_RATIO
        self.gated = ratio > 1  # a one-token group has nothing to weigh
        width = head_dim * (2 if self.overlap else 1)
        self.wkv = nn.Linear(hidden_size, width, bias=False, dtype=torch.float32)
        if self.gated:
            self.wgate = nn.Linear(hidden_size, width, bias=False, dtype=torch.float32)
        if self.gated and ape:
            self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        else:
            self.ape = None
        self.norm = RMSNorm(head_dim, eps)
        self.fp32_parameters = tuple(n for n, _ in self.named_parameters() if not n.startswith("norm."))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """This module's own parameters: zero position biases (the model initialises the
        projections, the norm resets itself)."""
        if self.ape is not None:
            nn.init.zeros_(self.ape)

    def forward(self, x: torch.Tensor, meta, ctx: SequenceContext) -> torch.Tensor:
        """Pool ``x [B, S, hidden]``; ``meta`` is this ratio's ``AttentionMetadata``.

        Returns the local groups ``[B, S // R, head_dim]``, rotated (the caller gathers them along
        the sequence under context parallelism). Under CP the overlap reads the previous rank's
        last group through ``ctx.previous_tail``.
        """
        return self.rotate(self.latent(x, meta, ctx), meta)

    def latent(self, x: torch.Tensor, meta, ctx: SequenceContext) -> torch.Tensor:
        """The pooled, normalised, not yet rotated groups ``[B, S // R, head_dim]`` (zeros where invalid)."""
        batch, seq, _ = x.shape
        r, d = self.ratio, self.head_dim
        groups = seq // r
        if groups == 0:
            return x.new_zeros(batch, 0, d)
        group_valid = meta.group_valid.bool()
        if not self.gated:  # ratio 1: the projection in the input's dtype (the release's rounding)
            if _is_plain_linear(self.wkv):
                pooled = F.linear(x[:, :groups], self.wkv.weight.to(x.dtype))
            else:
                pooled = self.wkv(x[:, :groups].to(self.wkv.weight.dtype)).to(x.dtype)
            pooled = pooled.masked_fill(~group_valid.unsqueeze(-1), 0.0)
            return self.norm(pooled).masked_fill(~group_valid.unsqueeze(-1), 0.0)
        values, logits = self._gate_projections(x[:, : groups * r])
        if self.overlap:
            values, logits = self._with_previous_group(values, logits, meta, ctx)
        else:
            values = values.view(batch, groups, r, d)
            logits = logits.view(batch, groups, r, d)
        if self.ape is not None:
            ape = torch.cat((self.ape[:, :d], self.ape[:, d:]), dim=0) if self.overlap else self.ape
            logits = logits + ape.float()
        # Select invalid groups away before pooling, never only after: a group spanning a document
        # boundary holds another document's tokens, and a NaN / inf among them would make the
        # backward of the pooling send 0 x NaN = NaN to this document's tokens in the group.
        valid = group_valid.view(batch, groups, 1, 1)
        values = torch.where(valid, values, 0.0)
        logits = torch.where(valid, logits, 0.0)
        pooled = (values * logits.softmax(dim=2)).sum(dim=2)
        return self.norm(pooled.to(x.dtype))

    def _gate_projections(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 ``wkv(tokens)`` and ``wgate(tokens)``. Bf16 tokens on the GPU take both weights in
        one exact-product GEMM chain on bf16 tensor cores (``fp32_linear_of_bf16``: the fp32
        GEMM's result up to the order of fp32 additions; the input gradient summed over both in
        fp32 and rounded once, as the ``.float()`` cast's backward does), not fp32 SIMT GEMMs."""
        plain = _is_plain_linear(self.wkv) and _is_plain_linear(self.wgate)
        if plain and split_applies(tokens, self.wkv.weight) and split_applies(tokens, self.wgate.weight):
            weights = torch.cat((self.wkv.weight, self.wgate.weight))
            both = fp32_linear_of_bf16(tokens, weights, out_dtype=torch.float32)
            return both.split(self.wkv.out_features, dim=-1)
        tokens = tokens.float()
        with torch.autocast(tokens.device.type, enabled=False):
            return self.wkv(tokens), self.wgate(tokens)

    def rotate(self, latent: torch.Tensor, meta) -> torch.Tensor:
        """``latent [B, G, head_dim]`` rotated at each group's first token's document-local position."""
        groups = latent.shape[1]
        first_token_positions = meta.local_positions[:, : groups * self.ratio : self.ratio]
        angles = rope_angles(first_token_positions, self.rope_dim, self.rope_theta, self.rope_scaling)
        rotated = apply_rope(latent, angles)
        return rotated.masked_fill(~meta.group_valid.bool()[:, :groups].unsqueeze(-1), 0.0)

    def _with_previous_group(self, values, logits, meta, ctx):
        """``[B, G, 2R, d]`` pools: group j-1's first-half channels, then group j's second half."""
        batch, length, _ = values.shape
        r, d = self.ratio, self.head_dim
        groups = length // r
        # The previous rank's last R tokens are its last group (CP shards hold whole groups).
        prev_values = torch.cat((ctx.previous_tail(values[..., :d], r, 1), values[:, :-r, :d]), dim=1)
        prev_logits = torch.cat((ctx.previous_tail(logits[..., :d], r, 1), logits[:, :-r, :d]), dim=1)
        doc_ids = meta.doc_ids[:, :length]
        prev_docs = torch.cat((ctx.previous_tail(doc_ids, r, 1), doc_ids[:, :-r]), dim=1).view(batch, groups, r)
        group_docs = meta.group_doc_ids.to(prev_docs.dtype)
        same_document = (prev_docs == group_docs.unsqueeze(-1)).all(-1) & meta.group_valid.bool()
        # Select, never multiply: a weight of 0 times another document's NaN / inf is NaN.
        joins = same_document.view(batch, groups, 1, 1)
        prev_logits = torch.where(joins, prev_logits.view(batch, groups, r, d), float("-inf"))
        prev_values = torch.where(joins, prev_values.view(batch, groups, r, d), 0.0)
        current_values = values[..., d:].reshape(batch, groups, r, d)
        current_logits = logits[..., d:].reshape(batch, groups, r, d)
        pooled_values = torch.cat((prev_values, current_values), dim=2)
        pooled_logits = torch.cat((prev_logits, current_logits), dim=2)
        return pooled_values, pooled_logits
