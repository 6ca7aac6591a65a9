"""Scores as unsigned integers of the same order ("images"), shared by the radix select, which
ranks keys by them, and the V4.1 scorer, which writes each row's largest one for the select.

A finite score maps to an image >= 1 whose integer order is the scores' order (+0 and -0 share
one image); NaN and +-inf map to 0, which the select never takes (docs/semantics.md, "Top-k
selection": only finite scores are selected).
"""

import torch

from nemo_dsa.ops._tilelang import tilelang


# (sign, magnitude, exponent) bit masks of fp32 and bf16
_MASKS = {32: (0x80000000, 0x7FFFFFFF, 0x7F800000), 16: (0x8000, 0x7FFF, 0x7F80)}


def score_image(x, score_bits: int):
    """TileLang expression: the order-preserving unsigned image of score ``x`` (fp32 or bf16); 0
    for NaN/+-inf. Branch-free: negatives flip every bit, non-negatives set the sign bit, -0 moves
    up one to +0's image."""
    T = tilelang().language
    u32 = T.uint32
    sign, magnitude, exponent = _MASKS[score_bits]
    bits = T.cast(T.reinterpret(x, T.uint32 if score_bits == 32 else T.uint16), u32)
    image = bits ^ (((bits >> (score_bits - 1)) * magnitude) | sign)
    image = image + T.cast(bits == sign, u32)
    return image * T.cast((bits & exponent) != exponent, u32)


def bf16_images(scores: torch.Tensor) -> torch.Tensor:
    """``score_image`` of bf16 ``scores`` in torch (int32): the reference of the tops tests."""
    bits = scores.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    image = torch.where(bits >= 0x8000, bits ^ 0xFFFF, bits | 0x8000) + (bits == 0x8000).to(torch.int32)
    return torch.where((bits & 0x7F80) == 0x7F80, 0, image)
