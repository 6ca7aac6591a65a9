"""Configuration of the DeepSeek-V4-style causal LM with DSA attention.

A plain dataclass (no transformers dependency): Hydra builds it from YAML, and the
nemo-automodel integration wraps it in a ``PretrainedConfig``. Field names follow the
DeepSeek-V4 config where one exists (``q_lora_rank``, ``compress_ratios``, ``index_topk`` ...).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

SCORINGS = ("v4", "v41")


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
    # Ratio-4 layers carry an indexer that selects index_topk groups; other ratios attend to
    # every visible group.
    compress_ratios: tuple[int, ...] = (0, 4, 16, 4)
    sliding_window: int = 16
    scoring: str = "v4"
    index_n_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 8
    # V4 only: weight of the KL loss that distils the main attention into the indexer (0 = off).
    indexer_kl_coef: float = 0.0
    # V4 only: let the LM loss reach the indexer through a zero-valued straight-through term on
    # the selected groups' attention logits (forward unchanged; see layers/sparse_attention.py).
    indexer_straight_through: bool = True
    # V4.1 layer roles (indices into the layers); None = every indexer layer owns its keys.
    kv_source_layer_ids: tuple[int, ...] | None = None
    index_source_layer_ids: tuple[int, ...] | None = None
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    # Kernel choice for the indexer: "auto" (TileLang on CUDA, torch on CPU) | "tilelang" | "torch".
    backend: str = "auto"
    # Select top-k without the [B, S, K] score matrix (streamed query chunks): None = wherever the
    # TileLang kernels run; False materialises the scores (the checking path), True always streams.
    fused_topk: bool | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.compress_ratios = tuple(int(r) for r in self.compress_ratios)
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, tuple(int(i) for i in value))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending key."""
        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
            "q_lora_rank", "intermediate_size", "index_n_heads", "index_head_dim",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if len(self.compress_ratios) != self.num_hidden_layers:
            raise ValueError(
                f"compress_ratios must have num_hidden_layers={self.num_hidden_layers} entries, "
                f"got {len(self.compress_ratios)}"
            )
        if any(r < 0 for r in self.compress_ratios):
            raise ValueError(f"compress_ratios must be >= 0 (0 = window only), got {self.compress_ratios}")
        if self.index_topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {self.index_topk}")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.index_head_dim % 16:
            raise ValueError(f"index_head_dim must be a multiple of 16, got {self.index_head_dim}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(
                f"qk_rope_head_dim must be even and <= head_dim and index_head_dim, got {self.qk_rope_head_dim}"
            )
        if self.scoring == "v41":
            h = self.index_n_heads
            if h < 1 or h > 128 or h & (h - 1):
                raise ValueError(f"index_n_heads must be a power of two <= 128 for scoring v41, got {h}")
            if self.index_head_dim % 32:
                raise ValueError(f"index_head_dim must be a multiple of 32 for MXFP4 (v41), got {self.index_head_dim}")
        if self.backend not in ("auto", "tilelang", "torch"):
            raise ValueError(f"backend must be 'auto', 'tilelang' or 'torch', got {self.backend!r}")
        if self.fused_topk is not None and not isinstance(self.fused_topk, bool):
            raise TypeError(f"fused_topk must be true, false or null (auto), got {self.fused_topk!r}")
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = getattr(self, name) or ()
            bad = [i for i in ids if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ValueError(f"{name} must index layers 0..{self.num_hidden_layers - 1}, got {bad}")

        self._validate_layer_roles()

    def _ratio4_layers(self) -> list[int]:
        return [i for i, r in enumerate(self.compress_ratios) if r == 4]

    def _kv_sources(self) -> tuple[int, ...]:
        if self.kv_source_layer_ids is None:
            return tuple(self._ratio4_layers())
        return self.kv_source_layer_ids

    def _index_sources(self) -> tuple[int, ...]:
        if self.index_source_layer_ids is None:
            return self._kv_sources()
        return self.index_source_layer_ids

    def _validate_layer_roles(self) -> None:
        ratio4 = self._ratio4_layers()
        for name, ids in (("kv_source_layer_ids", self._kv_sources()), ("index_source_layer_ids", self._index_sources())):
            bad = [i for i in ids if i not in ratio4]
            if bad:
                raise ValueError(f"{name} must name ratio-4 (indexer) layers {ratio4}, got {bad}")
        missing = [i for i in self._kv_sources() if i not in self._index_sources()]
        if missing:
            raise ValueError(f"index_source_layer_ids must include every kv source layer, missing {missing}")
        if ratio4 and ratio4[0] not in self._kv_sources():
            raise ValueError(
                f"kv_source_layer_ids must include the first ratio-4 layer {ratio4[0]} (later layers reuse its keys)"
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

    def attention_role(self, layer_idx: int) -> str:
        """``window`` (ratio 0), ``all_groups`` (ratio > 0, != 4), or for ratio-4 layers
        ``source`` / ``reindex`` / ``reuse`` (see nemo_dsa/layers/sparse_attention.py)."""
        ratio = self.compress_ratios[layer_idx]
        if ratio == 0:
            return "window"
        if ratio != 4:
            return "all_groups"
        if layer_idx in self._kv_sources():
            return "source"
        if layer_idx in self._index_sources():
            return "reindex"
        return "reuse"

    def to_dict(self) -> dict:
        return asdict(self)
