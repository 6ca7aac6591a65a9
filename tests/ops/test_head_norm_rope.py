"""V4's per-head q RMS norm + RoPE (``ops/head_norm_rope``) on the CPU: the reference is the
layer's eager composition bit for bit, every kernel configuration lowers for sm_90a (16-byte loads,
a block all-reduce, shared memory far below the limit) and one compiles with nvcc, and the op
validates its inputs. The kernels' numbers are checked on the GPU (tests/ops/test_head_norm_rope_gpu.py)."""

import shutil

import pytest
import torch

from _support.helpers import stable_seed
from nemo_dsa.layers.norm import rms_normalize
from nemo_dsa.layers.rope import apply_rope, rope_angles
from nemo_dsa.ops._tilelang import HOPPER_SMEM_LIMIT, dynamic_shared_memory_bytes, lower_to_cuda_source
from nemo_dsa.ops.head_norm_rope import head_rms_rope, head_rms_rope_reference
from nemo_dsa.ops.head_norm_rope import kernels

EPS = 1e-6


def inputs(batch, seq, heads, dim, rope_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(batch, seq, heads, 1, generator=gen))
    x = (torch.randn(batch, seq, heads, dim, generator=gen) * scale).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (batch, seq), generator=gen)
    return x, rope_angles(positions, rope_dim, 10000.0)


@pytest.mark.parametrize("batch, seq, heads, dim, rope_dim", [(2, 37, 3, 64, 16), (1, 9, 8, 512, 64), (3, 5, 1, 128, 0)])
def test_reference_is_the_layers_eager_ops(batch, seq, heads, dim, rope_dim):
    x, angles = inputs(batch, seq, heads, dim, rope_dim, stable_seed((batch, seq, heads, dim)))
    x_ref, x_layer = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = head_rms_rope_reference(x_ref, angles, EPS)
    layer = apply_rope(rms_normalize(x_layer, EPS), angles)
    assert torch.equal(ref, layer)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ref.backward(grad)
    layer.backward(grad)
    # The layer's norm has its own backward (layers/norm.py): the same math, fp32 rounding apart.
    torch.testing.assert_close(x_layer.grad.float(), x_ref.grad.float(), rtol=2**-7, atol=1e-6)


CONFIGS = [(dim, rope, heads) for dim, rope in ((512, 64), (128, 64), (256, 0)) for heads in (4, 2, 1)]


def _lower(config):
    dim, rope, block_heads = config
    out = {}
    for name, factory in (("forward", kernels.forward_kernel), ("backward", kernels.backward_kernel)):
        kernel = factory(dim, rope, block_heads)
        out[name] = (lower_to_cuda_source(kernel), dynamic_shared_memory_bytes(kernel))
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=[f"d{d}-r{r}-bh{b}" for d, r, b in CONFIGS])
def test_kernels_lower_for_hopper(config):
    dim, _rope, block_heads = config
    for name, (source, smem) in _lower(config).items():
        assert f"__launch_bounds__({kernels.THREADS}" in source, name
        assert "tl::AllReduce<tl::SumOp" in source, name  # the row's sum across the block's threads
        assert smem <= 3 * block_heads * dim * 4 + 4096 < HOPPER_SMEM_LIMIT, (name, smem)
        if dim * block_heads >= 8 * kernels.THREADS:
            assert "uint4" in source, name  # 16-byte loads of 8 bf16
        assert "rsqrtf" in source if name == "forward" else "rsqrtf" not in source


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build cubins")
def test_kernels_compile_to_cubins():
    from nemo_dsa.ops._tilelang import compile_cubin

    for factory in (kernels.forward_kernel, kernels.backward_kernel):
        assert "head_rms_rope" in compile_cubin(factory(512, 64, 4)).get_kernel_source()


def test_block_heads_stay_within_one_token_and_shapes_are_checked():
    assert [kernels.block_heads_for(h) for h in (1, 2, 3, 4, 6, 64, 128, 127)] == [1, 2, 1, 4, 2, 4, 4, 1]
    assert kernels.supports(512, 64) and kernels.supports(128, 0)
    assert not kernels.supports(192, 64) and not kernels.supports(512, 63) and not kernels.supports(128, 256)


def test_bad_inputs_are_named():
    x, angles = inputs(1, 4, 2, 64, 16, 0)
    with pytest.raises(ValueError, match="x must have 4 dimensions"):
        head_rms_rope(x[0], angles, EPS)
    with pytest.raises(ValueError, match="angles must have shape"):
        head_rms_rope(x, angles[:, :3], EPS)
    with pytest.raises(ValueError, match="more than x's head dim"):
        head_rms_rope(x[..., :8], angles, EPS)
    with pytest.raises(TypeError, match="eps"):
        head_rms_rope(x, angles, "1e-6")
    with pytest.raises(ValueError, match="needs CUDA"):
        head_rms_rope(x, angles, EPS, backend="tilelang")
    assert torch.equal(head_rms_rope(x, angles, EPS), head_rms_rope_reference(x, angles, EPS))  # CPU: reference
