"""The reference: the projection in fp32 (what nemo-automodel's ``fp32_lm_head`` does), rounded
once to the input's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fp32_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x.float() @ weight.float().T``, returned in ``x``'s dtype."""
    return F.linear(x.float(), weight.float()).to(x.dtype)
