"""Write a tiny DeepSeek-V4 checkpoint in the released HF layout, for the plugin fine-tuning example.

The model has the released model's shape at toy width: hyper-connections (hc_mult 4), a small
MoE (4 routed experts, 2 active, 1 shared; the first layer hash-routed), compress ratios
0 / 4 / 128 / 4 with one MTP layer, the grouped output projection (o_groups 2) and YaRN on the
compressed layers. Weights are random (nemo-automodel's initialisation), in bf16, written by
nemo-automodel's own DeepSeek-V4 state-dict adapter, so the directory looks like a released
checkpoint: ``config.json`` (``model_type: deepseek_v4``, ``architectures:
[DeepseekV4ForCausalLM]``), ``model.safetensors`` under the released key names and a byte-level
tokenizer.

Usage (then see deepseek_v4_plugin_tiny_ft.yaml):
    python examples/automodel/write_tiny_v4_checkpoint.py --output /tmp/nemo_dsa_tiny_v4
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

VOCAB_SIZE = 259  # nemo_dsa.data.ByteTokenizer: 256 bytes + BOS / EOS / PAD


def tiny_v4_config():
    from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=32,
        o_lora_rank=16, o_groups=2, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        compress_ratios=[0, 4, 128, 4, 0], sliding_window=16, num_hash_layers=1, hc_mult=4,
        index_n_heads=8, index_head_dim=32, index_topk=8, num_nextn_predict_layers=1,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=512, bos_token_id=256, eos_token_id=257, torch_dtype="bfloat16",
        architectures=["DeepseekV4ForCausalLM"],
    )  # fmt: skip


def write_tiny_v4_checkpoint(output: str | Path, seed: int = 0, hash_layers: int | None = None) -> Path:
    """Write the checkpoint into ``output`` (created if needed) and return its path;
    ``hash_layers`` replaces the config's ``num_hash_layers`` (1)."""
    from safetensors.torch import save_file

    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    config = tiny_v4_config()
    if hash_layers is not None:
        config.num_hash_layers = hash_layers
    torch.manual_seed(seed)
    backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch", rope_fusion=False,
                            enable_hf_state_dict_adapter=True, dispatcher="torch", experts="torch_mm")  # fmt: skip
    model = DeepseekV4ForCausalLM(config, backend=backend)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    tensors = model.state_dict_adapter.to_hf(model.state_dict())
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    save_file(tensors, str(output / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(output)
    write_byte_tokenizer(output)
    return output


def write_byte_tokenizer(output: Path) -> None:
    """An HF tokenizer with nemo_dsa.data.ByteTokenizer's ids (bytes 0-255, BOS 256, EOS 257, PAD 258).

    The recipe reads the checkpoint's tokenizer (for its padding id); the example's dataset
    tokenises with ByteTokenizer itself.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({"<s>": 256, "</s>": 257, "<pad>": 258})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="directory to write (outside the repository)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = write_tiny_v4_checkpoint(args.output, seed=args.seed)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
