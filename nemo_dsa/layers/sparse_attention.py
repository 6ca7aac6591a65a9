"""DeepSeek-V4 sparse attention: sliding window + compressed KV (+ indexer) + sink.

Per query (docs/semantics.md "Sparse attention"): multi-query attention over one shared
KV head, softmax scale ``head_dim^-0.5``, to
  (a) the raw tokens of its sliding window: the last ``sliding_window`` positions up to itself,
      same document, real tokens;
  (b) compressed KV of ratio R > 0 layers: on ratio-4 layers the groups the indexer selected,
      on other ratios every visible group ``[ks, ke)``;
with a learned per-head sink logit (``attn_sink``) in the softmax denominator only.

As in DeepSeek-V4, the query gets a weightless per-head RMS norm before RoPE, q and kv are
rotated at the document-local positions (so a packed document behaves exactly like the same
document alone), the shared kv is both key and value, and the output is rotated back before the
output projection: with ``o_lora_rank > 0`` the release's grouped low-rank ``wo_a`` (``o_groups``
groups of ``H*head_dim/o_groups`` channels, each to ``o_lora_rank``) then ``wo_b``; with
``o_lora_rank = 0`` (nemo_dsa's own small presets) one dense ``wo``.

RoPE per layer type, as the release: window-only layers rotate with ``rope_theta``; compressed
layers (ratio > 0) rotate their main q/kv, their compressor's keys and their indexer's q and keys
with ``compress_rope_theta`` and the YaRN ``rope_scaling`` (no mscale: the release's attention
factor is 1 and its softmax scale stays ``head_dim^-0.5``). Positions: queries and window keys at
their document-local positions, a pooled key at its group's first token's document-local position.
nemo-automodel 0.7.0's built-in DeepSeek-V4 attention rotates at the trainer's ``position_ids``
(document-local in THD packs, 0.. in plain rows) and a packed pooled key at
``(first local position // R) * R``: on rows and on packs whose documents start on multiples of
every ratio both are the same numbers, so the two agree there (tests/layers/test_released_v4_attention.py).

Precision, as the release: the sinks and the compressors' ``wkv``/``wgate``/``ape`` are fp32
parameters that stay fp32 inside bf16 models (``KeepsFP32Parameters``); the indexer scores in the
model's precision (``Indexer.index_dtype``).

Compared side by side with the built-in (same weights, fp32, CPU): the built-in's index q and keys
are not rounded (nemo_dsa scores fp32 models in fp32 too); it gives the indexer no gradient
(nemo_dsa's default since the straight-through term is opt-in); it reads YaRN only from a
``rope_scaling`` whose ``type`` key is "yarn" (nemo_dsa also reads transformers' ``rope_type``);
on packs whose documents start off a multiple of R its pooled-key positions and visibility differ
(nemo_dsa follows docs/semantics.md "Visibility"); its padding positions (a row's right padding, a THD
document's padded tail) still attend and output values, nemo_dsa's output zeros there (neither
reaches a counted label); it rotates at the ``position_ids`` it is given, nemo_dsa at the
positions its metadata derives from the layout (the same numbers for document-local THD
``position_ids`` and for plain rows).

Layer roles on indexer layers (``config.indexer_ratios``: DeepSeek-V4's ratio 4, DeepSeek-V4.1's
every compressed ratio; ``config.attention_role``):
  ``source``   owns a compressor and the index keys, scores and selects;
  ``reindex``  reuses the latest source's compressed KV and index keys, scores and selects again
               with its own ``indexer.wq_b``/``weights_proj``;
  ``reuse``    has neither: attends to the latest source's compressed KV at the latest selection.
A reindex or reuse layer reads the latest kv source before it, which has its ratio. Without
``kv_source_layer_ids`` every indexer layer is a source; without ``index_source_layer_ids`` the
index sources are the kv sources. V4.1 candidate blocks: the ``candidate_source_layer_id`` layer
(a kv source) selects from all its scores and publishes its kept blocks; every later selecting
layer masks its scores to them before top-k, as the V4.1 release does. The blocks are per query
on the shared compressed axis.

DeepSeek-V4.1 (``DSAModelConfig.from_hf_config`` of a V4.1 text config; docs/semantics.md
"V4.1 rounding"): no per-head q RMS (``q_head_rms``); compressors of ratio 1 (``wkv`` + norm) and
2 without overlap or ``ape``; index keys ``k_norm(wk(latent))`` from the layer compressor's
unrotated latent (``index_keys = "latent"``); the window KV quantize-dequantized to fp8 in blocks
of 32 after RoPE (``window_kv_quant``) and the compressed KV to NVFP4 in blocks of 16 after RoPE
(``compressed_kv_quant``), straight-through gradients; the frozen MXFP4 indexer scoring in the
model's precision. Compared with nemo-automodel 0.7.0's built-in ``DeepseekV41Attention``
(tests/layers/test_released_v41_attention.py): fp32 outputs and gradients agree to ~3e-7, the cached KV
and index keys bitwise; bf16 caches bitwise, selections equal except exact score ties.

Training the V4 indexer (DeepSeek's sparse-attention recipe, arXiv 2512.02556): the indexer's
inputs are detached from the main graph, so nothing that trains it reaches the rest of the model.
With ``indexer_kl_coef > 0`` the module returns the distillation loss KL(p || softmax(index_score))
over the selected groups (``nemo_dsa.layers.indexer_loss``), p = the main attention's
probabilities of those groups summed over heads, renormalised, detached. Those probabilities are
the released attention's own: their softmax denominator holds the window keys, the selected
groups and the sink, so a head whose mass sits in its window or its sink weighs less in p.
Opt-in ``indexer_straight_through``: the selected groups' attention logits also receive
``index_score - index_score.detach()``, zero in the forward pass (outputs are unchanged) but the
LM loss gradient w.r.t. those logits reaches the indexer. Both are off by default
(``indexer_kl_coef = 0``, ``indexer_straight_through = False``), so the default gradients equal
the release's (its indexer gets none).

Context parallelism: queries are the local shard; compressed KV and index keys are gathered
along the sequence through the ``SequenceContext``; the window and the ratio-4 compressor
overlap read the previous rank's tail (``previous_tail``); metadata carries global positions.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from nemo_dsa.layers.context import LocalContext, SequenceContext
from nemo_dsa.layers.compressor import Compressor
from nemo_dsa.layers.fp32_parameters import KeepsFP32Parameters
from nemo_dsa.layers.grouped_linear import GroupedLinear
from nemo_dsa.layers.indexer import Indexer, Selection
from nemo_dsa.layers.indexer_loss import indexer_kl_loss
from nemo_dsa.layers.norm import RMSNorm, rms_normalize
from nemo_dsa.layers.rope import apply_rope, rope_angles
from nemo_dsa.layers.shared_state import SharedLayerState, SourceState
from nemo_dsa.ops.dispatch import report_reference_fallback, resolve_backend
from nemo_dsa.ops.head_norm_rope import head_rms_rope, kernels_support
from nemo_dsa.ops.quant import fp8_quant_dequant, nvfp4_quant_dequant
from nemo_dsa.ops.sparse_attention import attend, attend_to_indices
from nemo_dsa.ops.sparse_attention.interface import _check_kernel_limits
from nemo_dsa.ops.sparse_attention.naive import dense_probabilities, range_key_indices, window_key_indices
from nemo_dsa.ops.warm_up import model_builds, warm_up

logger = logging.getLogger(__name__)


FP8_BLOCK = 32  # V4.1 window KV: fp8 blocks of 32 channels
NVFP4_BLOCK = 16  # V4.1 compressed KV: nvfp4 blocks of 16 channels


class DSASparseAttention(KeepsFP32Parameters):
    """One attention layer; parameter names follow the DeepSeek-V4 checkpoint (``layers.{i}.attn.*``)."""

    fp32_parameters = ("attn_sink",)

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.ratio = config.compress_ratios[layer_idx]
        self.role = config.attention_role(layer_idx)
        self.n_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.window = config.sliding_window
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self._warmed: set[tuple] = set()  # (device, attention, selections) whose kernels are built
        self.rope_theta, self.rope_scaling = config.rope_parameters(compressed=self.ratio > 0)
        hidden = config.hidden_size
        self.wq_a = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(hidden, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        if config.o_lora_rank > 0:
            groups = config.o_groups
            self.wo_a = GroupedLinear(self.n_heads * self.head_dim // groups, groups * config.o_lora_rank, groups)
            self.wo_b = nn.Linear(groups * config.o_lora_rank, hidden, bias=False)
        else:
            self.wo = nn.Linear(self.n_heads * self.head_dim, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        owns_compressed_kv = self.role in ("all_groups", "source")
        self.compressor = (
            Compressor(
                hidden, self.head_dim, self.ratio, self.rope_dim, self.rope_theta, config.rms_norm_eps,
                self.rope_scaling, overlap=config.compressor_overlap, ape=config.compressor_ape,
            )
            if owns_compressed_kv
            else None
        )
        self.indexer = (
            Indexer(config, owns_keys=self.role == "source") if self.role in ("source", "reindex") else None
        )

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """This module's own parameters: zero sink logits (submodules initialise themselves)."""
        nn.init.zeros_(self.attn_sink)

    def forward(
        self,
        x: torch.Tensor,
        meta,
        ctx: SequenceContext | None = None,
        shared: SharedLayerState | None = None,
        *,
        probabilities: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        """Attend.

        Args:
            x: ``[B, S, hidden]`` the local shard.
            meta: ``AttentionMetadata`` built for this layer's ratio (ratio 1 for window-only
                layers); its tokens, positions and documents describe ``x``.
            ctx: the sequence context (``LocalContext()`` when None).
            shared: the forward's ``SharedLayerState``, through which kv-source layers pass compressed
                KV, index keys and selections to later ``reindex``/``reuse`` layers (needed for those).
            probabilities: also return the attention probabilities (``_attend_with_probabilities``),
                computed on the reference path; off, nothing of them is computed.

        Returns:
            ``(out [B, S, hidden], aux_loss)``; aux_loss is the weighted indexer KL loss (a
            scalar) on V4 selecting layers with ``indexer_kl_coef > 0``, else None. With
            ``probabilities``, ``(out, aux_loss, probs [B, H, S, S * cp_size + K])``.
        """
        ctx = ctx if ctx is not None else LocalContext()
        shared = shared if shared is not None else SharedLayerState()
        angles = rope_angles(meta.local_positions, self.rope_dim, self.rope_theta, self.rope_scaling)
        query_latent = self.q_norm(self.wq_a(x))
        q = self._queries(query_latent, angles)
        kv = apply_rope(self.kv_norm(self.wkv(x)), angles)
        if self.config.window_kv_quant == "fp8":
            kv = fp8_quant_dequant(kv, FP8_BLOCK)

        # A window longer than the whole sequence (every rank's shard) sees exactly what one of that
        # length sees: bounded so, a huge sliding_window allocates no [B, window - 1, D] history.
        history = min(self.window, max(ctx.size * x.shape[1], 1)) - 1
        raw_kv = with_history(ctx, kv, history)
        compressed_kv, compressed_indices, selection = None, None, None
        if self.ratio > 0:
            compressed_kv, compressed_indices, selection = self._compressed(x, query_latent, angles, meta, ctx, shared)
            compressed_kv = compressed_kv.to(q.dtype)  # attended, and the KL target, in q's precision
        if probabilities:
            out, lse, probs = self._attend_with_probabilities(
                q, raw_kv, meta, ctx, history, compressed_kv, compressed_indices, selection
            )
        else:
            out, lse = self._attend(q, raw_kv, meta, history, compressed_kv, compressed_indices, selection)
        out = self._output_projection(out, angles)
        aux = None
        if self._trains_with_kl(selection):
            aux = self.config.indexer_kl_coef * indexer_kl_loss(
                q, compressed_kv, compressed_indices, selection.index_score, lse, self.scale, ctx
            )
        return (out, aux, probs) if probabilities else (out, aux)

    # -- pieces -------------------------------------------------------------------------------

    def _queries(self, query_latent: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """``wq_b`` into heads, (V4) the weightless per-head RMS, then RoPE.

        With the per-head RMS under autograd, the three are recomputed in the backward from
        ``query_latent`` (which ``wq_b`` keeps anyway): otherwise the un-normalised q would be
        kept for the norm's backward, [S, H, head_dim] (64 KiB a token a layer at V4-Flash shapes,
        as much as the attention's own q), for one more ``wq_b`` GEMM and norm (predicted ~3 % of a
        V4-Flash-shaped step). Without the norm nothing keeps that q (RoPE's
        backward needs only its angles), so nothing is recomputed."""
        if not self.config.q_head_rms:
            return apply_rope(self.wq_b(query_latent).unflatten(-1, (self.n_heads, self.head_dim)), angles)
        if torch.is_grad_enabled():
            return checkpoint(
                self._normalized_queries, query_latent, angles, use_reentrant=False, preserve_rng_state=False
            )
        return self._normalized_queries(query_latent, angles)

    def _normalized_queries(self, query_latent: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        q = self.wq_b(query_latent).unflatten(-1, (self.n_heads, self.head_dim))
        # On CUDA one TileLang kernel each way (ops/head_norm_rope) instead of ~10 eager passes.
        if q.is_cuda and q.dtype == torch.bfloat16 and kernels_support(self.head_dim, self.rope_dim):
            return head_rms_rope(q, angles, self.eps, backend="tilelang")
        return apply_rope(rms_normalize(q, self.eps), angles)

    def _output_projection(self, out: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """The attention output ``[B, S, H, head_dim]``, its rotary channels rotated back, ->
        ``[B, S, hidden]``: grouped ``wo_a`` then ``wo_b``, or ``wo``.

        ``wo_a`` applies the inverse rotation itself and keeps the unrotated output, which the
        attention op keeps anyway, instead of a rotated copy of it."""
        heads = out.shape[-2:]

        def rotate_back(flat: torch.Tensor) -> torch.Tensor:
            return apply_rope(flat.unflatten(-1, heads), angles, inverse=True).flatten(2)

        if self.config.o_lora_rank > 0 and not angles.requires_grad:
            return self.wo_b(self.wo_a(out.flatten(2), rotate_back))
        rotated = rotate_back(out.flatten(2))
        return self.wo_b(self.wo_a(rotated)) if self.config.o_lora_rank > 0 else self.wo(rotated)

    def _attend(self, q, raw_kv, meta, history, compressed_kv, compressed_indices, selection):
        """One softmax over each query's window of ``raw_kv`` and its compressed keys, sink included.

        The window is read by position (``window_start``); compressed keys by the selection's
        indices, or by the visible range ``[ks, ke)`` on layers that see every visible group, so
        no index list exists for either (only the opt-in straight-through variant builds them).
        The kernels take no logit bias: the opt-in straight-through term runs the reference on
        every device; ``attention_backend_for`` picks the backend of the others.
        """
        window_start = document_window_start(meta, history)
        kwargs = {}
        if compressed_kv is not None:
            if compressed_indices is None:
                kwargs.update(ranges=meta.key_ranges)
            else:
                kwargs.update(indices=compressed_indices.to(torch.int32))
        if self._straight_through(selection):
            return self._attend_with_index_bias(q, raw_kv, window_start, compressed_kv, compressed_indices, selection)
        requested = self.config.backend if self.config.attention_backend is None else self.config.attention_backend
        backend = attention_backend_for(requested, q, kwargs.get("indices"), on_cuda=_on_cuda(q, raw_kv))
        dropout_p = self.config.attention_dropout if self.training else 0.0
        if dropout_p and backend != "torch":
            _log_dropout_reference_once(backend)
            backend = "torch"
        self._warm_up_kernels(q, attention=backend == "tilelang")
        # The layer made every input (the metadata's ranges, its indexer's selection): unchecked.
        return attend(
            q, raw_kv, window_start, history + 1, compressed_kv, sink=self.attn_sink, scale=self.scale, backend=backend,
            dropout_p=dropout_p, **kwargs,
        )  # fmt: skip

    def _attend_with_probabilities(self, q, raw_kv, meta, ctx, history, compressed_kv, compressed_indices, selection):
        """``_attend``'s attention on the reference path, with its probabilities laid out densely:
        ``[B, H, S, S * cp_size + K]`` in q's dtype, a column for every token of the whole
        sequence (its global position) and then every compressed row, the sink left out (a row
        sums to 1 minus the sink's share), after the dropout the output used. The same keys,
        logits (the straight-through term included) and softmax as ``_attend``'s."""
        seq, num_raw = q.shape[1], raw_kv.shape[1]
        window_indices = window_key_indices(document_window_start(meta, history), self.window, seq, num_raw)
        first_row_position = ctx.rank * seq - (num_raw - seq)  # global position of raw row 0
        indices, columns = [window_indices], [torch.where(window_indices >= 0, window_indices + first_row_position, -1)]
        keys, bias = raw_kv, None
        if compressed_kv is not None:
            ranges = meta.key_ranges
            selected = compressed_indices.long() if compressed_indices is not None else range_key_indices(ranges.ks, ranges.ke)
            indices.append(torch.where(selected >= 0, selected + num_raw, -1))
            columns.append(torch.where(selected >= 0, selected + seq * ctx.size, -1))
            keys = torch.cat((raw_kv, compressed_kv), dim=1)
            if self._straight_through(selection):
                score = selection.index_score.masked_fill(compressed_indices < 0, 0.0)
                bias = F.pad(score - score.detach(), (window_indices.shape[-1], 0))
        dropout_p = self.config.attention_dropout if self.training else 0.0
        out, lse, slot_probs = attend_to_indices(
            q, keys, torch.cat(indices, dim=-1), self.attn_sink, self.scale, bias=bias, dropout_p=dropout_p,
            return_probabilities=True,
        )  # fmt: skip
        width = seq * ctx.size + (0 if compressed_kv is None else compressed_kv.shape[1])
        return out, lse, dense_probabilities(slot_probs, torch.cat(columns, dim=-1), width).to(q.dtype)

    def _warm_up_kernels(self, q: torch.Tensor, *, attention: bool) -> None:
        """Build, on the first CUDA forward, every TileLang kernel this layer's selection and
        attention can choose at any sequence length (``ops.warm_up``), so that no later length
        compiles one; once per process and device."""
        cfg = self.config
        selections = self.indexer is not None and resolve_backend(cfg.backend, q) == "tilelang"
        if not (attention or selections):
            return
        done = (q.device, attention, selections)
        if done in self._warmed:  # every later forward: no builds to name
            return
        masked = cfg.scoring == "v41" and cfg.candidate_source_layer_id >= 0
        warm_up(model_builds(cfg.scoring, cfg.index_topk, self.head_dim, cfg.candidate_block_size if masked else None,
                             selections=selections, attention=attention))  # fmt: skip
        self._warmed.add(done)

    def _attend_with_index_bias(self, q, raw_kv, window_start, compressed_kv, compressed_indices, selection):
        """The straight-through variant: the selected groups' logits get ``score - score.detach()``."""
        seq = q.shape[1]
        window_indices = window_key_indices(window_start, raw_kv.shape[1] - seq + 1, seq, raw_kv.shape[1])
        offset = raw_kv.shape[1]
        keys = torch.cat((raw_kv, compressed_kv), dim=1)
        indices = torch.cat(
            (window_indices, torch.where(compressed_indices >= 0, compressed_indices + offset, -1)), dim=-1
        )
        score = selection.index_score.masked_fill(compressed_indices < 0, 0.0)
        bias = F.pad(score - score.detach(), (window_indices.shape[-1], 0))
        dropout_p = self.config.attention_dropout if self.training else 0.0
        return attend_to_indices(q, keys, indices, self.attn_sink, self.scale, bias=bias, dropout_p=dropout_p)

    def _compressed_kv(self, x, meta, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's compressor: ``(global rotated KV [B, K, D], local unrotated latent [B, S // R, D])``.

        With ``compressed_kv_quant = "nvfp4"`` (V4.1) the rotated KV is quantize-dequantized in
        blocks of 16 before it is gathered and attended."""
        latent = self.compressor.latent(x, meta, ctx)
        compressed = self.compressor.rotate(latent, meta)
        if self.config.compressed_kv_quant == "nvfp4":
            compressed = nvfp4_quant_dequant(compressed, NVFP4_BLOCK)
        return ctx.gather_sequence(compressed, 1), latent

    def _compressed(self, x, query_latent, angles, meta, ctx, shared: SharedLayerState):
        """Global compressed KV ``[B, K, D]`` and each query's indices into it ``[B, S, T]``."""
        if self.role == "all_groups":  # every visible group: the range [ks, ke), no index list
            return self._compressed_kv(x, meta, ctx)[0], None, None
        state = shared.source
        if self.role == "source":
            compressed_kv, latent = self._compressed_kv(x, meta, ctx)
            index_keys = self.indexer.index_keys(x, meta, ctx, latent=latent)
        else:
            if state is None or state.ratio != self.ratio:
                raise ValueError(
                    f"layer {self.layer_idx} ({self.role}, ratio {self.ratio}) needs a preceding kv source layer "
                    f"of ratio {self.ratio} in `shared`, got {None if state is None else f'ratio {state.ratio}'}"
                )
            compressed_kv, index_keys = state.compressed_kv, state.selection.index_keys
        if self.role == "reuse":
            return compressed_kv, state.selection.topk_indices, None
        cfg = self.config
        inherited_blocks = None if state is None else state.candidate_blocks
        selection = self.indexer(
            x, query_latent, angles, meta, index_keys,
            candidate_source=self.layer_idx == cfg.candidate_source_layer_id,
            candidate_blocks=inherited_blocks,
            block_size=cfg.candidate_block_size, topk_blocks=cfg.candidate_topk_blocks,
        )
        blocks = selection.candidate_blocks if selection.candidate_blocks is not None else inherited_blocks
        shared.source = SourceState(self.ratio, compressed_kv, selection, blocks)
        return compressed_kv, selection.topk_indices, selection

    def _straight_through(self, selection: Selection | None) -> bool:
        return (
            selection is not None
            and selection.index_score is not None
            and self.config.indexer_straight_through
            and torch.is_grad_enabled()
            and selection.index_score.requires_grad
        )

    def _trains_with_kl(self, selection: Selection | None) -> bool:
        return selection is not None and selection.index_score is not None and self.config.indexer_kl_coef > 0


@functools.lru_cache(maxsize=None)
def _log_dropout_reference_once(backend: str) -> None:
    """Said once per process: which path attention dropout takes instead of the kernels."""
    logger.warning(
        "attention_dropout > 0 in training: the %s attention kernels have no dropout, so the attention runs "
        "nemo_dsa's reference (torch) path while training",
        backend,
    )


def _on_cuda(*tensors: torch.Tensor) -> bool:
    return all(t.is_cuda for t in tensors)


def attention_backend_for(requested: str, q: torch.Tensor, indices: torch.Tensor | None, *, on_cuda: bool) -> str:
    """The backend ``sparse_window_attention`` runs a layer's attention on.

    ``"auto"``: the TileLang kernels on CUDA when they take these shapes, else the reference
    (fp32 models, more heads, a wider head or more selected groups than the kernels hold), said
    once in the log. The kernels' own check (``_check_kernel_limits`` beside their
    ``KERNEL_MAX_*``) decides, so the limits live in one place. ``"tilelang"`` and ``"torch"`` pass through: the op raises a
    ValueError/TypeError naming the limit when the kernels cannot take a shape, or CPU tensors.
    """
    if requested != "auto":
        return requested
    if not on_cuda:
        return "torch"
    try:
        _check_kernel_limits(q, indices)
    except (TypeError, ValueError) as refusal:
        report_reference_fallback(f"the sparse attention kernels do not take this layer: {refusal}")
        return "torch"
    return "tilelang"


def with_history(ctx: SequenceContext, x: torch.Tensor, n: int) -> torch.Tensor:
    """``x [B, S, ...]`` preceded by the ``n`` tokens before this shard (zeros where none exist).

    Under CP the tokens come from earlier ranks: ``previous_tail`` when they fit on the previous
    rank, else a full gather (a window longer than a shard).
    """
    if n == 0:
        return x
    seq = x.shape[1]
    if ctx.size > 1 and n > seq:
        full = ctx.gather_sequence(x, 1)
        start = ctx.rank * seq
        before = full[:, max(0, start - n) : start]
        pad = x.new_zeros((x.shape[0], n - before.shape[1], *x.shape[2:]))
        return torch.cat((pad, before, x), dim=1)
    return torch.cat((ctx.previous_tail(x, n, 1), x), dim=1)


def document_window_start(meta, history: int) -> torch.Tensor:
    """int32 ``[B, S]``: the first row of each query's document on the ``history + S`` raw-kv axis.

    Query i owns row ``history + i``; its document began ``local_positions[i]`` tokens earlier
    (possibly on an earlier context-parallel rank: clamped to row 0, the window never reaches
    further back). Padding queries get ``history + i + 1``, an empty window.
    """
    seq = meta.doc_ids.shape[1]
    own = torch.arange(seq, device=meta.doc_ids.device) + history
    start = torch.where(meta.token_valid, own - meta.local_positions, own + 1)
    return start.clamp_min(0).to(torch.int32)
