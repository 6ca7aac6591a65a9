"""The tiny released structure both sides of ``nemo_dsa.integrations.side_by_side`` are built at on CPU,
shared by the tests that compare them or recompute their parts, and one training step that
measures what the forward keeps."""

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


# What nemo-automodel's checkpoint wrapper adds to the names of the parameters it wraps.
WRAPPED = "._checkpoint_wrapped_module"


def step(model, family: str):
    """Loss, every parameter's gradient (by the unwrapped name) and the bytes the forward kept."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1, SEQ[family] + 1), generator=gen)
    positions = torch.arange(SEQ[family]).unsqueeze(0)
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens[:, :-1], position_ids=positions).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    grads = {name.replace(WRAPPED, ""): p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, sum(n for ptr, n in kept.items() if ptr not in parameters)
