"""RMS normalisation (computed in fp32, returned in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn


class _RMSNormFunction(torch.autograd.Function):
    """``x / rms(x)`` (times ``weight`` if given) in fp32, rounded once to ``x``'s dtype.

    The forward is the plain formula, op for op. The backward is written out so that only ``x``
    (in its own dtype) and the fp32 ``1 / rms`` per row are kept: autograd through the formula
    keeps ``x``'s fp32 copy instead, which for V4's per-head q norm (64 heads of 512) is 128 KiB a
    token a layer, twice the bf16 q itself.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        normalized = xf * rstd
        if weight is not None:
            normalized = normalized * weight.float()
        ctx.save_for_backward(x, weight, rstd)
        return normalized.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normalized = torch.mul(x, rstd)  # fp32 by type promotion: x.float() * rstd, without the copy
        grad = grad.float()
        d_weight = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                d_weight = (grad * normalized).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
            grad = grad * weight.float()
        d_x = None
        if ctx.needs_input_grad[0]:
            # d(x * rstd)/dx applied to grad: rstd * (grad - normalized * mean(grad * normalized)).
            dot = (grad * normalized).mean(-1, keepdim=True)
            d_x = torch.addcmul(grad, normalized, dot, value=-1).mul_(rstd).to(x.dtype)
        return d_x, d_weight, None


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, without a learned scale."""
    return _RMSNormFunction.apply(x, None, eps)


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-channel scale named ``weight`` (the checkpoint key).

    Normalised and scaled in fp32, rounded once to the input's dtype, as the released DeepSeek-V4 /
    V4.1 norms do (rounding the normalised value before the scale would round twice in bf16)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
