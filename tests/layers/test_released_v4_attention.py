"""nemo_dsa's DSASparseAttention against nemo-automodel's built-in DeepseekV4Attention (CPU, fp32).

One layer of each kind of the release (ratios 0 / 4 / 128) on a tiny release-style config: YaRN
on the compressed layers (compress_rope_theta 160000), a grouped low-rank output projection
(o_groups 2). Both modules hold the same random weights: nemo_dsa's parameters carry the HF
checkpoint names, mapped to the built-in's by nemo-automodel's own state-dict renames. The
nemo_dsa config comes from the built-in's config through ``DSAModelConfig.from_hf_config``.

What must agree, on unpacked rows and on THD packs whose documents start on multiples of 4 (and
of 128 where a document holds a whole ratio-128 group): outputs (rel 1e-5), the ratio-4 top-k
sets (identical; the test asserts that no score tie decides one), and every parameter's and the
input's gradient (rel 1e-5) with the indexer frozen as the built-in trains it (no gradient).
"""

from __future__ import annotations

import logging

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel.components.models.common import BackendConfig
from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
from nemo_automodel.components.models.deepseek_v4.layers import (
    DeepseekV4Attention,
    DeepseekV4RotaryEmbedding,
    build_causal_padding_mask,
    build_packed_causal_padding_mask,
)
from nemo_automodel.components.models.deepseek_v4.state_dict_adapter import _rename_hf_key

import nemo_dsa.layers.indexer as indexer_module
from nemo_dsa.layers.context import LocalContext
from nemo_dsa.layers.shared_state import SharedLayerState
from nemo_dsa.layers.sparse_attention import DSASparseAttention
from nemo_dsa.metadata import build_attention_metadata
from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig

RTOL = 1e-5
TOPK = 6
# The T-th and (T+1)-th visible index scores of a query differ by more than this (relative):
# fp32 summation-order noise between the two implementations is ~1e-7.
TIE_MARGIN = 1e-5
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
RATIOS = [0, 4, 128]
UNPACKED = (2, 264)  # rows, length: 66 ratio-4 groups, 2 ratio-128 groups
PACK = [132, 124, 144]  # documents start at 0, 132, 256: multiples of 4, and of 128 where one holds a whole group


def hf_config() -> DeepseekV4Config:
    return DeepseekV4Config(
        vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=len(RATIOS),
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32,
        o_lora_rank=16, o_groups=2, compress_ratios=list(RATIOS), sliding_window=8, index_n_heads=8,
        index_head_dim=32, index_topk=TOPK, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling=dict(YARN), max_position_embeddings=256, num_hash_layers=0, num_nextn_predict_layers=0,
        n_routed_experts=2, torch_dtype="float32",
    )  # fmt: skip


def backend() -> BackendConfig:
    return BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", rope_fusion=False,
                         enable_hf_state_dict_adapter=False, dispatcher="torch", experts="torch_mm")


def builtin_name(layer_idx: int, nemo_name: str) -> str:
    """The built-in attention's parameter name for nemo_dsa's (HF checkpoint) name."""
    prefix = f"model.layers.{layer_idx}.self_attn."
    renamed = _rename_hf_key(f"layers.{layer_idx}.attn.{nemo_name}")
    assert renamed.startswith(prefix), renamed
    return renamed[len(prefix) :]


def make_pair(layer_idx: int, seed: int):
    config = hf_config()
    torch.manual_seed(seed)
    builtin = DeepseekV4Attention(config, layer_idx, backend=backend())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # fresh random values everywhere, sinks and position biases included
        for name, p in builtin.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise * (0.5 if p.ndim == 1 else 0.15))
    dsa_config = DSAModelConfig.from_hf_config(config, backend="torch")
    mine = DSASparseAttention(dsa_config, layer_idx)
    theirs = dict(builtin.named_parameters())
    names = {name: builtin_name(layer_idx, name) for name, _ in mine.named_parameters()}
    assert sorted(names.values()) == sorted(theirs), "the HF names must map 1:1 onto the built-in's parameters"
    with torch.no_grad():
        for name, p in mine.named_parameters():
            assert p.shape == theirs[names[name]].shape, name
            p.copy_(theirs[names[name]])
    return config, builtin, mine, names


def rotaries(config):
    factor = config.qk_rope_head_dim / config.head_dim
    main = DeepseekV4RotaryEmbedding(config.rope_theta, config.head_dim, factor, rope_scaling=None)
    compress = DeepseekV4RotaryEmbedding(config.compress_rope_theta, config.head_dim, factor,
                                         rope_scaling=config.rope_scaling)
    return main, compress


def layout(kind: str):
    """``(x, position_ids, seq_lens or None, packed_seq_ids or None)``."""
    gen = torch.Generator().manual_seed({"unpacked": 1, "packed": 2}[kind])
    if kind == "unpacked":
        rows, length = UNPACKED
        x = torch.randn(rows, length, 64, generator=gen)
        return x, torch.arange(length).expand(rows, -1).contiguous(), None, None
    x = torch.randn(1, sum(PACK), 64, generator=gen)
    positions = torch.cat([torch.arange(n) for n in PACK]).unsqueeze(0)
    ids = torch.cat([torch.full((n,), d + 1) for d, n in enumerate(PACK)]).unsqueeze(0)
    return x, positions, torch.tensor([PACK]), ids


def run_builtin(config, builtin, x, positions, seq_lens, ids):
    main, compress = rotaries(config)
    batch, length, _ = x.shape
    window = config.sliding_window
    if seq_lens is None:
        mask = build_causal_padding_mask(None, length, x.dtype, x.device, batch_size=batch, sliding_window=window)
    else:
        mask = build_packed_causal_padding_mask(seq_lens, length, x.dtype, x.device, sliding_window=window)
    picked = {}
    hook = None
    if builtin.compressor is not None and builtin.compressor.indexer is not None:
        hook = builtin.compressor.register_forward_hook(lambda m, a, out: picked.update(topk=out[1]))
    try:
        out, _ = builtin(
            x, main(x, positions), attention_mask=mask, position_embeddings_compress=compress(x, positions),
            rotary_compress=compress, position_ids=positions, packed_seq_ids=ids,
        )
    finally:
        if hook is not None:
            hook.remove()
    return out, picked.get("topk")


def run_nemo(layer, x, positions, seq_lens, ids, monkeypatch):
    ratio = max(layer.ratio, 1)
    if seq_lens is None:
        meta = build_attention_metadata(compress_ratio=ratio, position_ids=positions)
    else:
        meta = build_attention_metadata(compress_ratio=ratio, position_ids=positions, seq_lens=seq_lens)
    seen = {}
    real_logits = indexer_module.v4_logits_in_ranges
    monkeypatch.setattr(indexer_module, "v4_logits_in_ranges", lambda *a, **k: seen.setdefault("logits", real_logits(*a, **k)))
    hook = None
    if layer.indexer is not None:
        hook = layer.indexer.register_forward_hook(lambda m, a, out: seen.update(topk=out.topk_indices))
    try:
        out, aux = layer(x, meta, LocalContext(), SharedLayerState())
    finally:
        if hook is not None:
            hook.remove()
        monkeypatch.setattr(indexer_module, "v4_logits_in_ranges", real_logits)
    assert aux is None
    return out, seen.get("topk"), seen.get("logits"), meta


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_no_tie_decides(logits: torch.Tensor, meta, topk: int) -> int:
    """Every query that must choose (more than T visible groups) has a clear T-th vs (T+1)-th gap."""
    checked = 0
    for b in range(logits.shape[0]):
        for i in range(logits.shape[1]):
            ks, ke = int(meta.ks[b, i]), int(meta.ke[b, i])
            if ke - ks <= topk:
                continue
            ranked = logits[b, i, ks:ke].sort(descending=True).values
            gap = float(ranked[topk - 1] - ranked[topk])
            assert gap > TIE_MARGIN * float(ranked.abs().max()), (b, i, gap)
            checked += 1
    return checked


def as_sets(indices: torch.Tensor) -> list[list[set[int]]]:
    return [[{int(j) for j in row if j >= 0} for row in rows] for rows in indices]


@pytest.mark.parametrize("kind", ["unpacked", "packed"])
@pytest.mark.parametrize("layer_idx", range(len(RATIOS)), ids=[f"ratio{r}" for r in RATIOS])
def test_matches_builtin_attention(layer_idx, kind, monkeypatch):
    config, builtin, mine, names = make_pair(layer_idx, seed=10 + layer_idx)
    assert mine.ratio == RATIOS[layer_idx] and mine.config.o_lora_rank == 16 and mine.config.o_groups == 2
    x, positions, seq_lens, ids = layout(kind)
    x_builtin, x_mine = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, ref_topk = run_builtin(config, builtin, x_builtin, positions, seq_lens, ids)
    out, topk, logits, meta = run_nemo(mine, x_mine, positions, seq_lens, ids, monkeypatch)
    assert rel(out, ref) <= RTOL, rel(out, ref)

    if RATIOS[layer_idx] == 4:
        assert assert_no_tie_decides(logits, meta, TOPK) > 100  # many queries really choose
        assert as_sets(topk) == as_sets(ref_topk)

    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7))
    (ref * weight).sum().backward()
    (out * weight).sum().backward()
    assert rel(x_mine.grad, x_builtin.grad) <= RTOL
    theirs = dict(builtin.named_parameters())
    for name, p in mine.named_parameters():
        other = theirs[names[name]]
        if ".indexer." in f".{name}":  # frozen as the built-in trains it: no gradient reaches it
            assert p.grad is None and other.grad is None, name
            continue
        assert p.grad is not None and other.grad is not None, name
        assert rel(p.grad, other.grad) <= RTOL, (name, rel(p.grad, other.grad))


def test_from_hf_config_reads_the_release_fields(caplog):
    cfg = DSAModelConfig.from_hf_config(hf_config())
    assert cfg.compress_ratios == tuple(RATIOS) and cfg.num_hidden_layers == 3
    assert (cfg.o_lora_rank, cfg.o_groups, cfg.sliding_window, cfg.index_topk) == (16, 2, 8, TOPK)
    assert (cfg.rope_theta, cfg.compress_rope_theta) == (10000.0, 160000.0)
    assert cfg.rope_scaling == YARN and cfg.indexer_straight_through is False
    # transformers' own DeepseekV4Config (layer_types + compress_rates, nested rope_parameters).
    from transformers import DeepseekV4Config as HFDeepseekV4Config

    hf = HFDeepseekV4Config(
        num_hidden_layers=3, compress_ratios=RATIOS, rope_scaling=dict(YARN), qk_rope_head_dim=64,
        o_groups=2, o_lora_rank=16, num_nextn_predict_layers=1,
    )
    same = DSAModelConfig.from_hf_config(hf, include_mtp_layers=True)
    assert same.compress_ratios == (0, 4, 128, 0) and same.num_hidden_layers == 4  # MTP layer: window-only
    assert (same.qk_rope_head_dim, same.head_dim, same.o_groups) == (64, 512, 2)
    assert same.rope_scaling == YARN and same.compress_rope_theta == 160000.0
    # One shared KV head whatever num_key_value_heads says (the built-in never reads it): the
    # value is said once in the log, and the config is the same.
    with caplog.at_level(logging.WARNING, logger="nemo_dsa"):
        other = DSAModelConfig.from_hf_config({**hf_config().to_dict(), "num_key_value_heads": 3})
    assert other == DSAModelConfig.from_hf_config(hf_config().to_dict())
    assert "num_key_value_heads=3 is not read" in caplog.text
    window_only = DSAModelConfig.from_hf_config({**hf_config().to_dict(), "compress_ratios": []})
    assert window_only.compress_ratios == (0,) * window_only.num_hidden_layers
    with pytest.raises(ValueError, match="rope_scaling"):
        DSAModelConfig.from_hf_config({**hf_config().to_dict(), "rope_scaling": {"type": "linear", "factor": 2}})


def test_release_precision_in_bf16_models():
    """Compressors (main and indexer) and sinks stay fp32 when the module is cast to bf16."""
    config = DSAModelConfig.from_hf_config(hf_config(), backend="torch")
    layer = DSASparseAttention(config, 1).to(torch.bfloat16)
    fp32 = {n for n, p in layer.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {"attn_sink", "compressor.wkv.weight", "compressor.wgate.weight", "compressor.ape",
                    "indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight", "indexer.compressor.ape"}
    x, positions, _, _ = layout("unpacked")
    meta = build_attention_metadata(compress_ratio=4, position_ids=positions)
    out, _ = layer(x.to(torch.bfloat16), meta, LocalContext(), SharedLayerState())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
