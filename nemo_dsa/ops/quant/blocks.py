"""What the block quantize-dequantize formats share: channel blocks, the power-of-two scale read
off the fp32 bits, argument checks and the straight-through gradient."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from nemo_dsa._checks import check_tensor, is_positive_int
from nemo_dsa.ops.quant.fused import fused_quant_dequant, uses_kernel

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def power_of_two_ceil(values: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= each positive, normal fp32 value, read off the fp32 bits (no
    logarithm): a value with a zero mantissa is one already, otherwise its exponent goes up by one."""
    bits = values.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def channel_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``x [..., C]`` as fp32 ``[..., ceil(C / block), block]``, a partial last block zero-filled."""
    padded = torch.nn.functional.pad(x.float(), (0, -x.shape[-1] % block_size))
    return padded.unflatten(-1, (-1, block_size))


def from_channel_blocks(blocks: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`channel_blocks`: ``like``'s channels back, in ``like``'s dtype."""
    return blocks.flatten(-2)[..., : like.shape[-1]].to(like.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, quant_dequant: Callable, block_size: int) -> torch.Tensor:
        return quant_dequant(x, block_size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None  # straight-through estimator


def straight_through_quant_dequant(
    x: torch.Tensor,
    block_size: int,
    reference: Callable[[torch.Tensor, int], torch.Tensor],
    fmt: str,
    backend: str,
) -> torch.Tensor:
    """``fmt``'s quantize-dequantize of ``x`` (its fused kernel or ``reference(x, block_size)``, as
    ``backend`` says) after checking the arguments; its gradient is the identity."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.ndim < 1:
        raise ValueError(f"x must have a channel dimension, got shape {tuple(x.shape)}")
    if not is_positive_int(block_size):
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if uses_kernel(backend, x, block_size):
        return _StraightThrough.apply(x, functools.partial(fused_quant_dequant, fmt=fmt), block_size)
    return _StraightThrough.apply(x, reference, block_size)
