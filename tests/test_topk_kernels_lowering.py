"""TileLang radix select on the CPU: every configuration the lowering table names lowers for
sm_90a within Hopper's shared memory, with a shared-memory histogram, no barrier inside the
histogram passes' key loops and warp ballots in the gather; one compiles to a cubin with nvcc;
the wrapper and the dispatcher validate their inputs."""

import shutil
from dataclasses import asdict

import pytest
import torch
from _lowering import map_in_workers

from nemo_dsa.ops._tilelang import HOPPER_SMEM_LIMIT
from nemo_dsa.ops.topk.interface import select_topk
from nemo_dsa.ops.topk.kernels import (
    MAX_COUNT,
    RADIX_BITS,
    SCORE_BITS,
    SelectConfig,
    dispatched_configs,
    radix_select_kernel,
    select_config,
    select_rows_tilelang,
    sort_slots,
)


def _barriers_per_key_loop(source: str) -> list[int]:
    """``__syncthreads`` count inside each per-key loop (``for (int it...``) of the kernel, in order."""
    counts, depth, open_at = [], 0, None
    for line in source.splitlines():
        if open_at is None and "for (int it" in line:
            open_at = depth
            counts.append(0)
        elif open_at is not None and "__syncthreads" in line:
            counts[-1] += 1
        depth += line.count("{") - line.count("}")
        if open_at is not None and depth <= open_at:
            open_at = None
    return counts


def _lower(config):
    from nemo_dsa.ops._tilelang import dynamic_shared_memory_bytes, lower

    artifact = lower(radix_select_kernel(**asdict(config)))
    return config, str(artifact.kernel_source), dynamic_shared_memory_bytes(artifact)


def test_every_config_lowers_within_shared_memory():
    configs = dispatched_configs()
    assert len(configs) == len(set(configs))
    results = map_in_workers(_lower, configs)
    for config, source, smem in results:
        assert smem >= config.shared_memory_bytes(), f"{config}: the sort needs more than {smem} bytes"
        assert smem <= HOPPER_SMEM_LIMIT, f"{config}: {smem} bytes of dynamic shared memory"
        # Histogram atomics on shared memory; the gather works on warp ballots: score order
        # reserves sort slots with one atomic per warp, index order writes in place (no sort).
        assert "AtomicAdd((&(((int*)hist)" in source and "__ballot_sync" in source, config
        assert ("AtomicAddRet((&(((int*)filled)" in source) == (config.order == "score"), config
        assert "__launch_bounds__(256" in source, config
        # The histogram passes' key loops hold no barrier (a shared read of the decided prefix
        # inside them once made TileLang put two around every key); the gather is the last loop.
        *passes, gather = _barriers_per_key_loop(source)
        assert len(passes) == (SCORE_BITS[config.score_dtype] + config.index_bits) // RADIX_BITS, config
        assert not any(passes), f"{config}: barriers inside the histogram passes' key loops: {passes}"
        # Score order sorts in registers: lane shuffles for the strides below a warp.
        assert ("__shfl_xor_sync" in source) == (config.order == "score"), config


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build cubins")
def test_a_config_compiles_to_cubin():
    from nemo_dsa.ops._tilelang import compile_cubin

    config = select_config(torch.bfloat16, 512, "index", 8192)
    kernel = compile_cubin(radix_select_kernel(**asdict(config)))
    assert "__ballot_sync" in kernel.get_kernel_source()


def test_config_choice_and_limits():
    assert select_config(torch.float32, 512, "score", 8192) == SelectConfig("float32", 512, "score", 16)
    assert select_config(torch.bfloat16, 100, "index", 65_537) == SelectConfig("bfloat16", 128, "index", 32)
    assert [sort_slots(c) for c in (1, 100, 128, 129, 2048, 2049)] == [128, 128, 128, 256, 2048, 4096]
    assert {c.slots for c in dispatched_configs() if c.order == "score"} == {128, 256, 512, 1024, 2048, 4096, 8192}
    assert select_config(torch.bfloat16, 2048, "index", 8192).slots == 128  # no sort: one build for every T
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        select_config(torch.float16, 8, "score", 64)
    with pytest.raises(ValueError, match="order"):
        select_config(torch.float32, 8, "random", 64)
    with pytest.raises(ValueError, match="count"):
        select_config(torch.float32, MAX_COUNT + 1, "score", 10**5)


def test_wrapper_and_dispatcher_validate():
    scores = torch.randn(4, 16)
    with pytest.raises(ValueError, match="CUDA"):
        select_rows_tilelang(scores, 4, "score")
    with pytest.raises(ValueError, match="backend='tilelang' needs CUDA"):
        select_topk(scores, 4, backend="tilelang")
    with pytest.raises(ValueError, match="both ks and ke"):
        select_topk(scores, 4, ks=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="ks"):
        select_topk(scores, 4, ks=torch.zeros(5, dtype=torch.int32), ke=torch.zeros(5, dtype=torch.int32))


def test_dispatcher_on_cpu_is_the_reference():
    from nemo_dsa.ops.topk import naive

    g = torch.Generator().manual_seed(0)
    scores = (torch.randint(-3, 4, (3, 50, 70), generator=g) / 2).to(torch.bfloat16)
    assert torch.equal(select_topk(scores, 20, "index"), naive.select_topk(scores, 20, "index"))
