"""bf16 operands for the fp32 LM head and cuBLAS's bf16 x bf16 -> fp32 products emulated on the
CPU: float64 products (exact for two bf16 numbers) rounded to fp32, so only the order and precision
of the additions differ from the GPU's."""

from __future__ import annotations

import torch

from nemo_dsa.ops.fp32_linear import split


def _exact_then_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    assert a.dtype == b.dtype == torch.bfloat16
    return (a.double() @ b.double()).float()


EMULATED = split.Fp32OutProducts(mm=_exact_then_fp32, mm_add_=lambda acc, a, b: acc.add_(_exact_then_fp32(a, b)))


def operands(rows, inner, out, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*rows, inner, generator=gen).to(torch.bfloat16)
    # Weights over many binades, as trained heads have.
    weight = torch.randn(out, inner, generator=gen) * torch.exp2(torch.randint(-12, 4, (out, inner), generator=gen).float())
    return x, weight


def ulp_bf16(t: torch.Tensor) -> torch.Tensor:
    """One bf16 unit in the last place at each |t|."""
    exponent = torch.floor(torch.log2(t.abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)
