"""The TileLang block maxima of the V4.1 candidate blocks on the CPU: every built configuration
(fp32 and bf16, the released block size and an odd one) lowers for sm_90a with no shared memory
and the exponent-mask finiteness test, one compiles to a cubin with nvcc, and the wrapper and
the opt-in switch validate and dispatch."""

import shutil

import pytest
import torch

from nemo_dsa.ops._tilelang import dynamic_shared_memory_bytes, lower_to_cuda_source
from nemo_dsa.ops.v41_indexer import candidates
from nemo_dsa.ops.topk.block_kernels import BLOCK_SIZES, THREADS, block_maxima_kernel, block_maxima_tilelang

CONFIGS = [(dtype, size) for dtype in ("float32", "bfloat16") for size in (*BLOCK_SIZES, 3)]


@pytest.mark.parametrize("dtype,block_size", CONFIGS)
def test_block_maxima_lower_for_hopper(dtype, block_size):
    kernel = block_maxima_kernel(dtype, block_size)
    source = lower_to_cuda_source(kernel)
    assert dynamic_shared_memory_bytes(kernel) == 0
    assert f"__launch_bounds__({THREADS}" in source
    mask = "(uint)2139095040" if dtype == "float32" else "(ushort)32640"  # the exponent bits
    assert mask in source, source[-3000:]
    assert f"j < {block_size}" in source  # one thread walks its block's keys
    assert "__syncthreads" not in source


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build cubins")
def test_block_maxima_compile_to_cubin():
    from nemo_dsa.ops._tilelang import compile_cubin

    assert "block_maxima" in compile_cubin(block_maxima_kernel("bfloat16", 8)).get_kernel_source()


def test_block_maxima_wrapper_validates():
    scores = torch.randn(4, 16)
    ks, ke = torch.zeros(4, dtype=torch.int32), torch.full((4,), 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA tensor"):
        block_maxima_tilelang(scores, ks, ke, 8, 2)
    with pytest.raises(TypeError, match="scores"):
        block_maxima_tilelang(scores.double(), ks, ke, 8, 2)
    with pytest.raises(ValueError, match="block_size"):
        block_maxima_kernel("bfloat16", 0)


def test_cpu_scores_take_the_torch_table():
    """CPU scores: the torch table serves them (the kernel is CUDA only)."""
    assert not candidates.uses_maxima_kernel(torch.bfloat16, torch.device("cpu"), "auto")
    assert candidates.uses_maxima_kernel(torch.bfloat16, torch.device("cuda"), "auto")
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(-4, 5, (2, 9, 40), generator=g).bfloat16()
    ks = torch.randint(0, 20, (2, 9), generator=g).int()
    ke = (ks + torch.randint(0, 21, (2, 9), generator=g)).int()
    got = candidates.candidate_blocks(scores, ks, ke, 8, 3)
    assert torch.equal(got, candidates.candidate_blocks(scores, ks, ke, 8, 3, backend="torch"))
    from nemo_dsa.ops.topk import candidate_blocks_reference

    assert torch.equal(got, candidate_blocks_reference(scores, ks, ke, 8, 3))
