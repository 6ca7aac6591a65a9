"""``DSAForCausalLM``: a small DeepSeek-V4-style decoder with DSA sparse attention.

Layer i: ``h += attn(attn_norm(h))``; ``h += ffn(ffn_norm(h))`` (pre-RMSNorm, SwiGLU MLP), with
``compress_ratios[i]`` choosing window-only (0), all visible compressed groups (R != 4) or the
indexer's top-k groups (R = 4). Module attribute names equal the DeepSeek-V4 checkpoint keys
(``embed``, ``layers.{i}.attn.*``, ``layers.{i}.ffn.w1/w2/w3``, ``norm``, ``head``), so
``state_dict()`` needs no renaming.

Batch layout: whatever the trainer gives (``position_ids``, ``seq_lens``/``seq_lens_padded``,
``cu_seqlens``, ``packed_seq_ids``, ``attention_mask``) goes unchanged to
``build_attention_metadata``, which checks they agree; the packed layout is what positions and
document boundaries say. With the THD collater's ``seq_lens_padded`` each document's padded tail
is padding (no query sees it). ``padding_mask`` (True = padding) is used only when no
``attention_mask`` is given. Metadata is built once per distinct ratio (ratio 1 for window-only
layers) and shared by the layers.

Labels are aligned with the logits (nemo-automodel's datasets shift them already): the loss is
the mean cross-entropy over ``labels != -100`` of this shard (0 when there is none), plus the
indexer KL losses.

Under context parallelism (``cp_group``) ``lm_loss`` is this shard's mean and ``aux_loss`` this
rank's share of the global indexer-loss mean (the ranks' values add up to it), so the global
objective is backpropagated as ``lm_loss * local_label_count / global_label_count + aux_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nemo_dsa.labels import IGNORE_INDEX
from nemo_dsa.layers.norm import RMSNorm
from nemo_dsa.layers.sparse_attention import DSASparseAttention
from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig
from nemo_dsa.models.forward_context import build_forward_state


@dataclass
class DSACausalLMOutput:
    """``loss`` = LM loss + aux_loss (None without labels); ``aux_loss`` = summed indexer losses."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    lm_loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None

    def __getitem__(self, key: str):
        return getattr(self, key)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DSAModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = DSASparseAttention(config, layer_idx)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = FeedForward(config.hidden_size, config.intermediate_size)

    def forward(self, h, meta, ctx, shared):
        attended, aux = self.attn(self.attn_norm(h), meta, ctx, shared)
        h = h + attended
        return h + self.ffn(self.ffn_norm(h)), aux


class DSAForCausalLM(nn.Module):
    """Causal LM with DeepSeek-V4-style sparse attention; see the module docstring."""

    def __init__(self, config: DSAModelConfig) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = DSAModelConfig(**config)
        config.validate()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.head.weight = self.embed.weight
        self.initialize_weights()

    @torch.no_grad()
    def initialize_weights(self, *args, **kwargs) -> None:
        """Normal(0, initializer_range) projections and embeddings; every other module resets its
        own parameters (``reset_parameters``: unit norms, zero sinks and position biases).
        CPU-safe and deterministic under ``torch.manual_seed`` (module order)."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                if module is self.head and self.config.tie_word_embeddings:
                    continue
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()

    def num_parameters(self, only_trainable: bool = False) -> int:
        """Number of (distinct) parameters, optionally only those with ``requires_grad``."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not only_trainable)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        seq_lens_padded: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        packed_seq_ids: torch.Tensor | None = None,
        qkv_format: str | None = None,
        cp_group=None,
        **kwargs,
    ) -> DSACausalLMOutput:
        """Logits ``[B, S, vocab]`` of the local shard and, with labels, the loss.

        ``kwargs``: only the transformers generation flags in ``IGNORED_KWARGS`` (no effect here);
        any other name is a TypeError (a misspelt ``postion_ids=`` would silently drop the packing).
        Token ids and labels must be integer tensors with ids in [0, vocab_size) (labels: or -100),
        checked in the metadata's one host read.
        """
        unknown = sorted(set(kwargs) - IGNORED_KWARGS)
        if unknown:
            from difflib import get_close_matches

            known = [*_FORWARD_ARGUMENTS, *sorted(IGNORED_KWARGS)]
            close = get_close_matches(unknown[0], known, n=1, cutoff=0.6)
            raise TypeError(f"forward() got an unexpected keyword argument {unknown[0]!r}"
                            + (f" (did you mean {close[0]}?)" if close else ""))
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            raise ValueError(f"input_ids must be a [B, S] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format must be one of {QKV_FORMATS} (None: from the layout), got {qkv_format!r}")
        vocab = self.config.vocab_size
        checks = []
        for name, ids in (("input_ids", input_ids), ("labels", labels)):
            if ids is None:
                continue
            if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise TypeError(f"{name} must be an integer tensor of token ids, got {str(ids.dtype).replace('torch.', '')}")
            if name == "labels" and ids.shape != input_ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(ids.shape)}")
            if not ids.is_meta:
                bad = (ids < 0) | (ids >= vocab)
                if name == "labels":
                    bad &= ids != IGNORE_INDEX
                checks.append((bad, _out_of_vocab(name, ids, vocab)))
        if attention_mask is None and padding_mask is not None:
            attention_mask = (~padding_mask.bool()).long()
        state = build_forward_state(
            self.config.compress_ratios, cp_group, batch_size=input_ids.shape[0], seq_len=input_ids.shape[1],
            device=input_ids.device, position_ids=position_ids, seq_lens=seq_lens, seq_lens_padded=seq_lens_padded,
            cu_seqlens=cu_seqlens, packed_seq_ids=packed_seq_ids, attention_mask=attention_mask,
            extra_checks=tuple(checks),
        )  # fmt: skip
        metas, ctx, shared = state.metadata, state.ctx, state.shared
        h = self.embed(input_ids)
        aux_total = None
        for layer, ratio in zip(self.layers, self.config.compress_ratios):
            h, aux = layer(h, metas[max(ratio, 1)], ctx, shared)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        logits = self.head(self.norm(h))
        out = DSACausalLMOutput(logits=logits, aux_loss=aux_total)
        if labels is not None:
            lm_loss = causal_lm_loss(logits, labels)
            out.lm_loss = lm_loss
            out.loss = lm_loss if aux_total is None else lm_loss + aux_total
        return out


# transformers' generation flags a caller may pass: they change nothing in this model.
IGNORED_KWARGS = frozenset({
    "use_cache", "return_dict", "output_attentions", "output_hidden_states", "past_key_values", "cache_position",
    "logits_to_keep", "num_logits_to_keep",
})
QKV_FORMATS = (None, "bshd", "thd")
_FORWARD_ARGUMENTS = ("input_ids", "labels", "attention_mask", "position_ids", "padding_mask", "seq_lens",
                      "seq_lens_padded", "cu_seqlens", "packed_seq_ids", "qkv_format", "cp_group")


def _out_of_vocab(name: str, ids: torch.Tensor, vocab: int):
    def raise_error():
        allowed = ids >= 0 if name == "input_ids" else (ids >= 0) | (ids == IGNORE_INDEX)
        bad = (~allowed | (ids >= vocab)).nonzero()[0].tolist()
        also = " or -100 (ignored)" if name == "labels" else ""
        raise ValueError(f"{name} must lie in [0, vocab_size={vocab}){also}, got {int(ids[tuple(bad)])} at {bad}")

    return raise_error


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy over ``labels != -100`` (labels already aligned); 0 if none."""
    flat_labels = labels.reshape(-1)
    counted = flat_labels != IGNORE_INDEX
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat_labels, ignore_index=IGNORE_INDEX,
                             reduction="none")
    return losses.sum() / counted.sum().clamp_min(1)
