"""The optimizer (AdamW, decay on matrices only) and the warmup + cosine schedule."""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier for optimizer step ``step`` (0-based): linear warmup, then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, recipe) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with weight decay on matrices only (group 0), none on the rest (group 1), and the
    warmup+cosine schedule. The schedule reads ``recipe`` at every step, so a resumed run's
    ``warmup_steps``/``max_steps``/``min_lr_ratio`` take effect."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr, betas=tuple(recipe.betas),
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: warmup_cosine(
            s, warmup_steps=recipe.warmup_steps, max_steps=recipe.max_steps, min_lr_ratio=recipe.min_lr_ratio
        ),
    )
    return optimizer, schedule


def apply_recipe(optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LambdaLR, recipe) -> None:
    """Put this run's hyperparameters into a restored optimizer and schedule.

    ``load_state_dict`` brings back the saved lr, betas and weight decay of every param group and
    the saved base lrs; without this a resumed run would silently keep the old values.
    """
    for i, group in enumerate(optimizer.param_groups):
        group["initial_lr"] = recipe.lr
        group["betas"] = tuple(recipe.betas)
        group["weight_decay"] = recipe.weight_decay if i == 0 else 0.0
    schedule.base_lrs = [recipe.lr] * len(optimizer.param_groups)
    factor = schedule.lr_lambdas[0](schedule.last_epoch)
    for group in optimizer.param_groups:
        group["lr"] = recipe.lr * factor
    schedule._last_lr = [g["lr"] for g in optimizer.param_groups]
