"""RMS normalisation (computed in fp32, returned in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, without a learned scale."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-channel scale named ``weight`` (the checkpoint key).

    Normalised and scaled in fp32, rounded once to the input's dtype, as the released DeepSeek-V4 /
    V4.1 norms do (rounding the normalised value before the scale would round twice in bf16)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normalized = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normalized * self.weight.float()).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
