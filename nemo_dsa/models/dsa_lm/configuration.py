"""Configuration of the DeepSeek-V4 attention and of nemo_dsa's causal LM around it.

A plain dataclass (no transformers dependency): Hydra builds it from YAML, and the
nemo-automodel integration wraps it in a ``PretrainedConfig``. Field names follow the
DeepSeek-V4 config where one exists (``q_lora_rank``, ``o_groups``, ``compress_ratios``,
``compress_rope_theta``, ``rope_scaling``, ``index_topk`` ...); ``from_hf_config`` reads a released
model's HF config (``hf_config.py`` has the field table).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nemo_dsa._checks import INT32_MAX, is_positive_int
from nemo_dsa.layers.rope import yarn_parameters
from nemo_dsa.models.dsa_lm.hf_config import dsa_fields_from_hf
from nemo_dsa.models.dsa_lm.layer_roles import (
    attention_role,
    index_source_layers,
    indexer_layers,
    kv_source_layers,
    latest_kv_source,
)
from nemo_dsa.ops.dispatch import BACKENDS
from nemo_dsa.ops.v4_indexer.kernels import kernel_refusal as v4_kernel_refusal
from nemo_dsa.ops.v41_indexer.heads import kernel_refusal as v41_kernel_refusal

SCORINGS = ("v4", "v41")
INDEX_KEY_SOURCES = ("compressor", "latent")
WINDOW_KV_QUANTS = (None, "fp8")
COMPRESSED_KV_QUANTS = (None, "nvfp4")
# A sane bound on the layer count (DeepSeek-V4 has 61): the modules are built one by one.
MAX_LAYERS = 1024


@dataclass
class DSAModelConfig:
    vocab_size: int = 259
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    head_dim: int = 32
    qk_rope_head_dim: int = 16
    q_lora_rank: int = 64
    intermediate_size: int = 256
    # One entry per layer: 0 = sliding window only; R > 0 adds compressed KV of ratio R.
    # Layers of a ratio in indexer_ratios carry an indexer role (select index_topk groups or
    # reuse a selection); other ratios attend to every visible group.
    compress_ratios: tuple[int, ...] = (0, 4, 16, 4)
    sliding_window: int = 16
    scoring: str = "v4"
    index_n_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 8
    # V4 only: weight of the KL loss that distils the main attention into the indexer (0 = off).
    indexer_kl_coef: float = 0.0
    # V4 only, opt-in: let the LM loss reach the indexer through a zero-valued straight-through
    # term on the selected groups' attention logits (forward unchanged; see
    # layers/sparse_attention.py). Off by default, so default gradients equal the release's
    # (which gives the indexer none).
    indexer_straight_through: bool = False
    # V4.1 layer roles (indices into the layers); None = every indexer layer owns its keys.
    kv_source_layer_ids: tuple[int, ...] | None = None
    index_source_layer_ids: tuple[int, ...] | None = None
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # The release's attention variant. Defaults are DeepSeek-V4's; ``from_hf_config`` sets
    # DeepSeek-V4.1's from a V4.1 text config (indexer_ratios = every ratio > 0, q_head_rms off,
    # compressor_overlap / compressor_ape off, index_keys "latent", fp8 / nvfp4 KV rounding).
    # Ratios whose layers carry an indexer and the source / reindex / reuse roles.
    indexer_ratios: tuple[int, ...] = (4,)
    # A weightless per-head RMS norm on q before RoPE (V4: yes; V4.1: no).
    q_head_rms: bool = True
    # Ratio-4 compressors pool 2R tokens, half the channels from the previous group (V4).
    compressor_overlap: bool = True
    # Compressors add a learned per-slot position bias ``ape`` to their gate logits (V4).
    compressor_ape: bool = True
    # Index keys: "compressor" = the indexer's own ratio-4 compressor (V4); "latent" =
    # ``k_norm(wk(compressed latent))`` of the layer's compressor, before RoPE (V4.1).
    index_keys: str = "compressor"
    # Quantize-dequantize after RoPE (V4.1): window KV to fp8 (blocks of 32), compressed KV to
    # nvfp4 (blocks of 16); None = kept in the model's precision (V4).
    window_kv_quant: str | None = None
    compressed_kv_quant: str | None = None
    rms_norm_eps: float = 1e-6
    # Output projection. o_lora_rank > 0: DeepSeek-V4's grouped low-rank projection, ``wo_a``
    # (o_groups groups, each H*head_dim/o_groups -> o_lora_rank) then ``wo_b``; 0: one dense ``wo``.
    o_lora_rank: int = 0
    o_groups: int = 1
    # RoPE: rope_theta on window-only layers; compressed layers (ratio > 0: their main q/kv, the
    # compressor and the indexer) use compress_rope_theta (None = rope_theta) and the YaRN
    # rope_scaling (None = plain RoPE), as DeepSeek-V4 does (see nemo_dsa/layers/rope.py).
    rope_theta: float = 10000.0
    compress_rope_theta: float | None = None
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    # Kernel choice for the indexer: "auto" (TileLang on CUDA, torch on CPU) | "tilelang" | "torch".
    backend: str = "auto"
    # Kernel choice for the window + compressed attention: None (the indexer's ``backend``) |
    # "auto" (TileLang on CUDA where the kernels take the layer's shapes: bf16, <= 128 heads,
    # head_dim <= 512, <= 2048 selected groups; the reference otherwise) | "tilelang" (the kernels,
    # an error naming the limit a shape exceeds) | "torch".
    attention_backend: str | None = None
    # Select top-k without the [B, S, K] score matrix (streamed query chunks): None = wherever the
    # TileLang kernels run; False materialises the scores (the checking path), True always streams.
    fused_topk: bool | None = None
    # Dropout on the attention probabilities (sink included in the denominator), in training only,
    # as nemo-automodel's DeepSeek attention applies ``attention_dropout``. The TileLang kernels
    # have no dropout: a training forward with dropout > 0 runs the reference attention.
    attention_dropout: float = 0.0

    def __post_init__(self) -> None:
        self.compress_ratios = tuple(int(r) for r in self.compress_ratios)
        self.indexer_ratios = tuple(int(r) for r in self.indexer_ratios)
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, tuple(int(i) for i in value))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending key."""
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
            "q_lora_rank", "intermediate_size", "index_n_heads", "index_head_dim", "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
            # Sizes index int32 tensors (token ids, positions, ks / ke); a config read from a file
            # must not ask for more before anything is allocated.
            if value > INT32_MAX:
                raise ValueError(f"{name} must be <= {INT32_MAX}, got {value}")
        if self.num_hidden_layers > MAX_LAYERS:
            raise ValueError(f"num_hidden_layers must be <= {MAX_LAYERS}, got {self.num_hidden_layers}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if len(self.compress_ratios) != self.num_hidden_layers:
            raise ValueError(
                f"compress_ratios must have num_hidden_layers={self.num_hidden_layers} entries, "
                f"got {len(self.compress_ratios)}"
            )
        if any(r < 0 or r > INT32_MAX for r in self.compress_ratios):
            raise ValueError(f"compress_ratios must be in [0, {INT32_MAX}] (0 = window only), got {self.compress_ratios}")
        for name in ("index_topk", "sliding_window"):
            value = getattr(self, name)
            if not is_positive_int(value):
                raise ValueError(f"{name} must be >= 1, got {value!r}")
            if value > INT32_MAX:
                raise ValueError(f"{name} must be <= {INT32_MAX}, got {value}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(
                f"qk_rope_head_dim must be even and <= head_dim and index_head_dim, got {self.qk_rope_head_dim}"
            )
        # Every index shape runs: the kernels take some, backend "auto" runs the torch reference
        # for the others; asking for the kernels by name with a shape they refuse is an error here.
        refusal = (v41_kernel_refusal if self.scoring == "v41" else v4_kernel_refusal)(self.index_n_heads, self.index_head_dim)
        if self.backend == "tilelang" and refusal is not None:
            raise ValueError(f"backend='tilelang': {refusal} (index_n_heads, index_head_dim); use backend 'auto'")
        for name in ("o_lora_rank", "o_groups"):
            value = getattr(self, name)
            if not is_positive_int(value, minimum=0 if name == "o_lora_rank" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'o_lora_rank' else 1}, got {value!r}")
        if self.o_lora_rank and self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"o_groups must divide num_attention_heads={self.num_attention_heads}, got {self.o_groups}"
            )
        for name in ("rope_theta", "compress_rope_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
        yarn_parameters(self.rope_scaling)  # raises ValueError naming rope_scaling
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.attention_backend is not None and self.attention_backend not in BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {BACKENDS} or null (the indexer's backend), "
                f"got {self.attention_backend!r}"
            )
        if self.fused_topk is not None and not isinstance(self.fused_topk, bool):
            raise TypeError(f"fused_topk must be true, false or null (auto), got {self.fused_topk!r}")
        if isinstance(self.attention_dropout, bool) or not isinstance(self.attention_dropout, (int, float)) or not (
            0.0 <= self.attention_dropout < 1.0
        ):
            raise ValueError(f"attention_dropout must be a probability in [0, 1), got {self.attention_dropout!r}")
        if any(r < 1 for r in self.indexer_ratios):
            raise ValueError(f"indexer_ratios must be compression ratios >= 1, got {self.indexer_ratios}")
        for name in ("q_head_rms", "compressor_overlap", "compressor_ape"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name, choices in (
            ("index_keys", INDEX_KEY_SOURCES),
            ("window_kv_quant", WINDOW_KV_QUANTS),
            ("compressed_kv_quant", COMPRESSED_KV_QUANTS),
        ):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = getattr(self, name) or ()
            bad = [i for i in ids if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ValueError(f"{name} must index layers 0..{self.num_hidden_layers - 1}, got {bad}")

        self._validate_layer_roles()

    def _kv_sources(self) -> tuple[int, ...]:
        return kv_source_layers(self.compress_ratios, self.kv_source_layer_ids, self.indexer_ratios)

    def _index_sources(self) -> tuple[int, ...]:
        return index_source_layers(
            self.compress_ratios, self.kv_source_layer_ids, self.index_source_layer_ids, self.indexer_ratios
        )

    def _validate_layer_roles(self) -> None:
        indexed = indexer_layers(self.compress_ratios, self.indexer_ratios)
        for name, ids in (("kv_source_layer_ids", self._kv_sources()), ("index_source_layer_ids", self._index_sources())):
            bad = [i for i in ids if i not in indexed]
            if bad:
                raise ValueError(
                    f"{name} must name indexer layers (ratios {list(self.indexer_ratios)}) {indexed}, got {bad}"
                )
        missing = [i for i in self._kv_sources() if i not in self._index_sources()]
        if missing:
            raise ValueError(f"index_source_layer_ids must include every kv source layer, missing {missing}")
        if indexed and indexed[0] not in self._kv_sources():
            raise ValueError(
                f"kv_source_layer_ids must include the first indexer layer {indexed[0]} (later layers reuse its keys)"
            )
        for layer in indexed:  # a reindex / reuse layer reads the latest kv source: same ratio
            source = latest_kv_source(self._kv_sources(), layer)
            if self.compress_ratios[source] != self.compress_ratios[layer]:
                raise ValueError(
                    f"kv_source_layer_ids: layer {layer} (ratio {self.compress_ratios[layer]}) would read kv source "
                    f"{source} of ratio {self.compress_ratios[source]}; it needs a preceding source of its own ratio"
                )
        candidate = self.candidate_source_layer_id
        if candidate != -1:
            if self.scoring != "v41":
                raise ValueError("candidate_source_layer_id must be -1 unless scoring is 'v41' (V4.1 candidate blocks)")
            if candidate not in self._kv_sources():
                raise ValueError(
                    f"candidate_source_layer_id must be -1 or a kv source layer {list(self._kv_sources())}, got {candidate}"
                )
            if self.candidate_block_size < 1 or self.candidate_topk_blocks < 1:
                raise ValueError("candidate_block_size and candidate_topk_blocks must be >= 1")
            ratio = self.compress_ratios[candidate]
            later = [i for i in self._index_sources() if i > candidate and self.compress_ratios[i] != ratio]
            if later:  # later selecting layers mask with its blocks, on a compressed axis of its ratio
                raise ValueError(
                    f"index_source_layer_ids: layers {later} follow candidate_source_layer_id {candidate} "
                    f"(ratio {ratio}) with another ratio; its candidate blocks cannot apply to them"
                )

    def attention_role(self, layer_idx: int) -> str:
        """This layer's role (``nemo_dsa.models.dsa_lm.layer_roles``): ``window``, ``all_groups``,
        or for indexer layers (ratios in ``indexer_ratios``) ``source`` / ``reindex`` / ``reuse``."""
        return attention_role(
            self.compress_ratios, layer_idx, self.kv_source_layer_ids, self.index_source_layer_ids, self.indexer_ratios
        )

    def rope_parameters(self, *, compressed: bool) -> tuple[float, dict | None]:
        """``(theta, rope_scaling)`` of a layer: compressed (ratio > 0) or window-only."""
        if not compressed:
            return self.rope_theta, None
        theta = self.rope_theta if self.compress_rope_theta is None else self.compress_rope_theta
        return theta, self.rope_scaling

    @classmethod
    def from_hf_config(cls, hf_config, *, include_mtp_layers: bool = False, **overrides) -> "DSAModelConfig":
        """The attention fields of a DeepSeek-V4 HF config (``nemo_dsa.models.dsa_lm.hf_config``).

        ``hf_config`` is transformers' or nemo-automodel's ``DeepseekV4Config`` or a config.json
        mapping. ``include_mtp_layers`` also covers the MTP layers' attention (layer ids
        num_hidden_layers ...); ``overrides`` replace single fields (e.g. ``backend``).
        """
        fields = dsa_fields_from_hf(hf_config, include_mtp_layers=include_mtp_layers)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_hf_config_or_none(cls, hf_config, *, include_mtp_layers: bool = False, **overrides) -> "DSAModelConfig | None":
        """``from_hf_config``, or None for an HF model without attention layers.

        A DeepSeek model with no layers (main and, with ``include_mtp_layers``, MTP) is valid to
        nemo-automodel (the embedding and the head) and runs no nemo_dsa attention, so it
        has no module config; a small LM with no layers is not, and ``DSAModelConfig`` keeps
        refusing it. ``overrides`` are still checked, as on a one window-layer model, so a bad
        option is an error whatever the layer count.
        """
        fields = dsa_fields_from_hf(hf_config, include_mtp_layers=include_mtp_layers)
        fields.update(overrides)
        if fields["num_hidden_layers"] == 0:
            cls(**{**fields, "num_hidden_layers": 1, "compress_ratios": (0,)})
            return None
        return cls(**fields)

    def to_dict(self) -> dict:
        return asdict(self)
