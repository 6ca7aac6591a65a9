"""V4.1 scorer kernels on the CPU: every dispatchable configuration lowers for sm_90a with wgmma
in the hand-specialised ping-pong schedule and fits Hopper's shared memory; a few compile to
cubins with nvcc; the wrappers validate inputs."""

import re
import shutil

import pytest
import torch
from _support.lowering import map_in_workers, pingpong_problems

from nemo_dsa.ops.v41_indexer import kernels
from nemo_dsa.ops.v41_indexer.kernels import (
    HOPPER_SMEM_LIMIT,
    dispatched_configs,
    kernel_index_dim,
    mask_ranges,
    scorer_config,
    v41_scorer_kernel,
)

# nvcc builds for one representative of each tile shape (D = 64/128/256, few and many heads,
# the head sum in registers).
CUBIN_CONFIGS = [(64, 128), (8, 256), (128, 64), (2, 128)]


def _lower(config):
    """(config, generated CUDA, dynamic shared memory bytes) for one configuration."""
    from nemo_dsa.ops._tilelang import lower

    artifact = lower(v41_scorer_kernel(**config.kernel_kwargs()), pass_configs=config.pass_configs())
    sizes = [0]
    for _, func in artifact.device_mod.functions.items():
        if func.attrs is not None and "dyn_shared_memory_buf" in func.attrs:
            sizes.append(int(func.attrs["dyn_shared_memory_buf"]))
    return config, str(artifact.kernel_source), max(sizes)


def _pingpong_problems(config, source: str) -> list[str]:
    """The shared schedule, plus the head sum: a register-operand wgmma against E per consumer,
    or none (register adds)."""
    problems = pingpong_problems(source, config.block_q * config.heads, config.producer_registers, config.consumer_registers)
    sum_columns = kernels.head_sum_columns(config.block_q)
    head_sums = len(re.findall(rf"wgmma_rs<[^>]*\b64, {sum_columns}, 16\b", source))
    if head_sums != (2 if config.head_sum_wgmma else 0) or source.count("wgmma_rs<") != head_sums:
        problems.append("head-sum wgmma (m64 x sum columns, A from registers) iff head_sum_wgmma")
    return problems


def test_every_dispatched_config_lowers_to_the_pingpong_schedule_and_fits_shared_memory():
    configs = dispatched_configs()
    assert {c.heads for c in configs if c.head_sum_wgmma} == {h for h in kernels.SUPPORTED_HEADS if h >= 8}
    assert len(configs) == len(set(configs)) == len(kernels.SUPPORTED_HEADS) * len(kernels.KERNEL_DIMS)
    results = map_in_workers(_lower, configs)
    for config, source, smem in results:
        assert not _pingpong_problems(config, source), f"{config}: missing {_pingpong_problems(config, source)}"
        assert 0 < smem <= HOPPER_SMEM_LIMIT, f"{config}: {smem} bytes of dynamic shared memory"
        assert smem >= config.shared_memory_bytes(), f"{config}: tiles need more than {smem} bytes"
    budget = configs[0].producer_registers * 128 + configs[0].consumer_registers * 256
    assert budget <= 65536, f"setmaxnreg budgets ask for {budget} registers"


def test_pingpong_check_fails_on_the_automatic_schedule():
    """The schedule check can fail: TileLang's own warp specialisation of a plain pipelined
    scorer (no named barriers, no hand-over) does not pass it."""
    from nemo_dsa.ops._tilelang import lower_to_cuda_source

    T = kernels.tilelang().language
    config = scorer_config(64, 64)

    @T.prim_func
    def plain(Q: T.Tensor([256, 64], T.bfloat16), K: T.Tensor([512, 64], T.bfloat16), S: T.Tensor([512, 256], T.float32)):
        with T.Kernel(1, threads=256):
            q_shared = T.alloc_shared([256, 64], T.bfloat16)
            k_shared = T.alloc_shared([64, 64], T.bfloat16)
            acc = T.alloc_fragment([64, 256], T.float32)
            T.copy(Q, q_shared)
            for t in T.Pipelined(8, num_stages=2):
                T.copy(K[t * 64 : t * 64 + 64, :], k_shared)
                T.gemm(k_shared, q_shared, acc, transpose_B=True, clear_accum=True)
                T.copy(acc, S[t * 64 : t * 64 + 64, :])

    assert _pingpong_problems(config, lower_to_cuda_source(plain))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build cubins")
@pytest.mark.parametrize("heads,dim", CUBIN_CONFIGS)
def test_representative_configs_compile_to_cubin(heads, dim):
    from nemo_dsa.ops._tilelang import compile_cubin

    config = scorer_config(heads, dim)
    kernel = compile_cubin(v41_scorer_kernel(**config.kernel_kwargs()), pass_configs=config.pass_configs())
    assert not _pingpong_problems(config, kernel.get_kernel_source())


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
    ks, ke = mask_ranges(allowed)
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
