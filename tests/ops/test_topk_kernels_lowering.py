"""TileLang radix select on the CPU: every configuration the lowering table names lowers for
sm_90a within Hopper's shared memory, with the row's images cached in registers, a shared-memory
histogram with no barrier inside the passes' key loops, an ordered warp-ballot gather, no barrier
under a thread-dependent branch (that hangs the GPU); bf16 rows first try the window below the
row's maximum (a max walk and a per-warp histogram walk, the gather's counts from those
histograms); candidate-block masks live in static shared memory and add no barrier; one compiles
to a cubin with nvcc; the wrapper and the dispatcher validate their inputs. The vector select
(bf16 index order, instead of the radix select) lowers and compiles too."""

import re
import shutil
from dataclasses import asdict

import pytest
import torch
from _support.lowering import map_in_workers, ptxas_report

from nemo_dsa.ops._tilelang import HOPPER_SMEM_LIMIT
from nemo_dsa.ops.topk.interface import select_topk
from nemo_dsa.ops.topk.kernels import (
    CACHED_STEPS,
    DIGIT_BITS,
    MASK_BLOCKS,
    MAX_COUNT,
    MIN_BLOCKS_PER_SM,
    SELECT_PASS_CONFIGS,
    UNROLL,
    WINDOW_BINS,
    SelectConfig,
    dispatched_configs,
    fits_block_mask,
    radix_select_kernel,
    select_config,
    select_rows_tilelang,
    sort_slots,
    uses_vector_select,
)
from nemo_dsa.ops.topk.vector_kernels import (
    KEPT_INTS,
    ROW_SOURCE,
    SCRATCH_INTS,
    WARPS,
)
from nemo_dsa.ops.topk.vector_kernels import MIN_BLOCKS_PER_SM as VECTOR_BLOCKS_PER_SM
from nemo_dsa.ops.topk.vector_kernels import WINDOW_BINS as VECTOR_BINS
from nemo_dsa.ops.topk.vector_kernels import vector_select_kernel


def _barriers_per_step_loop(source: str) -> list[int]:
    """``__syncthreads`` count inside each loop over a row's steps (``for (int step...``, from step
    0 or, past the register cache, from a later one), in order."""
    counts, depth, open_at = [], 0, None
    for line in source.splitlines():
        if open_at is None and re.search(r"for \(int step(_\d+)? = \d+; step(_\d+)? < (max\()?steps", line):
            open_at = depth
            counts.append(0)
        elif open_at is not None and "__syncthreads" in line:
            counts[-1] += 1
        depth += line.count("{") - line.count("}")
        if open_at is not None and depth <= open_at:
            open_at = None
    return counts


def _barriers_under_thread_branches(source: str) -> list[str]:
    """Barriers inside an ``if`` (or its ``else``) whose condition depends on the thread: not
    every thread reaches them, so the block waits forever."""
    bad, stack = [], []
    for line in source.splitlines():
        stripped = line.strip()
        if "__syncthreads" in stripped and any("threadIdx" in opener for opener in stack if opener.startswith("if")):
            bad.append(stripped)
        closes = stripped.count("}")
        popped = [stack.pop() for _ in range(min(closes, len(stack)))]
        if stripped.startswith("} else") and popped:
            stack.append(popped[-1])  # the else branch inherits its if's condition
        elif stripped.endswith("{"):
            stack.append(stripped)
    return bad


def _lower(config, **knobs):
    from nemo_dsa.ops._tilelang import dynamic_shared_memory_bytes, lower

    artifact = lower(radix_select_kernel(**asdict(config), **knobs), pass_configs=SELECT_PASS_CONFIGS)
    return config, str(artifact.kernel_source), dynamic_shared_memory_bytes(artifact)


def _step_loops(config: SelectConfig, source: str):
    """(window walks, histogram passes, counting walk, writing walk) barrier counts."""
    loops = _barriers_per_step_loop(source)
    window = loops[:2] if config.score_dtype == "bfloat16" else []
    *passes, counting, writing = loops[len(window) :]
    return window, passes, counting, writing


# Built on demand: candidate-block masked selectors (per block size).
EXTRA = [
    SelectConfig("bfloat16", 128, "index", 8),
    SelectConfig("bfloat16", 128, "index", 3),
    SelectConfig("float32", 256, "score", 4),
]


def test_every_config_lowers_within_shared_memory():
    configs = dispatched_configs()
    assert len(configs) == len(set(configs))
    results = map_in_workers(_lower, configs + EXTRA)
    for config, source, smem in results:
        assert smem >= config.shared_memory_bytes(), f"{config}: the kernel needs more than {smem} bytes"
        static = MASK_BLOCKS if config.block_size else 0
        assert smem + static <= HOPPER_SMEM_LIMIT, f"{config}: {smem} + {static} bytes of shared memory"
        # The images of the first CACHED_STEPS steps live in registers; histogram atomics on
        # shared memory; the gather ranks keys with warp ballots, not atomics.
        assert f"uint cached[{CACHED_STEPS * UNROLL}];" in source, config
        assert "AtomicAdd((&(((int*)hist)" in source and "__ballot_sync" in source, config
        assert "AtomicAddRet" not in source, config
        blocks = MIN_BLOCKS_PER_SM if max(config.slots, 256) // 256 <= 8 else 1
        assert f"__launch_bounds__(256, {blocks})" in source, config
        # One histogram pass per digit of the score (no index digits: ties are ranked in the
        # gather), then the gather's counting and writing walks: no barrier inside any of them
        # but one per step of the score-order writes, which TileLang puts before the sort keys'
        # stores (at data-dependent places in the shared allocation). bf16: first the window's
        # max walk and per-warp histogram walk, also without barriers.
        window, passes, counting, writing = _step_loops(config, source)
        assert len(passes) == len(DIGIT_BITS[config.score_dtype]), config
        assert not any(window) and not any(passes) and counting == 0, (config, window, passes, counting)
        if config.score_dtype == "bfloat16":  # the window below the row's maximum
            assert f"whist)[(((((int64_t)((int)threadIdx.x)) >> (int64_t)5) * (int64_t){WINDOW_BINS})" in source, config
            assert "window_hit)[0] == 1" in source, config  # the counting walk only without a window cut
        assert (f"__shared__ __align__(16) uchar kept[{MASK_BLOCKS}];" in source) == bool(config.block_size), config
        assert writing == (1 if config.order == "score" else 0), config
        assert not _barriers_under_thread_branches(source), config
        # Score order sorts in registers: lane shuffles for the strides below a warp (the window
        # reduces its maximum and counts with them too).
        assert ("__shfl_xor_sync" in source) == (config.order == "score" or config.score_dtype == "bfloat16"), config


def test_barrier_check_sees_a_thread_dependent_branch():
    source = "if (((int)threadIdx.x) == 0) {\n  x = 1;\n} else {\n  __syncthreads();\n}\n__syncthreads();\n"
    assert _barriers_under_thread_branches(source) == ["__syncthreads();"]
    assert not _barriers_under_thread_branches("if (done[0] == 0) {\n  __syncthreads();\n}\n")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build cubins")
def test_a_config_compiles_to_cubin():
    from nemo_dsa.ops._tilelang import compile_cubin

    config = select_config(torch.bfloat16, 512, "index")
    kernel = compile_cubin(radix_select_kernel(**asdict(config)), pass_configs=SELECT_PASS_CONFIGS)
    assert "__ballot_sync" in kernel.get_kernel_source()


def test_config_choice_and_limits():
    assert select_config(torch.float32, 512, "score") == SelectConfig("float32", 512, "score")
    assert select_config(torch.bfloat16, 100, "index") == SelectConfig("bfloat16", 128, "index")
    assert [sort_slots(c) for c in (1, 100, 128, 129, 2048, 2049)] == [128, 128, 128, 256, 2048, 4096]
    assert {c.slots for c in dispatched_configs() if c.order == "score"} == {128, 256, 512, 1024, 2048, 4096, 8192}
    assert select_config(torch.bfloat16, 2048, "index").slots == 128  # no sort: one build for every T
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        select_config(torch.float16, 8, "score")
    with pytest.raises(ValueError, match="order"):
        select_config(torch.float32, 8, "random")
    with pytest.raises(ValueError, match="count"):
        select_config(torch.float32, MAX_COUNT + 1, "score")


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
    from nemo_dsa.ops.topk import select_topk_reference

    g = torch.Generator().manual_seed(0)
    scores = (torch.randint(-3, 4, (3, 50, 70), generator=g) / 2).to(torch.bfloat16)
    assert torch.equal(select_topk(scores, 20, "index"), select_topk_reference(scores, 20, "index"))


def test_tuning_knobs_lower_and_are_checked():
    # Wider first digits and a smaller register cache (measurement knobs) lower to the same
    # structure: one pass per digit, no barrier in a key loop or a thread branch.
    for kwargs in (dict(digit_bits=(11, 5)), dict(digit_bits=(12, 12, 8)), dict(cached_steps=2, min_blocks=3)):
        dtype = "float32" if sum(kwargs.get("digit_bits", (16,))) == 32 else "bfloat16"
        config = SelectConfig(dtype, 128, "index")
        _, source, _ = _lower(config, **kwargs)
        window, passes, counting, writing = _step_loops(config, source)
        assert len(passes) == len(kwargs.get("digit_bits", DIGIT_BITS[dtype])), kwargs
        assert not any(window), kwargs
        assert not any(passes) and counting == 0 and writing == 0, kwargs
        assert not _barriers_under_thread_branches(source), kwargs
    with pytest.raises(ValueError, match="digit_bits"):
        radix_select_kernel("bfloat16", 128, "index", digit_bits=(8, 4))
    with pytest.raises(ValueError, match="digit_bits"):
        radix_select_kernel("float32", 128, "index", digit_bits=(16, 16))
    with pytest.raises(ValueError, match="cached_steps"):
        radix_select_kernel("float32", 128, "index", cached_steps=0)
    with pytest.raises(ValueError, match="block_size"):
        radix_select_kernel("bfloat16", 128, "index", block_size=-1)


def test_block_mask_limits_and_arguments():
    assert fits_block_mask(MASK_BLOCKS * 8, 8) and not fits_block_mask(MASK_BLOCKS * 8 + 1, 8)
    assert select_config(torch.bfloat16, 512, "index", block_size=8) == SelectConfig("bfloat16", 128, "index", 8)
    scores = torch.randn(4, 16)
    with pytest.raises(ValueError, match="blocks and block_size"):
        select_rows_tilelang(scores, 4, "index", block_size=8)


# An H100/H200 SM's shared memory, and what the runtime reserves per block (CUDA programming guide).
SM_SMEM, SM_RESERVED_SMEM = 228 * 1024, 1024


def test_vector_select_lowers_and_serves_aligned_bf16_index_rows():
    """The vector select (bf16 index order) lowers for sm_90a: one row a block
    of 256 threads, 5 blocks an SM within an SM's shared memory (candidate blocks too), the row's CUDA
    with 16-byte loads and bf16x2 maxima, per-warp window histograms in shared memory, candidate blocks
    (a bit map, or the list of 16-bit numbers for blocks of 8) in 8 KiB of static shared memory; the
    wrapper hands it only matrices it can read in 16-byte vectors."""
    from nemo_dsa.ops._tilelang import dynamic_shared_memory_bytes, lower

    artifact = lower(vector_select_kernel())
    source, smem = str(artifact.kernel_source), dynamic_shared_memory_bytes(artifact)
    assert "__launch_bounds__(256, 5)" in source and "vector_select::select_row<4, 0>(" in source
    assert "reinterpret_cast<const uint4*>" in source and "__hmax2" in source and "atomicAdd(hist" in source
    assert 4 * (WARPS * VECTOR_BINS + SCRATCH_INTS) <= smem <= HOPPER_SMEM_LIMIT
    assert VECTOR_BLOCKS_PER_SM * (smem + SM_RESERVED_SMEM) <= SM_SMEM
    with pytest.raises(ValueError, match="cached_vectors"):
        vector_select_kernel(cached_vectors=0)
    with pytest.raises(ValueError, match="block_size"):
        vector_select_kernel(block_size=-1)
    # Candidate blocks (reindex layers) in static shared memory: rows of up to MASK_BLOCKS blocks, a bit
    # each in the map, lists of up to 4,096 16-bit block numbers; 5 blocks an SM still fit.
    assert f"constexpr int kMaskBlocks = {MASK_BLOCKS}, kListedBlocks = 4096;" in ROW_SOURCE
    assert MASK_BLOCKS // 8 <= 4 * KEPT_INTS and 4096 * 2 <= 4 * KEPT_INTS
    masked = lower(vector_select_kernel(block_size=8))
    masked_smem = dynamic_shared_memory_bytes(masked)
    assert f"__shared__ __align__(16) int kept[{KEPT_INTS}];" in str(masked.kernel_source)
    assert "__launch_bounds__(256, 5)" in str(masked.kernel_source)
    assert "select_row<2, 8>(" in str(masked.kernel_source)
    assert VECTOR_BLOCKS_PER_SM * (masked_smem + 4 * KEPT_INTS + SM_RESERVED_SMEM) <= SM_SMEM
    bf16 = torch.randn(4, 1001).bfloat16()
    assert uses_vector_select(bf16, "index")  # any width: vectors are aligned in the matrix
    assert not uses_vector_select(bf16.float(), "index")
    assert not uses_vector_select(bf16, "score")
    misaligned = torch.empty(4 * 1001 + 1, dtype=torch.bfloat16)[1:].view(4, 1001)
    assert not uses_vector_select(misaligned, "index")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build cubins")
def test_vector_select_compiles_to_cubin_without_spills():
    """Both builds fit 48 registers (5 blocks an SM) without spilling: with candidate blocks only at 2
    cached vectors a lane (4 spill 24 bytes)."""
    from nemo_dsa.ops._tilelang import compile_cubin, lower

    assert "vector_select::select_row<2, 8>(" in compile_cubin(vector_select_kernel(block_size=8)).get_kernel_source()
    for block_size in (0, 8):
        report = ptxas_report(str(lower(vector_select_kernel(block_size=block_size)).kernel_source))
        assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 48, report[-2000:]
        assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", report), report[-2000:]
