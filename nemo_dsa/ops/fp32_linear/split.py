"""The fp32 projection of bf16 activations on bf16 tensor cores, products exact.

DeepSeek-V4's LM head is an fp32 weight applied to the bf16 final hidden state, in fp32, its
logits rounded to bf16 (nemo-automodel's ``fp32_lm_head``). The fp32 GEMMs run on SIMT units
(~48 TFLOP/s on the H200: 273 ms of a 695 ms V4-Flash-shaped step at S = 16,384,
benchmarks/results/2026-12-01.md). Every operand that meets the weight there is bf16-exact: the hidden
state in the forward, the logits' (bf16) gradient in the backward. So the weight is written as
three bf16 pieces, ``w1 = bf16(w)``, ``w2 = bf16(w - w1)``, ``w3 = bf16(w - w1 - w2)`` (each
remainder exact in fp32; the three pieces carry its 24 significant bits, with at most 2^-27 of
``w`` left out), and each product of two bf16 numbers is exact in fp32. Three bf16 GEMMs with fp32
accumulation then give the fp32 GEMM's result up to the order of the fp32 additions, before the
same final rounding. The backward needs three for ``dx = g @ w`` and one for
``dw = g^T @ x``: seven bf16 GEMMs against three fp32 ones, at the tensor cores' rate. With fp32
logits (``out_dtype``; V4.1) their gradient is fp32 too and goes into three pieces as well: the
products of pieces that reach fp32 precision are six for dx and three for dw (twelve GEMMs).

The weight is processed in chunks of CHUNK_ROWS output rows, so the pieces and the fp32
accumulator of one chunk are all that exists beyond the inputs and outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

CHUNK_ROWS = 4096  # output features (vocabulary rows) per chunk


def bf16_pieces(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three bf16 tensors whose fp32 sum is ``weight`` (fp32) to 2^-27 relative."""
    first = weight.to(torch.bfloat16)
    rest = weight - first.float()
    second = rest.to(torch.bfloat16)
    third = (rest - second.float()).to(torch.bfloat16)
    return first, second, third


@dataclass(frozen=True)
class Fp32OutProducts:
    """Products of bf16 matrices into fp32: ``mm(a, b)`` -> a new fp32 ``a @ b``; ``mm_add_(acc, a,
    b)``: ``acc += a @ b`` in place (cuBLAS accumulates into ``acc``, no separate addition)."""

    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    mm_add_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


CUBLAS = Fp32OutProducts(
    mm=lambda a, b: torch.mm(a, b, out_dtype=torch.float32),
    mm_add_=lambda acc, a, b: torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc),
)


_FP32_OUT_MM: dict[torch.device, bool] = {}


def fp32_out_mm_available(device: torch.device) -> bool:
    """Whether this torch runs cuBLAS's bf16 x bf16 -> fp32 products (``CUBLAS``) on ``device``
    (probed once per device on 2 x 2 matrices, the result checked)."""
    if device not in _FP32_OUT_MM:
        a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.bfloat16, device=device)
        try:
            acc = CUBLAS.mm(a, a)
            CUBLAS.mm_add_(acc, a, a)
            _FP32_OUT_MM[device] = acc.dtype == torch.float32 and acc.tolist() == [[14.0, 20.0], [30.0, 44.0]]
        except (TypeError, RuntimeError, NotImplementedError):
            _FP32_OUT_MM[device] = False
    return _FP32_OUT_MM[device]


def split_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``fp32_linear_of_bf16`` takes these operands on the GPU: bf16 ``x``, a 2-D fp32
    ``weight``, both plain CUDA tensors (not DTensors: a sharded head goes through its module's
    own forward), and a torch whose cuBLAS product writes fp32 from bf16."""
    plain = all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (x, weight))
    return (
        plain and x.is_cuda and weight.device == x.device and x.dtype == torch.bfloat16
        and weight.dtype == torch.float32 and weight.ndim == 2 and x.shape[-1] == weight.shape[1]
        and fp32_out_mm_available(x.device)
    )  # fmt: skip


# Pairs (i, j) of the gradient's and the weight's bf16 pieces whose products reach fp32 precision:
# a piece's size is 2^-8 of the one before, so i + j > 2 is below 2^-24 of the leading product.
_PAIRS = [(i, j) for i in range(3) for j in range(3) if i + j <= 2]


class _Fp32LinearOfBf16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, out_dtype, products):
        rows = x.reshape(-1, x.shape[-1])
        out = rows.new_empty(rows.shape[0], weight.shape[0], dtype=out_dtype)
        for start in range(0, weight.shape[0], CHUNK_ROWS):
            chunk = slice(start, start + CHUNK_ROWS)
            first, *rest = bf16_pieces(weight[chunk])
            acc = products.mm(rows, first.t())
            for piece in rest:
                products.mm_add_(acc, rows, piece.t())
            out[:, chunk] = acc  # bf16 logits: rounded once
        ctx.save_for_backward(x, weight)
        ctx.products = products
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        products = ctx.products
        rows = x.reshape(-1, x.shape[-1])
        grad = grad.reshape(-1, weight.shape[0])
        d_rows = rows.new_zeros(rows.shape, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        d_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, weight.shape[0], CHUNK_ROWS):
            chunk = slice(start, start + CHUNK_ROWS)
            # bf16 logits have a bf16 gradient (one piece); fp32 logits' gradient takes three.
            grad_pieces = (grad[:, chunk],) if grad.dtype == torch.bfloat16 else bf16_pieces(grad[:, chunk].float())
            if d_rows is not None:
                weight_pieces = bf16_pieces(weight[chunk])
                for i, j in _PAIRS:
                    if i < len(grad_pieces):
                        products.mm_add_(d_rows, grad_pieces[i], weight_pieces[j])
            if d_weight is not None:
                first, *rest = grad_pieces
                d_weight[chunk] = products.mm(first.t(), rows)
                for piece in rest:
                    products.mm_add_(d_weight[chunk], piece.t(), rows)
        d_x = None if d_rows is None else d_rows.to(x.dtype).view(x.shape)
        return d_x, d_weight, None, None


def fp32_linear_of_bf16(
    x: torch.Tensor, weight: torch.Tensor, *, out_dtype: torch.dtype = torch.bfloat16,
    products: Fp32OutProducts = CUBLAS,
) -> torch.Tensor:  # fmt: skip
    """``x @ weight.T`` in fp32 arithmetic with exact products (``[..., out]``), in ``out_dtype``.

    Args:
        x: bf16 ``[..., in]``.
        weight: fp32 ``[out, in]``.
        out_dtype: bf16 (the value rounded once; V4's logits) or fp32 (V4.1's logits, whose fp32
            gradient then goes into three bf16 pieces too: six products for dx, three for dw).
        products: the bf16 x bf16 -> fp32 matrix products (cuBLAS's by default; the CPU tests
            pass an emulation with the same semantics).
    """
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    if weight.dtype != torch.float32 or weight.ndim != 2:
        raise TypeError(f"weight must be a 2-D float32 tensor, got {weight.dtype} with {weight.ndim} dims")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dim ({x.shape[-1]}) must equal weight's in_features ({weight.shape[1]})")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")
    return _Fp32LinearOfBf16.apply(x, weight, out_dtype, products)
