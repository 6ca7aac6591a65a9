"""A tiny config with the released DeepSeek-V4.1 structure, as the built-in's own
``DeepseekV41TextConfig``: ratios 0 / 2 / 1, all three layer roles (kv + index source, reindex,
reuse) on both compressed ratios, candidate blocks, YaRN on the compressed layers, the grouped
output projection; the built-in's backend on CPU, and the relative error the V4.1 comparisons
bound (max |a - b| / max |b|)."""

from __future__ import annotations

import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

TOPK = 6
RATIOS = [0, 2, 2, 2, 1, 1, 1]
KV_SOURCES, INDEX_SOURCES, CANDIDATE_SOURCE = [1, 4], [1, 3, 4, 5], 4
ROLES = ["window", "source", "reuse", "reindex", "source", "reindex", "reuse"]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}


def hf_config(index_n_heads: int = 8, index_head_dim: int = 32) -> DeepseekV41TextConfig:
    return DeepseekV41TextConfig(
        vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(RATIOS),
        num_attention_heads=4, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=16, o_groups=2,
        compress_ratios=list(RATIOS), kv_source_layer_ids=KV_SOURCES, index_source_layer_ids=INDEX_SOURCES,
        candidate_source_layer_id=CANDIDATE_SOURCE, candidate_topk_blocks=3, candidate_block_size=4,
        sliding_window=8, index_n_heads=index_n_heads, index_head_dim=index_head_dim, index_topk=TOPK, rope_scaling=dict(YARN),
        max_position_embeddings=256, engram_layer_ids=[], num_nextn_predict_layers=0, n_routed_experts=2,
        num_experts_per_tok=1, dspark_noise_token_id=3, rms_norm_eps=1e-6, dtype="float32",
    )  # fmt: skip


def backend() -> BackendConfig:
    return BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                         enable_hf_state_dict_adapter=False, dispatcher="torch", experts="torch_mm")  # fmt: skip


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
