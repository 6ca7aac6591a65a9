"""``apply_rope``'s own autograd Function against the plain-op reference (``apply_rope_reference``).

Values must be bitwise the reference's; the input gradient too (the same fp32 products and
roundings; zeros may differ in sign only, which ``torch.equal`` does not see). Fresh random inputs
of very different scales, bf16 and fp32, one or several head axes, rope widths 0 to the whole row,
both directions, a non-contiguous gradient; angles that need a gradient take the reference."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import stable_seed
from nemo_dsa.layers.rope import apply_rope, apply_rope_reference, rope_angles

CASES = [  # (batch, seq, heads or None, dim, rope_dim)
    (1, 1, None, 512, 64), (2, 37, None, 64, 16), (3, 19, 5, 128, 64), (1, 50, 64, 64, 64), (2, 7, 3, 32, 0),
]  # fmt: skip


def inputs(batch, seq, heads, dim, rope_dim, dtype):
    gen = torch.Generator().manual_seed(stable_seed((batch, seq, heads, dim, rope_dim, str(dtype))))
    shape = (batch, seq, dim) if heads is None else (batch, seq, heads, dim)
    scale = torch.exp(2 * torch.randn(*shape[:-1], 1, generator=gen))
    x = (torch.randn(shape, generator=gen) * scale).to(dtype)
    positions = torch.randint(0, 65536, (batch, seq), generator=gen)
    grad = torch.randn(shape, generator=gen).to(dtype)
    return x, rope_angles(positions, rope_dim, 160000.0), grad


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_values_and_gradient_are_the_references(case, dtype, inverse, device):
    x, angles, grad = (t.to(device) for t in inputs(*case, dtype))
    mine, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = apply_rope(mine, angles, inverse=inverse)
    expected = apply_rope_reference(ref, angles, inverse=inverse)
    assert out.dtype == x.dtype and out.is_contiguous()
    assert torch.equal(out, expected)
    # a transposed (non-contiguous) gradient, as a consumer's backward may hand it over
    g = grad.transpose(0, 1).contiguous().transpose(0, 1)
    out.backward(g)
    expected.backward(g)
    assert torch.equal(mine.grad, ref.grad)
    if case[-1]:
        assert not torch.equal(out, x)  # the rotation did something


def test_rotates_only_the_trailing_channels_and_inverts():
    x, angles, _ = inputs(2, 11, 4, 128, 64, torch.float32)
    out = apply_rope(x, angles)
    assert torch.equal(out[..., :64], x[..., :64]) and not torch.equal(out[..., 64:], x[..., 64:])
    torch.testing.assert_close(apply_rope(out, angles, inverse=True), x, rtol=1e-5, atol=1e-5)


def test_angles_that_need_a_gradient_get_one():
    x, angles, grad = inputs(1, 9, None, 32, 16, torch.float32)
    angles.requires_grad_()
    apply_rope(x, angles).backward(grad)
    assert angles.grad is not None and angles.grad.abs().sum() > 0


def test_the_backward_keeps_no_copy_of_the_input():
    x, angles, _ = inputs(1, 64, 8, 512, 64, torch.bfloat16)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        apply_rope(x.requires_grad_(), angles)
    assert sum(t.numel() * t.element_size() for t in kept) < x.numel() * x.element_size() / 8
