"""The fp32 projection of bf16 activations on bf16 tensor cores, products exact.

DeepSeek-V4's LM head is an fp32 weight applied to the bf16 final hidden state, in fp32, its
logits rounded to bf16 (nemo-automodel's ``fp32_lm_head``). The fp32 GEMMs run on SIMT units
(~48 TFLOP/s on the H200: 273 ms of a 695 ms V4-Flash-shaped step at S = 16,384,
docs/performance.md v10). Every operand that meets the weight there is bf16-exact: the hidden
state in the forward, the logits' (bf16) gradient in the backward. So the weight is written as
three bf16 pieces, ``w1 = bf16(w)``, ``w2 = bf16(w - w1)``, ``w3 = bf16(w - w1 - w2)`` (each
remainder exact in fp32; the three pieces carry its 24 significant bits, with at most 2^-27 of
``w`` left out), and each product of two bf16 numbers is exact in fp32. Three bf16 GEMMs with fp32
accumulation then give the fp32 GEMM's result up to the order of the fp32 additions, before the
same final rounding. The backward needs three for ``dx = g @ w`` and one for
``dw = g^T @ x``: seven bf16 GEMMs against three fp32 ones, at the tensor cores' rate.

The weight is processed in chunks of CHUNK_ROWS output rows, so the pieces and the fp32
accumulator of one chunk are all that exists beyond the inputs and outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CHUNK_ROWS = 4096  # output features (vocabulary rows) per chunk


def bf16_pieces(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three bf16 tensors whose fp32 sum is ``weight`` (fp32) to 2^-27 relative."""
    first = weight.to(torch.bfloat16)
    rest = weight - first.float()
    second = rest.to(torch.bfloat16)
    third = (rest - second.float()).to(torch.bfloat16)
    return first, second, third


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of bf16 matrices into fp32 (cuBLAS: fp32 accumulation and output)."""
    return torch.mm(a, b, out_dtype=torch.float32)


_FP32_OUT_MM: dict[torch.device, bool] = {}


def fp32_out_mm_available(device: torch.device) -> bool:
    """Whether this torch runs bf16 x bf16 -> fp32 ``torch.mm(..., out_dtype=)`` on ``device``
    (probed once per device with a 1 x 1 product)."""
    if device not in _FP32_OUT_MM:
        one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
        try:
            _FP32_OUT_MM[device] = mm_fp32_out(one, one).dtype == torch.float32
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


class _Fp32LinearOfBf16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, mm):
        rows = x.reshape(-1, x.shape[-1])
        out = rows.new_empty(rows.shape[0], weight.shape[0])
        for start in range(0, weight.shape[0], CHUNK_ROWS):
            chunk = slice(start, start + CHUNK_ROWS)
            acc = None
            for piece in bf16_pieces(weight[chunk]):
                product = mm(rows, piece.t())
                acc = product if acc is None else acc.add_(product)
            out[:, chunk] = acc  # rounded once to bf16
        ctx.save_for_backward(x, weight)
        ctx.mm = mm
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        mm = ctx.mm
        rows = x.reshape(-1, x.shape[-1])
        grad = grad.reshape(-1, weight.shape[0]).to(torch.bfloat16)  # bf16 already: the logits' dtype
        d_rows = rows.new_zeros(rows.shape, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        d_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, weight.shape[0], CHUNK_ROWS):
            chunk = slice(start, start + CHUNK_ROWS)
            grad_chunk = grad[:, chunk]
            if d_rows is not None:
                for piece in bf16_pieces(weight[chunk]):
                    d_rows.add_(mm(grad_chunk, piece))
            if d_weight is not None:
                d_weight[chunk] = mm(grad_chunk.t(), rows)
        d_x = None if d_rows is None else d_rows.to(x.dtype).view(x.shape)
        return d_x, d_weight, None


def fp32_linear_of_bf16(
    x: torch.Tensor, weight: torch.Tensor, *, mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mm_fp32_out
) -> torch.Tensor:
    """``x @ weight.T`` in fp32 arithmetic with exact products, rounded to bf16 (``[..., out]``).

    Args:
        x: bf16 ``[..., in]``.
        weight: fp32 ``[out, in]``.
        mm: the bf16 x bf16 -> fp32 matrix product (the default is cuBLAS's; tests pass an
            emulation with the same semantics on the CPU).
    """
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    if weight.dtype != torch.float32 or weight.ndim != 2:
        raise TypeError(f"weight must be a 2-D float32 tensor, got {weight.dtype} with {weight.ndim} dims")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dim ({x.shape[-1]}) must equal weight's in_features ({weight.shape[1]})")
    return _Fp32LinearOfBf16.apply(x, weight, mm)
