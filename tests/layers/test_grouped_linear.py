"""``GroupedLinear``'s own Function against its ``einsum`` reference: values and gradients on
fresh random inputs (several batch shapes, group counts, bf16 and fp32), the fallbacks, and bad
configurations named."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import stable_seed
from nemo_dsa.layers.grouped_linear import GroupedLinear

CASES = [((2, 37), 8, 64, 128), ((1, 1), 1, 16, 8), ((3, 5), 4, 32, 96), ((11,), 2, 48, 16)]


def module_and_inputs(lead, groups, in_per_group, out_features, dtype):
    gen = torch.Generator().manual_seed(stable_seed((lead, groups, in_per_group, out_features, str(dtype))))
    module = GroupedLinear(in_per_group, out_features, groups).to(dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.2)
    x = torch.randn(*lead, groups * in_per_group, generator=gen).to(dtype)
    grad = torch.randn(*lead, out_features, generator=gen).to(dtype)
    return module, x, grad


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_matches_the_einsum_and_its_gradients(case, dtype, device):
    module, x, grad = module_and_inputs(*case, dtype)
    module, x, grad = module.to(device), x.to(device), grad.to(device)
    results = []
    for forward in (module.forward, module.reference):
        module.weight.grad = None
        inputs = x.clone().requires_grad_()
        out = forward(inputs)
        out.backward(grad)
        results.append((out, inputs.grad, module.weight.grad))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for mine, ref in zip(*results):
        assert mine.dtype == ref.dtype and mine.shape == ref.shape
        torch.testing.assert_close(mine, ref, **tol)
    # each group sees only its own slice: zeroing group 0's input leaves the other groups' outputs
    out = module(x)
    cut = x.clone()
    cut[..., : case[2]] = 0
    groups, width = case[1], case[3] // case[1]
    if groups > 1:
        torch.testing.assert_close(module(cut)[..., width:], out[..., width:], rtol=0, atol=0)


def test_fallbacks_are_the_reference():
    module, x, _ = module_and_inputs((4, 3), 2, 8, 12, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert module(x).dtype == module.reference(x).dtype == torch.bfloat16
    torch.testing.assert_close(module(x.double().float()), module.reference(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError):
        module(x.bfloat16())  # mixed dtypes go to the einsum, which names the mismatch


def test_groups_must_divide_the_outputs():
    with pytest.raises(ValueError, match="groups must be >= 1 and divide out_features"):
        GroupedLinear(8, 10, 3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transformed_input_is_kept_untransformed_with_the_same_values_and_gradients(dtype, device):
    """``forward(x, rope_back)`` against ``forward(rope_back(x))``: bitwise values and gradients
    (the same ops in the same order), and the rotated copy is not what the backward keeps."""
    from nemo_dsa.layers.rope import apply_rope, rope_angles

    heads, head_dim = 4, 64
    module, x, grad = module_and_inputs((2, 23), 8, heads * head_dim // 8, 48, dtype)
    module, x, grad = module.to(device), x.to(device), grad.to(device)
    gen = torch.Generator().manual_seed(stable_seed(("positions", str(dtype))))
    angles = rope_angles(torch.randint(0, 65536, (2, 23), generator=gen), 16, 10000.0).to(device)

    def rotate_back(flat):
        return apply_rope(flat.unflatten(-1, (heads, head_dim)), angles, inverse=True).flatten(2)

    results, kept = [], []
    for fused in (True, False):
        module.weight.grad = None
        inputs = x.clone().requires_grad_()
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            out = module(inputs, rotate_back) if fused else module(rotate_back(inputs))
        out.backward(grad)
        results.append((out, inputs.grad, module.weight.grad))
        kept.append({t.untyped_storage().data_ptr() for t in packed if t.shape == x.shape})
        assert (inputs.untyped_storage().data_ptr() in kept[-1]) == fused
    for mine, ref in zip(*results):
        assert torch.equal(mine, ref)
    assert len(kept[0]) == 1  # only x itself, no rotated copy
