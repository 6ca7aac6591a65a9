"""A LoRA-wrapped model's adapter parameters and their gradients of one probed forward."""

from __future__ import annotations

import torch


def adapter_names(model) -> list[str]:
    return sorted(n for n, _ in model.named_parameters() if "lora_" in n)


def adapter_gradients(model, ids: torch.Tensor, probe: torch.Tensor) -> dict:
    model.train()
    model.zero_grad(set_to_none=True)
    (model(input_ids=ids).logits * probe).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    model.eval()
    return grads
