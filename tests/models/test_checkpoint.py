"""safetensors checkpoints with DeepSeek-V4 key names."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from nemo_dsa.models.dsa_lm.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig
from nemo_dsa.models.dsa_lm.modeling import DSAForCausalLM

CONFIG = dict(
    vocab_size=40, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, head_dim=32, qk_rope_head_dim=16,
    q_lora_rank=16, intermediate_size=48, compress_ratios=(0, 4, 8), index_n_heads=4, index_head_dim=32,
    index_topk=2, sliding_window=4, backend="torch",
)


def model(seed: int, **overrides) -> DSAForCausalLM:
    torch.manual_seed(seed)
    return DSAForCausalLM(DSAModelConfig(**{**CONFIG, **overrides}))


def test_round_trip(tmp_path):
    src, dst = model(0), model(1)
    path = save_checkpoint(src, tmp_path)  # a directory gets model.safetensors
    assert path.endswith("model.safetensors")
    load_checkpoint(dst, path)
    for key, value in src.state_dict().items():
        assert torch.equal(value, dst.state_dict()[key]), key
    ids = torch.randint(0, 40, (1, 17))
    torch.testing.assert_close(src(ids).logits, dst(ids).logits, rtol=0, atol=0)


def test_deepseek_key_names(tmp_path):
    keys = set(read_checkpoint(save_checkpoint(model(0), tmp_path / "m.safetensors")))
    for name in (
        "embed.weight", "norm.weight", "head.weight", "layers.0.attn_norm.weight", "layers.0.ffn_norm.weight",
        "layers.0.ffn.w1.weight", "layers.0.ffn.w2.weight", "layers.0.ffn.w3.weight",
        "layers.1.attn.wq_a.weight", "layers.1.attn.q_norm.weight", "layers.1.attn.wq_b.weight",
        "layers.1.attn.wkv.weight", "layers.1.attn.kv_norm.weight", "layers.1.attn.wo.weight",
        "layers.1.attn.attn_sink", "layers.1.attn.compressor.wkv.weight", "layers.1.attn.compressor.wgate.weight",
        "layers.1.attn.compressor.ape", "layers.1.attn.compressor.norm.weight", "layers.1.attn.indexer.wq_b.weight",
        "layers.1.attn.indexer.weights_proj.weight", "layers.1.attn.indexer.compressor.wkv.weight",
        "layers.1.attn.indexer.compressor.ape", "layers.2.attn.compressor.ape",
    ):
        assert name in keys, name
    assert not any(k.startswith("layers.0.attn.compressor") or k.startswith("layers.2.attn.indexer") for k in keys)


def test_load_hand_written_state_dict(tmp_path):
    """A file written by hand (not by save_checkpoint) with the DeepSeek names loads."""
    target = model(0)
    torch.manual_seed(7)
    tensors = {k: torch.randn_like(v) for k, v in target.state_dict().items()}
    tensors["layers.1.attn.wq_a.weight"] = tensors["layers.1.attn.wq_a.weight"].to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "hand.safetensors"))
    load_checkpoint(target, tmp_path / "hand.safetensors")
    assert torch.equal(target.layers[1].attn.compressor.ape, tensors["layers.1.attn.compressor.ape"])
    assert torch.equal(target.layers[1].attn.wq_a.weight, tensors["layers.1.attn.wq_a.weight"].float())
    assert target.layers[1].attn.wq_a.weight.dtype == torch.float32


def test_tied_embeddings_stored_once(tmp_path):
    src = model(0, tie_word_embeddings=True)
    keys = set(read_checkpoint(save_checkpoint(src, tmp_path / "t.safetensors")))
    assert "head.weight" not in keys and "embed.weight" in keys
    dst = load_checkpoint(model(1, tie_word_embeddings=True), tmp_path / "t.safetensors")
    assert torch.equal(dst.head.weight, src.embed.weight)


def test_mismatches_raise(tmp_path):
    src = model(0)
    tensors = dict(src.state_dict())
    missing = {k: v for k, v in tensors.items() if k != "norm.weight"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="norm.weight"):
        load_checkpoint(model(1), tmp_path / "missing.safetensors")
    load_checkpoint(model(1), tmp_path / "missing.safetensors", strict=False)
    wrong = {**tensors, "embed.weight": torch.zeros(41, 32)}
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ValueError, match="embed.weight"):
        load_checkpoint(model(1), tmp_path / "wrong.safetensors")
    with pytest.raises(FileNotFoundError, match="path"):
        load_checkpoint(model(1), tmp_path / "nothing.safetensors")


def test_released_attention_round_trip_in_bf16(tmp_path):
    """The released output projection (wo_a, wo_b) under its checkpoint names; a bf16 model keeps
    its fp32 compressors and sinks through save and load."""
    released = dict(o_lora_rank=8, o_groups=2, compress_rope_theta=160000.0,
                    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 16})
    src, dst = model(0, **released).to(torch.bfloat16), model(1, **released).to(torch.bfloat16)
    keys = set(read_checkpoint(save_checkpoint(src, tmp_path)))
    assert {"layers.1.attn.wo_a.weight", "layers.1.attn.wo_b.weight"} <= keys
    assert not any(".attn.wo." in k for k in keys)
    load_checkpoint(dst, tmp_path)
    assert dst.layers[1].attn.wo_a.weight.shape == (2 * 8, 2 * 32 // 2)
    assert dst.layers[1].attn.attn_sink.dtype == dst.layers[1].attn.compressor.ape.dtype == torch.float32
    assert dst.layers[1].attn.wq_a.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 40, (1, 17))
    torch.testing.assert_close(src(ids).logits, dst(ids).logits, rtol=0, atol=0)
