"""Sparse window attention kernels on the CPU: every dispatched configuration lowers for sm_90a
with wgmma and fits Hopper's shared memory; the forward keeps its warp-specialised schedule and
zero-filling gathers; representative configurations compile to cubins with nvcc; the wrappers'
limits."""

import re
import shutil

import pytest
import torch
from _support.lowering import map_in_workers, static_shared_memory_bytes

from nemo_dsa.ops.sparse_attention import kernels, sparse_window_attention
from nemo_dsa.ops.sparse_attention.kernels import (
    HOPPER_SMEM_LIMIT,
    BackwardConfig,
    ForwardConfig,
    backward_config,
    dispatched_configs,
    forward_config,
    kernel_dim,
)


def _factory(config):
    if isinstance(config, ForwardConfig):
        return kernels.sparse_window_fwd_kernel
    if isinstance(config, BackwardConfig):
        return kernels.sparse_window_bwd_kernel
    return kernels.attention_delta_kernel


def _lower(config):
    """(config, generated CUDA, dynamic shared memory bytes) for one configuration."""
    from nemo_dsa.ops._tilelang import dynamic_shared_memory_bytes, lower

    if isinstance(config, int):  # the delta kernel, by head dim
        artifact = lower(kernels.attention_delta_kernel(config))
    else:
        artifact = lower(_factory(config)(**config.kernel_kwargs()), pass_configs=config.pass_configs())
    return config, str(artifact.kernel_source), dynamic_shared_memory_bytes(artifact)


def _compile(config):
    from nemo_dsa.ops._tilelang import compile_cubin

    kernels.register_barrier_postproc()  # as the launch wrappers do before compiling
    kernel = compile_cubin(_factory(config)(**config.kernel_kwargs()), pass_configs=config.pass_configs())
    return str(kernel.get_kernel_source())


def _forward_problems(config: ForwardConfig, source: str) -> list[str]:
    """What the forward's CUDA lacks of its schedule: S = Q K^T as m64n64 wgmmas, one m64 x D/2
    P V wgmma per consumer, the setmaxnreg split, and zero-filling cp.async gathers."""
    problems = []
    if len(re.findall(r"wgmma_ss<[^>]*\b64, 64, 16\b", source)) < 4:
        problems.append("S = Q K^T as m64n64k16 wgmma (in each consumer)")
    if len(re.findall(rf"wgmma_rs<[^>]*\b64, {config.dim // 2}, 16\b", source)) < 2:
        problems.append("each consumer's own tile's P V with P in registers (wgmma_rs)")
    if len(re.findall(rf"wgmma_ss<[^>]*\b64, {config.dim // 2}, 16\b", source)) < 2:
        problems.append(f"one m64n{config.dim // 2} P V wgmma per consumer")
    if f"warpgroup_reg_dealloc<{kernels.PRODUCER_REGISTERS}>" not in source:
        problems.append("producer setmaxnreg.dec")
    if source.count(f"warpgroup_reg_alloc<{kernels.CONSUMER_REGISTERS}>") != 2:
        problems.append(f"consumers' setmaxnreg.inc {kernels.CONSUMER_REGISTERS}")
    if "cp_async_gs_conditional<16>" not in source:
        problems.append("16-byte zero-filling cp.async gathers")
    # Q by TMA before the index row is read (the block's first loads), O stored by TMA.
    q_load, index_row = source.find("tl::tma_load"), source.find("Indices[")
    if q_load < 0 or (config.mode == "indices" and not q_load < index_row):
        problems.append("Q loaded by TMA ahead of the index row")
    if source.count("tl::tma_store(") != 2 or source.count("tma_store_wait<0, true>") != 2:
        problems.append("O stored by TMA from each consumer's staging tile")
    # The producer never waits for its own copies: they arrive on the stage's mbarrier themselves.
    producer = re.search(r"warpgroup_reg_dealloc<\d+>(.*?)warpgroup_reg_alloc<", source, re.S)
    if "mbarrier_cp_async_arrive_noinc" not in source or producer is None or "cp_async_wait" in producer.group(1):
        problems.append("a producer whose cp.async arrive on the stage mbarrier (no wait on its own copies)")
    # Each role synchronises only among itself: one named-barrier id per role, none shared (a
    # producer barrier with a consumer's id deadlocks the block).
    marks = [m.start() for m in re.finditer(r"warpgroup_reg_(?:alloc|dealloc)<", source)] + [len(source)]
    role_ids = [set(re.findall(r"__sync_thread_partial\((\d+), 128\)", source[a:b])) for a, b in zip(marks, marks[1:])]
    if len(role_ids) != 3 or any(len(ids) > 1 for ids in role_ids) or len(set().union(*role_ids)) != sum(map(len, role_ids)):
        problems.append(f"one named barrier per role, distinct across roles (got {role_ids})")
    return problems


def _pipelined_backward_problems(config: BackwardConfig, source: str) -> list[str]:
    """What the backward's CUDA lacks for its pipeline: S and dP issued before one wait, and
    each dkv chunk's GEMMs issued into the other accumulator before this chunk's atomics."""
    problems = []
    tile_loop = source[source.index("for (int t = 0; t < tiles; ++t)"):]
    first_wait = tile_loop.find("wait_wgmma<")
    if first_wait < 0 or tile_loop[:first_wait].count("warpgroup_commit_batch") != 2:
        problems.append("S and dP committed before the first wait")
    if "warpgroup_wait<" in tile_loop:
        problems.append("an implicit wait after a GEMM (T.gemm instead of T.wgmma_gemm)")
    # In the source: chunk 0's wait before the key prefetch, then in the (unrolled) loop over
    # chunk pairs one wait<2> per chunk issued ahead; the last chunk's wait<0>.
    if tile_loop.count("wait_wgmma<2>") < 2 or "wait_wgmma<0>" not in tile_loop:
        problems.append("a wait that leaves the next chunk's GEMMs running (wait_wgmma<2>)")
    if not re.search(r"wait_wgmma<2>\(\);\s*tl::warpgroup_fence_operand\(reinterpret_cast<float\*>\(acc_kv \+ 0\)", tile_loop):
        problems.append("chunk atomics fenced behind the wait")
    if "acc_kv1" not in tile_loop:
        problems.append("a second dkv accumulator")
    return problems


def test_every_dispatched_config_lowers_with_wgmma_and_fits_shared_memory():
    configs = dispatched_configs()
    # One forward and one backward per head dim and mode.
    assert len(configs) == len(set(configs)) == 2 * len(kernels.MODES) * len(kernels.KERNEL_DIMS)
    results = map_in_workers(_lower, configs + list(kernels.KERNEL_DIMS))
    for config, source, smem in results:
        # Dynamic and static (mbarriers, the forward's index row; 1 KiB aligned) together.
        static = static_shared_memory_bytes(source)
        assert smem + static <= HOPPER_SMEM_LIMIT, f"{config}: {smem} bytes of dynamic + {static} of static shared memory"
        if isinstance(config, ForwardConfig):
            # What nvcc compiles: the CUDA after the per-role barrier renumbering.
            compiled = kernels.separate_role_barriers(source)
            assert not _forward_problems(config, compiled), f"{config}: missing {_forward_problems(config, compiled)}"
            assert smem >= config.shared_memory_bytes(), f"{config}: tiles need more than {smem} bytes"
            # The index row is static shared memory (counted above).
            if config.mode == "indices":
                assert re.search(rf"__shared__ (__align__\(\d+\) )?int idx_s\[{kernels.MAX_SELECTED}\]", source), config
                assert static >= 4 * kernels.MAX_SELECTED, config
        elif isinstance(config, BackwardConfig):
            assert "wgmma_ss<" in source, f"{config}: no wgmma"
            # Straight from the two accumulators to 16-byte atomics (after the lane exchanges of
            # the helper): no staging tile, so no barrier inside the chunk loop.
            helper = "dkv_add_transposed"
            for acc in ("acc_kv", "acc_kv1"):
                assert f"{helper}({acc}, " in source, f"{config}: {acc} not added by {helper}"
            assert "atomicAdd(reinterpret_cast<float4*>" in source and "AtomicAdd" not in source, config
            chunk_loop = source[source.index(f"{helper}(acc_kv, "):source.rindex(f"{helper}(acc_kv1, ")]
            assert "__syncthreads()" not in chunk_loop, f"{config}: a barrier between the chunks' adds"
            # The key rows come by zero-filling cp.async, not through registers (LDG, then STS).
            assert "cp_async_gs_conditional<16>" in source, f"{config}: key rows not gathered by cp.async"
            # One wait, at the top of each tile: the next tile's rows are copied during this
            # tile's dkv GEMMs (a commit before the loop and one inside it), not waited for at once.
            tile_loop = source[source.index("for (int t = 0; t < tiles; ++t)"):]
            assert source.count("cp_async_wait<0>") == 1 and tile_loop.count("cp_async_wait<0>") == 1, config
            # (It prefetches in each of its two dkv branches.)
            assert source.count("cp_async_commit") == 3 and tile_loop.count("cp_async_commit") == 2, config
            assert not _pipelined_backward_problems(config, source), f"{config}: {_pipelined_backward_problems(config, source)}"
            # A tile starts with its key wait: its dKV rows were read a tile earlier (no index-row
            # read, no barrier first), and Q and dO come by TMA.
            tile_start = tile_loop[: tile_loop.index("cp_async_wait<0>")]
            assert "__syncthreads()" not in tile_start and "Indices[" not in tile_start, config
            assert source.count("tl::tma_load") == 2, config
            assert smem > 0
        else:
            assert isinstance(config, int), config  # the delta kernel, by head dim
            assert "__launch_bounds__(128" in source, config
    # setmaxnreg moves registers within the launch allocation: asking for more hangs.
    budget = 2 * kernels.CONSUMER_REGISTERS + kernels.PRODUCER_REGISTERS
    assert budget <= 3 * kernels.LAUNCH_REGISTERS, f"setmaxnreg budgets ask for {budget} > 504"
    assert kernels.LAUNCH_REGISTERS * kernels.FWD_THREADS <= 65536
    for config, source, _ in results:
        if isinstance(config, ForwardConfig):
            # The consumers meet at their own 256-thread barrier only to share Q and the row
            # sums; within a round they hand over through mbarriers.
            assert f"__sync_thread_partial({kernels.EXCHANGE_BARRIER}, 256)" in source, config


def test_role_barrier_renumbering_separates_shared_ids():
    """Roles that share barrier ids in the generated code each get their own after the
    renumbering, and other kernels' code is left alone."""
    code = (
        "void sparse_window_fwd_alternating_kernel() { warpgroup_reg_dealloc<96>(); __sync_thread_partial(3, 128);"
        " warpgroup_reg_alloc<240>(); __sync_thread_partial(3, 128); __sync_thread_partial(3, 128);"
        " warpgroup_reg_alloc<168>(); __sync_thread_partial(4, 128); }"
    )
    fixed = kernels.separate_role_barriers(code)
    ids = [int(i) for i in re.findall(r"__sync_thread_partial\((\d+), 128\)", fixed)]
    assert ids == [kernels.ROLE_BARRIER_IDS[0]] + [kernels.ROLE_BARRIER_IDS[1]] * 2 + [kernels.ROLE_BARRIER_IDS[2]]
    other = code.replace("sparse_window_fwd_alternating", "other")
    assert kernels.separate_role_barriers(other) == other
    with pytest.raises(RuntimeError, match="3 warpgroup roles"):
        kernels.separate_role_barriers("sparse_window_fwd_alternating_kernel warpgroup_reg_alloc<240>")


def test_the_forward_needs_its_role_barriers_separated():
    """Both consumers name FLAGS_BARRIER in the generated CUDA (one 128-thread barrier for two
    roles); only the renumbered code gives each role its own ids."""
    _, source, _ = _lower(forward_config(128, "indices"))
    marks = [m.start() for m in re.finditer(r"warpgroup_reg_(?:alloc|dealloc)<", source)] + [len(source)]
    consumers = [source[a:b] for a, b in zip(marks[1:], marks[2:])]
    flags = f"__sync_thread_partial({kernels.FLAGS_BARRIER}, 128)"
    assert all(flags in consumer for consumer in consumers)
    assert flags not in kernels.separate_role_barriers(source)


def test_schedule_check_can_fail():
    """The forward check fails on a plain T.gemm kernel without the warp-specialised roles."""
    from nemo_dsa.ops._tilelang import lower_to_cuda_source

    T = kernels.tilelang().language

    @T.prim_func
    def plain(Q: T.Tensor([64, 512], T.bfloat16), K: T.Tensor([64, 512], T.bfloat16), S: T.Tensor([64, 64], T.float32)):
        with T.Kernel(1, threads=128):
            q = T.alloc_shared([64, 512], T.bfloat16)
            k = T.alloc_shared([64, 512], T.bfloat16)
            acc = T.alloc_fragment([64, 64], T.float32)
            T.copy(Q, q)
            T.copy(K, k)
            T.gemm(q, k, acc, transpose_B=True, clear_accum=True)
            T.copy(acc, S)

    assert _forward_problems(forward_config(512, "indices"), lower_to_cuda_source(plain))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot build cubins")
def test_representative_configs_compile_to_cubin():
    fwd, bwd = forward_config(512, "indices"), backward_config(128, "range")
    fwd_source, bwd_source = map_in_workers(_compile, [fwd, bwd])
    assert not _forward_problems(fwd, fwd_source)
    # The post-processing hook ran before nvcc: the consumers' barriers carry their role ids
    # (the producer has none left: it never waits for its own copies).
    for role_id in kernels.ROLE_BARRIER_IDS[1:]:
        assert f"__sync_thread_partial({role_id}, 128)" in fwd_source
    assert "dkv_add_transposed(acc_kv, " in bwd_source and "atomicAdd(reinterpret_cast<float4*>" in bwd_source


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot run ptxas")
def test_backwards_keep_their_wgmmas_asynchronous():
    """ptxas serialises every wgmma of a kernel (remark C7514) when it cannot prove that no
    accumulator is read while its wgmma runs; that would undo the pipeline silently. No spills
    either."""
    from _support.lowering import ptxas_report

    shapes = ((512, "indices"), (512, "range"), (128, "range"))
    configs = [backward_config(d, m) for d, m in shapes]
    for config, source, _ in map_in_workers(_lower, configs):
        report = ptxas_report(source)
        assert "C7514" not in report and "C7517" not in report, f"{config}: {report[-2000:]}"
        assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", report), f"{config}: {report[-2000:]}"


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found: cannot run ptxas")
def test_forwards_keep_their_wgmmas_asynchronous():
    """The same ptxas check for the forward at D = 512: no wgmma serialised (C7514 / C7517) and
    no spill, in either mode."""
    from _support.lowering import ptxas_report

    configs = [forward_config(512, mode) for mode in ("indices", "range")]
    for config, source, _ in map_in_workers(_lower, configs):
        report = ptxas_report(source)
        assert "C7514" not in report and "C7517" not in report, f"{config}: {report[-2000:]}"
        assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", report), f"{config}: {report[-2000:]}"


def test_dims_and_modes_map_to_kernels():
    assert [kernel_dim(d) for d in (16, 128, 130, 256, 320, 512)] == [128, 128, 512, 512, 512, 512]
    with pytest.raises(ValueError, match="head_dim"):
        kernel_dim(528)
    with pytest.raises(ValueError, match="dim must be one of"):
        forward_config(192, "indices")
    with pytest.raises(ValueError, match="mode must be one of"):
        backward_config(512, "dense")


def _cuda_like_args(**change):
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    args = dict(q=q, raw_kv=torch.zeros(1, 4, 64, dtype=torch.bfloat16), window_start=torch.zeros(1, 4, dtype=torch.int32),
                window=2, compressed_kv=None, scale=0.1, backend="tilelang")
    args.update(change)
    return args


def test_kernel_path_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        sparse_window_attention(**_cuda_like_args())
