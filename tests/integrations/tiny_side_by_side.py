"""The tiny released structure both sides of ``nemo_dsa.integrations.side_by_side`` are built at on CPU,
shared by the tests that compare them or recompute their parts."""

from __future__ import annotations

import torch

VOCAB = 64
SEQ = {"v41": 64, "v4": 256}  # V4: two ratio-128 groups; V4.1: 16 candidate blocks of 4, 3 kept
TINY = {  # the released structure at toy widths (attention: 4 heads of 32, top-6, window 8)
    "v4": dict(hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16,
               q_lora_rank=32, o_lora_rank=16, o_groups=2, sliding_window=8, index_n_heads=16, index_head_dim=32,
               index_topk=6),
    "v41": dict(hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16,
                q_lora_rank=32, o_lora_rank=16, o_groups=2, sliding_window=8, index_n_heads=8, index_head_dim=32,
                index_topk=6, candidate_topk_blocks=3, candidate_block_size=4),
}  # fmt: skip


def redraw_attention_(model, family: str, seed: int) -> None:
    """Attention weights large enough that attention decides the loss (norm scales near 1), and
    an LM head of unit-size logits, so the loss is far from the uniform log(vocab)."""
    gen = torch.Generator().manual_seed(seed)
    marker = ".self_attn." if family == "v4" else ".attn."
    with torch.no_grad():
        for name, p in model.named_parameters():
            if marker in name:
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1 + 0.1 * noise if "norm" in name and p.ndim == 1 else noise * (0.5 if p.ndim == 1 else 0.15))
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen))
