"""The tiny released structure both sides of ``nemo_dsa.integrations.side_by_side`` are built at on CPU,
shared by the tests that compare them or recompute their parts."""

from __future__ import annotations

import torch

from nemo_dsa.integrations.side_by_side import TINY_OVERRIDES as TINY  # noqa: F401 (the tests' names)
from nemo_dsa.integrations.side_by_side import TINY_SEQ as SEQ  # noqa: F401
from nemo_dsa.integrations.side_by_side import TINY_VOCAB as VOCAB  # noqa: F401


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
