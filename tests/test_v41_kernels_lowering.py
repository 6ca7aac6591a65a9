"""V4.1 scorer kernels on the CPU: every dispatchable configuration lowers for sm_90a with wgmma
and fits Hopper's shared memory; a few compile to cubins with nvcc; the wrappers validate inputs."""

import shutil

import pytest
import torch
from _lowering import map_in_workers

from nemo_dsa.ops.v41_indexer import kernels
from nemo_dsa.ops.v41_indexer.kernels import (
    HOPPER_SMEM_LIMIT,
    dispatched_configs,
    kernel_index_dim,
    mask_ranges,
    scorer_config,
    v41_scorer_kernel,
)

# nvcc builds for one representative of each tile shape (D = 64/128/256, few and many heads).
CUBIN_CONFIGS = [(64, 128), (8, 256), (128, 64)]


def _lower(config):
    """(config, wgmma in source, dynamic shared memory bytes) for one configuration."""
    from nemo_dsa.ops._tilelang import lower

    artifact = lower(v41_scorer_kernel(**config.kernel_kwargs()), pass_configs=config.pass_configs())
    sizes = [0]
    for _, func in artifact.device_mod.functions.items():
        if func.attrs is not None and "dyn_shared_memory_buf" in func.attrs:
            sizes.append(int(func.attrs["dyn_shared_memory_buf"]))
    return config, "wgmma" in str(artifact.kernel_source), max(sizes)


def test_every_dispatched_config_lowers_with_wgmma_and_fits_shared_memory():
    configs = dispatched_configs()
    assert len(configs) == len(set(configs)) == len(kernels.SUPPORTED_HEADS) * len(kernels.KERNEL_DIMS)
    results = map_in_workers(_lower, configs)
    for config, has_wgmma, smem in results:
        assert has_wgmma, f"{config}: no wgmma in the generated CUDA"
        assert 0 < smem <= HOPPER_SMEM_LIMIT, f"{config}: {smem} bytes of dynamic shared memory"
        assert smem >= config.shared_memory_bytes(), f"{config}: tiles need more than {smem} bytes"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build cubins")
@pytest.mark.parametrize("heads,dim", CUBIN_CONFIGS)
def test_representative_configs_compile_to_cubin(heads, dim):
    from nemo_dsa.ops._tilelang import compile_cubin

    config = scorer_config(heads, dim)
    kernel = compile_cubin(v41_scorer_kernel(**config.kernel_kwargs()), pass_configs=config.pass_configs())
    assert "wgmma" in kernel.get_kernel_source()


def test_index_dims_map_to_kernel_dims():
    assert [kernel_index_dim(d) for d in (16, 64, 80, 128, 144, 256)] == [64, 64, 128, 128, 256, 256]
    with pytest.raises(ValueError, match="index_dim"):
        kernel_index_dim(272)
    with pytest.raises(ValueError, match="heads"):
        scorer_config(48, 128)
    with pytest.raises(ValueError, match="index_dim"):
        scorer_config(64, 96)


def test_mask_ranges_bracket_every_allowed_key():
    gen = torch.Generator().manual_seed(0)
    allowed = torch.rand(3, 50, 37, generator=gen) < 0.2
    allowed[0, :4] = False  # rows that see nothing
    allowed[1, 7] = False
    allowed[1, 7, 36] = True  # a lone last key
    ks, ke = mask_ranges(allowed, chunk=16)
    assert ks.dtype == ke.dtype == torch.int32
    for b in range(3):
        for s in range(50):
            keys = allowed[b, s].nonzero().flatten()
            if keys.numel():
                assert (int(ks[b, s]), int(ke[b, s])) == (int(keys[0]), int(keys[-1]) + 1)
            else:
                assert int(ks[b, s]) == int(ke[b, s]) == 0


def _qkw(batch=1, queries=5, heads=8, dim=64, num_keys=3, dtype=torch.bfloat16):
    return (
        torch.randn(batch, queries, heads, dim).to(dtype),
        torch.randn(batch, num_keys, dim).to(dtype),
        torch.randn(batch, queries, heads).to(dtype),
    )


def test_wrappers_reject_bad_inputs():
    ks = ke = torch.zeros(1, 5, dtype=torch.int32)
    q, k, w = _qkw(dtype=torch.float32)
    with pytest.raises(TypeError, match="q must have dtype bfloat16"):
        kernels.v41_scores_tilelang(q, k, w, ks, ke)
    q, k, w = _qkw()
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        kernels.v41_scores_tilelang(q, k, w, ks, ke)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        kernels.v41_scores_masked_tilelang(q, k, w, torch.ones(1, 5, 3, dtype=torch.bool))
