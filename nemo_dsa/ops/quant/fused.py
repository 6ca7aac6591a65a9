"""Running the block quantize-dequantize on its fused Triton kernel (``kernels.py``) or the torch
reference: ``backend`` ``"auto"`` takes the kernel for CUDA tensors when Triton is importable,
``"triton"`` asks for it (CPU tensors only under ``TRITON_INTERPRET=1``, as the tests run it),
``"torch"`` the reference."""

from __future__ import annotations

import math

import torch

from nemo_dsa.ops._triton import interpreting, load_kernels, next_power_of_2

QUANT_BACKENDS = ("auto", "triton", "torch")
_ROWS_PER_PROGRAM = 16


def _kernels():
    return load_kernels("nemo_dsa.ops.quant.kernels")


def uses_kernel(backend: str, x: torch.Tensor, block_size: int) -> bool:
    """Whether ``backend`` runs the fused kernel for ``x`` in blocks of ``block_size`` (a power of
    two, as the kernel's register tiles need); a ValueError names what is missing."""
    if backend not in QUANT_BACKENDS:
        raise ValueError(f"backend must be one of {QUANT_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    power_of_two = block_size & (block_size - 1) == 0
    if backend == "auto":
        return x.is_cuda and power_of_two and _kernels() is not None
    if not power_of_two:
        raise ValueError(f"backend='triton' needs a power-of-two block_size, got {block_size}")
    if _kernels() is None:
        raise ValueError("backend='triton' needs Triton installed")
    if not x.is_cuda and not interpreting():
        raise ValueError("backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU)")
    return True


def fused_quant_dequant(x: torch.Tensor, block_size: int, fmt: str) -> torch.Tensor:
    """``fmt`` ("fp8" | "nvfp4" | "mxfp4") quantize-dequantize of ``x [..., C]`` on the kernel."""
    kernels = _kernels()
    channels = x.shape[-1]
    rows = x.numel() // channels if channels else 0
    flat = x.contiguous().view(rows, channels)
    out = torch.empty_like(flat)
    if rows:
        blocks = next_power_of_2(math.ceil(channels / block_size))
        code = {"fp8": kernels.FP8, "nvfp4": kernels.NVFP4, "mxfp4": kernels.MXFP4}[fmt]
        kernels._quant_dequant[(math.ceil(rows / _ROWS_PER_PROGRAM),)](
            flat, out, rows, channels, FORMAT=code, BLOCK=block_size, NB=blocks, BR=_ROWS_PER_PROGRAM,
        )  # fmt: skip
    return out.view_as(x)
