"""TileLang sparse window + compressed attention for Hopper (sm_90a): forward and backward.

Contract (see :func:`nemo_dsa.ops.sparse_attention.naive.window_compressed_attention_reference`):
query i of batch b owns raw row ``own = i + N_raw - S``; it sees the raw rows
``[max(window_start, own - window + 1), own]`` (its sliding window, read by position) and the
compressed rows named by ``indices[b, i]`` (-1 = none) or the range ``[ks, ke)``. One softmax
over both, the per-head sink in the denominator only.

Work unit: one query and 64 of its heads (the GEMM's M dimension, as in FlashMLA; fewer heads
are zero-padded to 64, 128 heads take two blocks). Its keys come in tiles of ``BLOCK_KEYS``:
first the window tiles (contiguous raw rows), then the compressed tiles (gathered by index, or
contiguous in range mode). Rows of a tile that the query must not see are zero-filled by the
copy itself (``cp.async`` with a zero source size), never loaded, so a NaN or inf in an unseen
key cannot reach a product; their logits are then selected to -inf.

Forward schedule (384 threads, hand warp-specialised; the producer is warpgroup 0 so that the
barrier TileLang puts after its cp.async wait is the producer's own named barrier):
- producer warpgroup: gathers key tiles with 16-byte cp.async into a ring of ``num_stages``
  shared buffers (full/empty mbarriers);
- consumer 0: S = Q K^T over the whole head dim (m64 n64), the online softmax, then
  O[:, :D/2] += P V[:, :D/2];
- consumer 1: O[:, D/2:] += P V[:, D/2:] with the P and rescale factors consumer 0 left in
  shared memory (two mbarriers hand P over and back).
Each consumer holds a [64, D/2] fp32 accumulator (128 registers a thread at D = 512).

Backward: one block per (query, 64 heads) first computes ``delta = rowsum(dO * O)`` (written out
for the sink's gradient; a small kernel does it alone when no other gradient is wanted), then
recomputes P from the saved lse, accumulates dq in registers and adds each tile's
dkv = scale * dS^T Q + P^T dO into an fp32 [N_raw + K, D] buffer with 16-byte atomics
(non-deterministic summation order: fp32 rounding only), converted to the input dtype after.
"""


import os
import re
from dataclasses import asdict, dataclass

import torch

from nemo_dsa.ops._tilelang import HOPPER_SMEM_LIMIT, compile_cached, tilelang

BLOCK_HEADS = 64  # heads of one query per block: wgmma's M
BLOCK_KEYS = 64  # keys per tile
KERNEL_DIMS = (128, 512)  # head dims built; others are zero-padded up (zeros add nothing to q . k)
MAX_DIM = 512
MAX_HEADS = 128  # two 64-head blocks
MAX_SELECTED = 2048
LOG2E = 1.4426950408889634
# Running-max floor in log2 units: finite, so exp2(m_old - m_new) is never inf - inf.
M_FLOOR = -1.0e30
MODES = ("indices", "range")
# How the window keys' dkv is summed: "atomic" (the query-major backward adds every (query, tile)
# contribution with fp32 atomics) or "key-major" (window_dkv_kernel: one sum per raw tile, in
# registers). NEMO_DSA_WINDOW_DKV overrides the default (for A/B measurements).
WINDOW_DKV_MODES = ("atomic", "key-major")
DEFAULT_WINDOW_DKV = "atomic"

FWD_THREADS = 384
FWD_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_safe_memory_legalize": True}
BWD_THREADS = 256
BWD_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True}


# Forward schedules: "split-pv" (consumer 0 scores and does half of PV, consumer 1 the other
# half) or "balanced" (each consumer scores half the keys and does half of PV, FlashMLA's split).
# Balanced is the default: 6-7 % faster forward at V4-Flash shapes on the H200 (9.94 against
# 10.61 ms at S=32768, 19.26 against 20.68 ms at S=65536; docs/performance.md v12).
# NEMO_DSA_ATTN_FWD overrides the default (for A/B measurements).
# "alternating" (forward_alternating.py: the consumers take turns on whole tiles, FlashMLA's
# schedule) measured within 3 % of balanced at S >= 32768 and 9 % slower at 16384 (v18): opt-in.
# "balanced-lean" (balanced with per-tile column flags for the mask and lazy rescaling of O) is
# the default: 13-17 % faster than balanced at S = 16K-65K in the same run (8.17 against 9.43 ms
# at S=32768; docs/performance.md v21); "balanced" stays as the control.
FWD_SCHEDULES = ("split-pv", "balanced", "balanced-lean", "alternating")
DEFAULT_FWD_SCHEDULE = "balanced-lean"
# Backward: "serial" waits for every GEMM; "pipelined" overlaps each dkv chunk's atomics with the
# next chunk's GEMMs (NEMO_DSA_ATTN_BWD selects), 2-4 % faster than serial at S = 16K-65K (v19);
# "staged" is pipelined with each chunk passed through shared memory so that a warp's atomics
# cover whole 128-byte lines: fwd + bwd 34.9 against 37.5 ms at S = 32768, 69.0 against 74.5 ms
# at 65536 (v20): the default. Adding the staged chunk by the TMA (cp.reduce.async.bulk, one
# per key row) measured a 37 % slower backward than pipelined (v20) and was removed.
BWD_SCHEDULES = ("serial", "pipelined", "staged")
DEFAULT_BWD_SCHEDULE = "staged"
# Staging rows are padded by 8 floats: a warp writes 8 accumulator rows at once, and with the
# pad its 256-byte store takes 2 shared-memory wavefronts (the minimum), not 8.
STAGE_ROW_PAD = 8
# setmaxnreg (consumer 0, consumer 1, producer) per schedule. The warpgroups trade registers
# inside the block's launch allocation (168 a thread at 384 threads: 504 per thread-triple), so
# the three must sum to <= 504: a setmaxnreg.inc beyond it waits forever (the first balanced
# version asked for 208 + 208 + 96 = 512 and hung on the GPU). Balanced-lean's producer has 112:
# with 96 or fewer ptxas spilled there (docs/performance.md v21).
LAUNCH_REGISTERS = 168  # 65536 / 384, rounded down to a multiple of 8
FWD_REGISTERS = {
    "split-pv": (240, 168, 96),
    "balanced": (208, 200, 96),
    "balanced-lean": (200, 192, 112),
    "alternating": (216, 216, 72),
}


@dataclass(frozen=True)
class ForwardConfig:
    """One compiled forward (every field is an argument of :func:`sparse_window_fwd_kernel`)."""

    dim: int
    mode: str  # "indices" (per-query compressed indices) or "range" ([ks, ke))
    num_stages: int
    # setmaxnreg per warpgroup (FWD_REGISTERS[schedule]); :func:`forward_config` fills them.
    consumer0_registers: int
    consumer1_registers: int
    producer_registers: int
    schedule: str  # one of FWD_SCHEDULES

    def kernel_kwargs(self) -> dict:
        return asdict(self)

    def pass_configs(self) -> dict:
        return dict(FWD_PASS_CONFIGS)

    def shared_memory_bytes(self) -> int:
        """Dynamic shared memory: Q [64, D] + key ring [stages, 64, D] (bf16) + P [64, 64] (two
        for "alternating")."""
        p_tiles = 2 if self.schedule == "alternating" else 1
        return 2 * self.dim * (BLOCK_HEADS + self.num_stages * BLOCK_KEYS) + p_tiles * 2 * BLOCK_HEADS * BLOCK_KEYS

    def static_shared_memory_bytes(self) -> int:
        """The index row (indices mode), in static shared memory (see NO_COPY_WAIT)."""
        return 4 * MAX_SELECTED if self.mode == "indices" else 0


@dataclass(frozen=True)
class BackwardConfig:
    dim: int
    mode: str
    dkv_chunk: int  # columns of dkv computed (and added) at a time: bounds its registers
    schedule: str  # one of BWD_SCHEDULES

    def kernel_kwargs(self) -> dict:
        return asdict(self)

    def pass_configs(self) -> dict:
        return dict(BWD_PASS_CONFIGS)


@dataclass(frozen=True)
class WindowDkvConfig:
    """One compiled :func:`window_dkv_kernel` (the key-major window dkv)."""

    dim: int

    def kernel_kwargs(self) -> dict:
        return asdict(self)

    def pass_configs(self) -> dict:
        return dict(BWD_PASS_CONFIGS)


def kernel_dim(dim: int) -> int:
    """The built head dim that serves ``dim`` (the smallest of KERNEL_DIMS >= it)."""
    for d in KERNEL_DIMS:
        if dim <= d:
            return d
    raise ValueError(f"head_dim must be <= {MAX_DIM}, got {dim}")


def _choice_from_env(variable: str, default: str, choices: tuple) -> str:
    """``variable``'s value if set (one of ``choices``, else a ValueError), else ``default``."""
    value = os.environ.get(variable, default)
    if value not in choices:
        raise ValueError(f"{variable} must be one of {choices}, got {value!r}")
    return value


def forward_schedule() -> str:
    """The forward schedule in use: NEMO_DSA_ATTN_FWD if set, else DEFAULT_FWD_SCHEDULE."""
    return _choice_from_env("NEMO_DSA_ATTN_FWD", DEFAULT_FWD_SCHEDULE, FWD_SCHEDULES)


def forward_config(dim: int, mode: str, schedule: str | None = None) -> ForwardConfig:
    """Stages: as many 64-key tiles as fit beside Q in 227 KiB (2 at D = 512, 4 at D = 128);
    ``schedule`` None: :func:`forward_schedule`."""
    if dim not in KERNEL_DIMS:
        raise ValueError(f"dim must be one of {KERNEL_DIMS} for a kernel, got {dim}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    schedule = forward_schedule() if schedule is None else schedule
    if schedule not in FWD_SCHEDULES:
        raise ValueError(f"schedule must be one of {FWD_SCHEDULES}, got {schedule!r}")
    c0, c1, producer = FWD_REGISTERS[schedule]
    stages = 2 if dim == 512 or schedule == "alternating" else 4  # alternating: a stage per consumer
    return ForwardConfig(dim, mode, stages, c0, c1, producer, schedule)


def backward_schedule() -> str:
    """The backward schedule in use: NEMO_DSA_ATTN_BWD if set, else DEFAULT_BWD_SCHEDULE."""
    return _choice_from_env("NEMO_DSA_ATTN_BWD", DEFAULT_BWD_SCHEDULE, BWD_SCHEDULES)


def backward_config(dim: int, mode: str, schedule: str | None = None) -> BackwardConfig:
    """``schedule`` None: :func:`backward_schedule`."""
    if dim not in KERNEL_DIMS:
        raise ValueError(f"dim must be one of {KERNEL_DIMS} for a kernel, got {dim}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    schedule = backward_schedule() if schedule is None else schedule
    if schedule not in BWD_SCHEDULES:
        raise ValueError(f"schedule must be one of {BWD_SCHEDULES}, got {schedule!r}")
    return BackwardConfig(dim, mode, dkv_chunk=64, schedule=schedule)


def dispatched_configs() -> list:
    """Every forward, backward and key-major window-dkv configuration the wrappers can compile."""
    return (
        [forward_config(d, m, sched) for sched in FWD_SCHEDULES for d in KERNEL_DIMS for m in MODES]
        + [backward_config(d, m, sched) for sched in BWD_SCHEDULES for d in KERNEL_DIMS for m in MODES]
        + [WindowDkvConfig(d) for d in KERNEL_DIMS]
    )


# ----------------------------------------------------------------------------------------------
# Tile bookkeeping shared by the kernels (plain expressions, evaluated by every thread)
# ----------------------------------------------------------------------------------------------


def _tile_plan(T, own, window_start, window, n_sel):
    """(first window row, window tiles, all tiles) of one query; n_sel = compressed slots."""
    lo = T.max(T.max(window_start, own - window + 1), 0)
    n_window = T.max(own - lo + 1, 0)
    window_tiles = T.ceildiv(n_window, BLOCK_KEYS)
    return lo, window_tiles, window_tiles + T.ceildiv(n_sel, BLOCK_KEYS)


def _compressed_span(T, by_index: bool, Indices, KE, b, s, n_slots):
    """(ks, n_sel) of query s: where its compressed slots start (range mode) and how many there
    are. In indices mode KE holds 1 + the last valid slot, so the -1 tails of the early queries'
    selections are never loaded nor scored."""
    if by_index:
        return 0, T.max(T.min(KE[b, s], n_slots), 0)
    ks = Indices[b, s]
    return ks, T.max(KE[b, s] - ks, 0)


def _query_plan(T, by_index: bool):
    """The forwards' macro for one query's keys: in indices mode the query's index row into
    shared memory ``idx_s`` first (every thread reads it for its mask), then
    (ks, n_sel, lo, window_tiles, tiles): the compressed slots' start (range mode) and count, and
    :func:`_tile_plan`."""

    @T.macro
    def query_plan(idx_s, Indices, KE, WindowStart, window, b, s, own, n_slots):
        if by_index:
            for j in T.Parallel(MAX_SELECTED):
                if j < n_slots:
                    idx_s[j] = Indices[b, s, j]
        T.sync_threads()
        ks, n_sel = _compressed_span(T, by_index, Indices, KE, b, s, n_slots)
        lo, window_tiles, tiles = _tile_plan(T, own, WindowStart[b, s], window, n_sel)
        return ks, n_sel, lo, window_tiles, tiles

    return query_plan


# TileLang 0.1.15 numbers the named barriers of each warpgroup's shared-memory syncs itself, and
# the barrier it puts after the producer's cp.async wait can take the id of a consumer's barrier
# (seen in the range-mode forward): two roles on one 128-thread barrier deadlock or race. The
# generated CUDA is therefore post-processed: every role gets its own ids.
ROLE_BARRIER_IDS = (11, 12, 13)  # producer, consumer 0, consumer 1 (0 is __syncthreads)
_ROLE_MARK = re.compile(r"warpgroup_reg_(?:alloc|dealloc)<")
_PARTIAL_SYNC = re.compile(r"__sync_thread_partial\(\d+, 128\)")


def separate_role_barriers(code: str) -> str:
    """The forward's CUDA with each role's 128-thread named barriers renumbered to its own id
    (roles start at their setmaxnreg); any other kernel's code is returned unchanged."""
    if "sparse_window_fwd" not in code:
        return code
    marks = [m.start() for m in _ROLE_MARK.finditer(code)]
    if len(marks) != 3:
        raise RuntimeError(f"sparse_window_fwd: expected 3 warpgroup roles in the CUDA, found {len(marks)}")
    parts = [code[: marks[0]]]
    for role, (a, b) in enumerate(zip(marks, marks[1:] + [len(code)])):
        parts.append(_PARTIAL_SYNC.sub(f"__sync_thread_partial({ROLE_BARRIER_IDS[role]}, 128)", code[a:b]))
    return "".join(parts)


def _cuda_postproc(code, _target):
    return separate_role_barriers(code)


_postproc_registered = False


def register_barrier_postproc() -> None:
    """Install :func:`separate_role_barriers` as TileLang's CUDA post-processing hook, once per
    process (it passes every other kernel's code through unchanged)."""
    global _postproc_registered
    if not _postproc_registered:
        from tilelang.engine.callback import register_cuda_postproc_callback

        register_cuda_postproc_callback(_cuda_postproc)
        _postproc_registered = True


def _compile_forward(config: "ForwardConfig"):
    register_barrier_postproc()
    return compile_cached(sparse_window_fwd_kernel, pass_configs=config.pass_configs(), **config.kernel_kwargs())


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


# The forwards' producers do not wait for their own copies: each thread's cp.async arrive on the
# stage's mbarrier when they land (cp.async.mbarrier.arrive.noinc; the barriers count the 128
# producer threads), so a producer issues the next tile's rows at once. The index row the copies
# read lives in static shared memory: in the dynamic buffer, beside the tiles the cp.async write,
# TileLang put a barrier before every row's copy.
NO_COPY_WAIT = {"parallel_async_without_async_commit_wait": True}


def _key_tile_producer(T, by_index: bool, num_stages: int, half: int):
    """The producer warpgroup of "split-pv" and "balanced": once a ring stage is free again
    (``empty``), each tile's 64 key rows go into its two D halves (k_l, k_r) by 16-byte cp.async
    with a zero source size for rows the query must not see; the copies themselves signal the
    consumers (``full``) as they land (NO_COPY_WAIT). Window tiles read raw rows by position, the
    others compressed rows by index (``idx_s``) or from the range's start ``ks``."""
    bf16, BK = T.bfloat16, BLOCK_KEYS

    @T.macro
    def produce(Raw, Comp, idx_s, k_l, k_r, full, empty, b, tiles, window_tiles, lo, own, n_sel, ks, n_raw, n_comp):
        for t in T.serial(tiles):
            stage = t % num_stages
            T.mbarrier_wait_parity(empty[stage], ((t // num_stages) % 2) ^ 1)
            if t < window_tiles:
                for r, d in T.Parallel(BK, half, prefer_async=True, annotations=NO_COPY_WAIT):
                    k_l[stage, r, d] = T.if_then_else(
                        lo + t * BK + r <= own, Raw[b, T.min(lo + t * BK + r, n_raw - 1), d], T.cast(0, bf16)
                    )
                    k_r[stage, r, d] = T.if_then_else(
                        lo + t * BK + r <= own, Raw[b, T.min(lo + t * BK + r, n_raw - 1), half + d], T.cast(0, bf16)
                    )
            else:
                base = (t - window_tiles) * BK
                if by_index:
                    for r, d in T.Parallel(BK, half, prefer_async=True, annotations=NO_COPY_WAIT):
                        k_l[stage, r, d] = T.if_then_else(
                            (base + r < n_sel) & (idx_s[T.min(base + r, MAX_SELECTED - 1)] >= 0) & (idx_s[T.min(base + r, MAX_SELECTED - 1)] < n_comp),
                            Comp[b, T.max(idx_s[T.min(base + r, MAX_SELECTED - 1)], 0), d], T.cast(0, bf16),
                        )
                        k_r[stage, r, d] = T.if_then_else(
                            (base + r < n_sel) & (idx_s[T.min(base + r, MAX_SELECTED - 1)] >= 0) & (idx_s[T.min(base + r, MAX_SELECTED - 1)] < n_comp),
                            Comp[b, T.max(idx_s[T.min(base + r, MAX_SELECTED - 1)], 0), half + d], T.cast(0, bf16),
                        )
                else:
                    for r, d in T.Parallel(BK, half, prefer_async=True, annotations=NO_COPY_WAIT):
                        k_l[stage, r, d] = T.if_then_else(
                            base + r < n_sel, Comp[b, T.min(ks + base + r, n_comp - 1), d], T.cast(0, bf16)
                        )
                        k_r[stage, r, d] = T.if_then_else(
                            base + r < n_sel, Comp[b, T.min(ks + base + r, n_comp - 1), half + d], T.cast(0, bf16)
                        )
            T.cp_async_barrier_noinc(full[stage])

    return produce


def sparse_window_fwd_kernel(
    dim: int,
    mode: str,
    num_stages: int,
    consumer0_registers: int,
    consumer1_registers: int,
    producer_registers: int,
    schedule: str,
):
    """PrimFunc of the forward for one configuration. Grid: (S, H / 64, B); H a multiple of 64
    (the wrapper zero-pads q's heads: padded heads compute rows nobody reads). ``schedule``
    "balanced" gives :func:`sparse_window_fwd_balanced_kernel`, "alternating" the kernel of
    ``forward_alternating.py``.

    Arguments: Q [B, S, H, D], Raw [B, N_raw, D], Comp [B, K, D] (bf16), WindowStart [B, S],
    Indices [B, S, T] with KE [B, S] = 1 + its last valid slot, or KS/KE [B, S] (int32), Sink [H]
    fp32, Params [2] fp32 (scale, has_sink),
    Window [1] int32; out: Out [B, S, H, D] bf16, Lse [B, S, H] fp32 (natural log).
    """
    if schedule in ("balanced", "balanced-lean"):
        return sparse_window_fwd_balanced_kernel(
            dim, mode, num_stages, consumer0_registers, consumer1_registers, producer_registers,
            lean_softmax=schedule == "balanced-lean",
        )
    if schedule == "alternating":
        from nemo_dsa.ops.sparse_attention.forward_alternating import sparse_window_fwd_alternating_kernel

        return sparse_window_fwd_alternating_kernel(
            dim, mode, num_stages, consumer0_registers, consumer1_registers, producer_registers
        )
    T = tilelang().language
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    HB, BK, D, half = BLOCK_HEADS, BLOCK_KEYS, dim, dim // 2
    batch, seq_len, heads = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("heads")
    n_raw, n_comp, n_slots = T.dynamic("n_raw"), T.dynamic("n_comp"), T.dynamic("n_slots")
    by_index = mode == "indices"
    idx_shape = [batch, seq_len, n_slots] if by_index else [batch, seq_len]
    produce_key_tiles = _key_tile_producer(T, by_index, num_stages, half)
    query_plan = _query_plan(T, by_index)

    @T.prim_func
    def sparse_window_fwd(
        Q: T.Tensor([batch, seq_len, heads, D], bf16),
        Raw: T.Tensor([batch, n_raw, D], bf16),
        Comp: T.Tensor([batch, n_comp, D], bf16),
        WindowStart: T.Tensor([batch, seq_len], i32),
        Indices: T.Tensor(idx_shape, i32),
        KE: T.Tensor([batch, seq_len], i32),
        Sink: T.Tensor([heads], f32),
        Params: T.Tensor([2], f32),
        Window: T.Tensor([1], i32),
        Out: T.Tensor([batch, seq_len, heads, D], bf16),
        Lse: T.Tensor([batch, seq_len, heads], f32),
    ):
        with T.Kernel(seq_len, heads // HB, batch, threads=FWD_THREADS) as (s, g, b):
            tx = T.get_thread_binding()
            q_l = T.alloc_shared([HB, half], bf16)
            q_r = T.alloc_shared([HB, half], bf16)
            k_l = T.alloc_shared([num_stages, BK, half], bf16)
            k_r = T.alloc_shared([num_stages, BK, half], bf16)
            p_shared = T.alloc_shared([HB, BK], bf16)
            alpha_s = T.alloc_shared([HB], f32)
            final_s = T.alloc_shared([HB], f32)
            idx_s = T.alloc_shared([MAX_SELECTED if by_index else 1], i32, scope="shared")  # static: see NO_COPY_WAIT
            full = T.alloc_barrier([128] * num_stages)  # producer threads (cp.async noinc)
            empty = T.alloc_barrier([256] * num_stages)  # both consumers
            p_ready = T.alloc_barrier([128])  # consumer 0
            p_free = T.alloc_barrier([128])  # consumer 1
            done = T.alloc_barrier([128])  # consumer 0: final scale written

            acc_s = T.alloc_fragment([HB, BK], f32)
            acc_o_l = T.alloc_fragment([HB, half], f32)
            acc_o_r = T.alloc_fragment([HB, half], f32)
            m_i = T.alloc_fragment([HB], f32)
            m_prev = T.alloc_fragment([HB], f32)
            row_sum = T.alloc_fragment([HB], f32)
            tile_sum = T.alloc_fragment([HB], f32)
            alpha = T.alloc_fragment([HB], f32)
            sink_f = T.alloc_fragment([HB], f32)

            h0 = g * HB
            own = s + n_raw - seq_len
            scale_log2 = Params[0] * LOG2E
            has_sink = Params[1] > 0.5
            window = Window[0]
            ks, n_sel, lo, window_tiles, tiles = query_plan(idx_s, Indices, KE, WindowStart, window, b, s, own, n_slots)

            if tx < 128:
                T.set_max_nreg(producer_registers, 0)
                produce_key_tiles(Raw, Comp, idx_s, k_l, k_r, full, empty, b, tiles, window_tiles, lo, own, n_sel, ks,
                                  n_raw, n_comp)  # fmt: skip
            elif tx < 256:
                T.set_max_nreg(consumer0_registers, 1)
                # Only consumer 0 reads Q: its 128 threads load it (16-byte loads) while the
                # producer already fetches the first key tiles.
                T.copy(Q[b, s, h0 : h0 + HB, 0:half], q_l, disable_tma=True)
                T.copy(Q[b, s, h0 : h0 + HB, half:D], q_r, disable_tma=True)
                T.fill(m_i, M_FLOOR)
                T.fill(row_sum, 0)
                T.fill(acc_o_l, 0)
                for t in T.serial(tiles):
                    stage = t % num_stages
                    T.mbarrier_wait_parity(full[stage], (t // num_stages) % 2)
                    T.fence_proxy_async()  # rows written by cp.async (generic proxy), read by wgmma
                    T.gemm(q_l, k_l[stage, :, :], acc_s, transpose_B=True, clear_accum=True)
                    T.gemm(q_r, k_r[stage, :, :], acc_s, transpose_B=True)
                    for h, c in T.Parallel(HB, BK):
                        slot = T.max((t - window_tiles) * BK + c, 0)
                        if by_index:
                            key = idx_s[T.min(slot, MAX_SELECTED - 1)]
                            comp_seen = (slot < n_sel) & (key >= 0) & (key < n_comp)
                        else:
                            comp_seen = slot < n_sel
                        seen = T.if_then_else(t < window_tiles, lo + t * BK + c <= own, comp_seen)
                        acc_s[h, c] = T.if_then_else(seen, acc_s[h, c] * scale_log2, -T.infinity(f32))
                    T.copy(m_i, m_prev)
                    T.reduce_max(acc_s, m_i, dim=1, clear=False)
                    for h in T.Parallel(HB):
                        alpha[h] = T.exp2(m_prev[h] - m_i[h])
                    for h, c in T.Parallel(HB, BK):
                        acc_s[h, c] = T.exp2(acc_s[h, c] - m_i[h])
                    T.reduce_sum(acc_s, tile_sum, dim=1)
                    for h in T.Parallel(HB):
                        row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h]
                    for h, d in T.Parallel(HB, half):
                        acc_o_l[h, d] *= alpha[h]
                    if t > 0:
                        T.mbarrier_wait_parity(p_free[0], (t - 1) % 2)  # consumer 1 read P of t - 1
                    T.copy(alpha, alpha_s)
                    T.copy(acc_s, p_shared)
                    T.fence_proxy_async()
                    T.mbarrier_arrive(p_ready[0])
                    T.gemm(p_shared, k_l[stage, :, :], acc_o_l)
                    T.mbarrier_arrive(empty[stage])
                # Sink in the denominator only; empty rows (no key, no sink) give 0 and -inf.
                for h in T.Parallel(HB):
                    sink_f[h] = T.if_then_else(has_sink, Sink[h0 + h] * LOG2E, M_FLOOR)
                for h in T.Parallel(HB):
                    m_prev[h] = T.max(m_i[h], sink_f[h])  # final max
                    row_sum[h] = row_sum[h] * T.exp2(m_i[h] - m_prev[h]) + T.if_then_else(
                        has_sink, T.exp2(sink_f[h] - m_prev[h]), T.cast(0, f32)
                    )
                    alpha[h] = T.if_then_else(row_sum[h] > 0, T.exp2(m_i[h] - m_prev[h]) / row_sum[h], T.cast(0, f32))
                if tiles > 0:
                    T.mbarrier_wait_parity(p_free[0], (tiles - 1) % 2)
                T.copy(alpha, final_s)
                T.mbarrier_arrive(done[0])
                for h in T.Parallel(HB):
                    Lse[b, s, h0 + h] = T.if_then_else(
                        row_sum[h] > 0, (m_prev[h] + T.log2(row_sum[h])) / LOG2E, -T.infinity(f32)
                    )
                for h, d in T.Parallel(HB, half):
                    acc_o_l[h, d] *= alpha[h]
                T.copy(acc_o_l, q_l)
                T.copy(q_l, Out[b, s, h0 : h0 + HB, 0:half], disable_tma=True)
            else:
                T.set_max_nreg(consumer1_registers, 1)
                T.fill(acc_o_r, 0)
                for t in T.serial(tiles):
                    stage = t % num_stages
                    T.mbarrier_wait_parity(p_ready[0], t % 2)
                    T.fence_proxy_async()
                    for h, d in T.Parallel(HB, half):
                        acc_o_r[h, d] *= alpha_s[h]
                    T.gemm(p_shared, k_r[stage, :, :], acc_o_r)
                    T.mbarrier_arrive(p_free[0])
                    T.mbarrier_arrive(empty[stage])
                T.mbarrier_wait_parity(done[0], 0)
                for h, d in T.Parallel(HB, half):
                    acc_o_r[h, d] *= final_s[h]
                T.copy(acc_o_r, q_r)
                T.copy(q_r, Out[b, s, h0 : h0 + HB, half:D], disable_tma=True)

    return sparse_window_fwd


EXCHANGE_BARRIER = 8  # named barriers of the two consumers of the balanced forward (256 threads)
P_READY_BARRIER = 9
# "balanced-lean": a row's reference max moves only when a logit exceeds it by more than this
# (log2 units): P <= 2^8 in bf16 loses nothing (its relative rounding does not depend on scale),
# and the sums stay far from fp32's range.
LAZY_RESCALE_LOG2 = 8.0


def sparse_window_fwd_balanced_kernel(
    dim: int,
    mode: str,
    num_stages: int,
    consumer0_registers: int,
    consumer1_registers: int,
    producer_registers: int,
    lean_softmax: bool = False,
):
    """The forward with FlashMLA's balance: consumer ``me`` (0, 1) scores keys [32 me, 32 me + 32)
    of each tile (S = Q K^T over all of D), the two exchange their row maxima through shared
    memory (named barrier 8), each writes its P half, and after named barrier 9 each adds
    P V[:, its D half] over all 64 keys. Both keep the same running max and their own partial
    row sums (added at the end), so each warpgroup does half of every GEMM. Same arguments,
    grid and producer as :func:`sparse_window_fwd_kernel`.

    ``lean_softmax`` ("balanced-lean", the default) shortens the per-tile section between S and P V,
    which a clock64 trace measured at 58 % of a tile (docs/performance.md v21): consumer 0 writes
    each tile's 64 column flags once (``seen_s``), so the mask is a load and a select per logit,
    and a row's reference max (and O, the sums with it) moves only when a logit exceeds it by
    more than 2^LAZY_RESCALE_LOG2 (a warp's vote: both consumers' warp w hold the same rows)."""
    T = tilelang().language
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    HB, BK, D, half = BLOCK_HEADS, BLOCK_KEYS, dim, dim // 2
    KH = BK // 2  # keys scored per consumer
    batch, seq_len, heads = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("heads")
    n_raw, n_comp, n_slots = T.dynamic("n_raw"), T.dynamic("n_comp"), T.dynamic("n_slots")
    by_index = mode == "indices"
    idx_shape = [batch, seq_len, n_slots] if by_index else [batch, seq_len]
    produce_key_tiles = _key_tile_producer(T, by_index, num_stages, half)
    query_plan = _query_plan(T, by_index)

    @T.macro
    def tile_columns_seen(seen_s, tt, window_tiles, lo, own, n_sel, n_comp_, idx_s):
        """seen_s[tt % 2, c] = 1 where key c of tile ``tt`` is visible, else 0: computed once per
        column (by consumer 0), so that the consumers' mask is one shared load and a select per
        logit instead of each thread's own per-logit index arithmetic and branches."""
        for c in T.Parallel(BK):
            slot = T.max((tt - window_tiles) * BK + c, 0)
            if by_index:
                key = idx_s[T.min(slot, MAX_SELECTED - 1)]
                comp_seen = (slot < n_sel) & (key >= 0) & (key < n_comp_)
            else:
                comp_seen = slot < n_sel
            seen = T.if_then_else(tt < window_tiles, lo + tt * BK + c <= own, comp_seen)
            seen_s[tt % 2, c] = T.if_then_else(seen, T.float32(1), T.float32(0))

    @T.macro
    def consumer(me, q_l, q_r, k_l, k_r, k_mine, p_shared, max_x, sum_x, seen_s, full, empty, acc_s, acc_o, m_i,
                 m_prev, row_sum, tile_max, tile_sum, alpha, sink_f, tiles, window_tiles, lo, own, n_sel, n_comp_,
                 idx_s, scale_log2, has_sink, Sink, Out, Lse, b, s, h0):
        c0 = me * KH
        T.fill(m_i, M_FLOOR)
        T.fill(row_sum, 0)
        T.fill(acc_o, 0)
        for t in T.serial(tiles):
            stage = t % num_stages
            T.mbarrier_wait_parity(full[stage], (t // num_stages) % 2)
            T.fence_proxy_async()  # rows written by cp.async (generic proxy), read by wgmma
            T.gemm(q_l, k_l[stage, c0 : c0 + KH, :], acc_s, transpose_B=True, clear_accum=True)
            T.gemm(q_r, k_r[stage, c0 : c0 + KH, :], acc_s, transpose_B=True)
            if lean_softmax:
                for h, c in T.Parallel(HB, KH):
                    acc_s[h, c] = T.if_then_else(seen_s[t % 2, c0 + c] > 0.5, acc_s[h, c] * scale_log2, -T.infinity(f32))
            else:
                for h, c in T.Parallel(HB, KH):
                    col = c0 + c
                    slot = T.max((t - window_tiles) * BK + col, 0)
                    if by_index:
                        key = idx_s[T.min(slot, MAX_SELECTED - 1)]
                        comp_seen = (slot < n_sel) & (key >= 0) & (key < n_comp_)
                    else:
                        comp_seen = slot < n_sel
                    seen = T.if_then_else(t < window_tiles, lo + t * BK + col <= own, comp_seen)
                    acc_s[h, c] = T.if_then_else(seen, acc_s[h, c] * scale_log2, -T.infinity(f32))
            T.reduce_max(acc_s, tile_max, dim=1, clear=True)
            for h in T.Parallel(HB):
                max_x[me, h] = tile_max[h]
            T.sync_threads(EXCHANGE_BARRIER, 256)  # both halves' maxima written
            if lean_softmax:
                # m_i only moves (and O, the sums with it) when some row of this warp's 16 would
                # otherwise see a logit above 2^LAZY_RESCALE_LOG2 times its reference; both
                # consumers' warp w hold the same rows and maxima, so they decide alike.
                need = T.alloc_var(i32)
                need = 0
                for h in T.Parallel(HB):
                    m_prev[h] = T.max(m_i[h], T.max(max_x[0, h], max_x[1, h]))
                    need = need | T.if_then_else(m_prev[h] > m_i[h] + LAZY_RESCALE_LOG2, 1, 0)
                if T.call_extern(i32, "__any_sync", T.uint32(0xFFFFFFFF), need) != 0:
                    for h in T.Parallel(HB):
                        alpha[h] = T.exp2(m_i[h] - m_prev[h])
                        m_i[h] = m_prev[h]
                        row_sum[h] = row_sum[h] * alpha[h]
                    for h, d in T.Parallel(HB, half):
                        acc_o[h, d] *= alpha[h]
                for h, c in T.Parallel(HB, KH):
                    acc_s[h, c] = T.exp2(acc_s[h, c] - m_i[h])
                T.reduce_sum(acc_s, tile_sum, dim=1)
                for h in T.Parallel(HB):
                    row_sum[h] = row_sum[h] + tile_sum[h]
            else:
                T.copy(m_i, m_prev)
                for h in T.Parallel(HB):
                    m_i[h] = T.max(m_prev[h], T.max(max_x[0, h], max_x[1, h]))
                    alpha[h] = T.exp2(m_prev[h] - m_i[h])
                for h, c in T.Parallel(HB, KH):
                    acc_s[h, c] = T.exp2(acc_s[h, c] - m_i[h])
                T.reduce_sum(acc_s, tile_sum, dim=1)
                for h in T.Parallel(HB):
                    row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h]
                for h, d in T.Parallel(HB, half):
                    acc_o[h, d] *= alpha[h]
            T.copy(acc_s, p_shared[:, c0 : c0 + KH])
            # The next tile's columns, into the other seen_s row: both consumers read this tile's
            # row before the exchange barrier, and read the next one after P_READY below. (Here,
            # with the logits dead, it takes no registers the consumer lacks: before, it spilled.)
            if lean_softmax and me == 0:
                if t + 1 < tiles:
                    tile_columns_seen(seen_s, t + 1, window_tiles, lo, own, n_sel, n_comp_, idx_s)
            T.fence_proxy_async()
            T.sync_threads(P_READY_BARRIER, 256)  # both P halves written (and both maxima read)
            T.gemm(p_shared, k_mine[stage, :, :], acc_o)
            T.mbarrier_arrive(empty[stage])
        # Row sums: each consumer summed its own keys; the maxima are the same in both.
        for h in T.Parallel(HB):
            sum_x[me, h] = row_sum[h]
        T.sync_threads(EXCHANGE_BARRIER, 256)
        for h in T.Parallel(HB):
            sink_f[h] = T.if_then_else(has_sink, Sink[h0 + h] * LOG2E, M_FLOOR)
        for h in T.Parallel(HB):
            m_prev[h] = T.max(m_i[h], sink_f[h])  # final max
            row_sum[h] = (sum_x[0, h] + sum_x[1, h]) * T.exp2(m_i[h] - m_prev[h]) + T.if_then_else(
                has_sink, T.exp2(sink_f[h] - m_prev[h]), T.cast(0, f32)
            )
            alpha[h] = T.if_then_else(row_sum[h] > 0, T.exp2(m_i[h] - m_prev[h]) / row_sum[h], T.cast(0, f32))
        if me == 0:
            for h in T.Parallel(HB):
                Lse[b, s, h0 + h] = T.if_then_else(
                    row_sum[h] > 0, (m_prev[h] + T.log2(row_sum[h])) / LOG2E, -T.infinity(f32)
                )
        for h, d in T.Parallel(HB, half):
            acc_o[h, d] *= alpha[h]
        # Q is dead once both consumers passed the last tile: each stages its half of O there.
        T.sync_threads(P_READY_BARRIER, 256)
        if me == 0:
            T.copy(acc_o, q_l)
            T.copy(q_l, Out[b, s, h0 : h0 + HB, 0:half], disable_tma=True)
        else:
            T.copy(acc_o, q_r)
            T.copy(q_r, Out[b, s, h0 : h0 + HB, half:D], disable_tma=True)

    @T.prim_func
    def sparse_window_fwd_balanced(
        Q: T.Tensor([batch, seq_len, heads, D], bf16),
        Raw: T.Tensor([batch, n_raw, D], bf16),
        Comp: T.Tensor([batch, n_comp, D], bf16),
        WindowStart: T.Tensor([batch, seq_len], i32),
        Indices: T.Tensor(idx_shape, i32),
        KE: T.Tensor([batch, seq_len], i32),
        Sink: T.Tensor([heads], f32),
        Params: T.Tensor([2], f32),
        Window: T.Tensor([1], i32),
        Out: T.Tensor([batch, seq_len, heads, D], bf16),
        Lse: T.Tensor([batch, seq_len, heads], f32),
    ):
        with T.Kernel(seq_len, heads // HB, batch, threads=FWD_THREADS) as (s, g, b):
            tx = T.get_thread_binding()
            q_l = T.alloc_shared([HB, half], bf16)
            q_r = T.alloc_shared([HB, half], bf16)
            k_l = T.alloc_shared([num_stages, BK, half], bf16)
            k_r = T.alloc_shared([num_stages, BK, half], bf16)
            p_shared = T.alloc_shared([HB, BK], bf16)
            max_x = T.alloc_shared([2, HB], f32)
            sum_x = T.alloc_shared([2, HB], f32)
            seen_s = T.alloc_shared([2, BK] if lean_softmax else [1, 1], f32)  # lean: key c of tile t seen (row t % 2)
            idx_s = T.alloc_shared([MAX_SELECTED if by_index else 1], i32, scope="shared")  # static: see NO_COPY_WAIT
            full = T.alloc_barrier([128] * num_stages)  # producer threads (cp.async noinc)
            empty = T.alloc_barrier([256] * num_stages)  # both consumers

            acc_s0 = T.alloc_fragment([HB, KH], f32)
            acc_s1 = T.alloc_fragment([HB, KH], f32)
            acc_o0 = T.alloc_fragment([HB, half], f32)
            acc_o1 = T.alloc_fragment([HB, half], f32)
            m_i0 = T.alloc_fragment([HB], f32)
            m_i1 = T.alloc_fragment([HB], f32)
            m_prev0 = T.alloc_fragment([HB], f32)
            m_prev1 = T.alloc_fragment([HB], f32)
            row_sum0 = T.alloc_fragment([HB], f32)
            row_sum1 = T.alloc_fragment([HB], f32)
            tile_max0 = T.alloc_fragment([HB], f32)
            tile_max1 = T.alloc_fragment([HB], f32)
            tile_sum0 = T.alloc_fragment([HB], f32)
            tile_sum1 = T.alloc_fragment([HB], f32)
            alpha0 = T.alloc_fragment([HB], f32)
            alpha1 = T.alloc_fragment([HB], f32)
            sink_f0 = T.alloc_fragment([HB], f32)
            sink_f1 = T.alloc_fragment([HB], f32)

            h0 = g * HB
            own = s + n_raw - seq_len
            scale_log2 = Params[0] * LOG2E
            has_sink = Params[1] > 0.5
            window = Window[0]
            ks, n_sel, lo, window_tiles, tiles = query_plan(idx_s, Indices, KE, WindowStart, window, b, s, own, n_slots)

            if tx < 128:
                T.set_max_nreg(producer_registers, 0)
                produce_key_tiles(Raw, Comp, idx_s, k_l, k_r, full, empty, b, tiles, window_tiles, lo, own, n_sel, ks,
                                  n_raw, n_comp)  # fmt: skip
            elif tx < 256:
                T.set_max_nreg(consumer0_registers, 1)
                T.copy(Q[b, s, h0 : h0 + HB, 0:half], q_l, disable_tma=True)  # each consumer loads half of Q
                if lean_softmax:
                    if tiles > 0:
                        tile_columns_seen(seen_s, 0, window_tiles, lo, own, n_sel, n_comp, idx_s)
                T.fence_proxy_async()
                T.sync_threads(EXCHANGE_BARRIER, 256)
                consumer(0, q_l, q_r, k_l, k_r, k_l, p_shared, max_x, sum_x, seen_s, full, empty, acc_s0, acc_o0, m_i0,
                         m_prev0, row_sum0, tile_max0, tile_sum0, alpha0, sink_f0, tiles, window_tiles, lo,
                         own, n_sel, n_comp, idx_s, scale_log2, has_sink, Sink, Out, Lse, b, s, h0)
            else:
                T.set_max_nreg(consumer1_registers, 1)
                T.copy(Q[b, s, h0 : h0 + HB, half:D], q_r, disable_tma=True)
                T.fence_proxy_async()
                T.sync_threads(EXCHANGE_BARRIER, 256)
                consumer(1, q_l, q_r, k_l, k_r, k_r, p_shared, max_x, sum_x, seen_s, full, empty, acc_s1, acc_o1, m_i1,
                         m_prev1, row_sum1, tile_max1, tile_sum1, alpha1, sink_f1, tiles, window_tiles, lo,
                         own, n_sel, n_comp, idx_s, scale_log2, has_sink, Sink, Out, Lse, b, s, h0)

    return sparse_window_fwd_balanced


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

DELTA_ROWS = 32
DELTA_CHUNK = 128


def attention_delta_kernel(dim: int):
    """PrimFunc of delta[r] = sum_d O[r, d] * dO[r, d] in fp32 over rows r of [R, D] bf16."""
    T = tilelang().language
    rows = T.dynamic("rows")

    @T.prim_func
    def attention_delta(
        O: T.Tensor([rows, dim], T.bfloat16),
        dO: T.Tensor([rows, dim], T.bfloat16),
        Delta: T.Tensor([rows], T.float32),
    ):
        with T.Kernel(T.ceildiv(rows, DELTA_ROWS), threads=128) as bx:
            acc = T.alloc_fragment([DELTA_ROWS, DELTA_CHUNK], T.float32)
            total = T.alloc_fragment([DELTA_ROWS], T.float32)
            T.clear(acc)
            for c in T.serial(dim // DELTA_CHUNK):
                for r, d in T.Parallel(DELTA_ROWS, DELTA_CHUNK):
                    row = T.min(bx * DELTA_ROWS + r, rows - 1)
                    acc[r, d] += T.cast(O[row, c * DELTA_CHUNK + d], T.float32) * T.cast(
                        dO[row, c * DELTA_CHUNK + d], T.float32
                    )
            T.reduce_sum(acc, total, dim=1)
            for r in T.Parallel(DELTA_ROWS):
                if bx * DELTA_ROWS + r < rows:
                    Delta[bx * DELTA_ROWS + r] = total[r]

    return attention_delta


def sparse_window_bwd_kernel(dim: int, mode: str, dkv_chunk: int, schedule: str):
    """PrimFunc of the backward for one configuration. Grid: (S, H / 64, B), 256 threads; H a
    multiple of 64 (zero q and dO rows in padded heads contribute exact zeros).

    Arguments as the forward's inputs plus Needs [3] int32 (nonzero: dq, d raw rows, d compressed
    rows wanted), dO [B, S, H, D] bf16, Lse [B, S, H] fp32, the forward's O [B, S, H, D] bf16; out:
    Delta [B, S, H] fp32 (rowsum(dO * O), every element written), dQ [B, S, H, D] bf16
    (written only if wanted) and dKV [B, N_raw + K, D] fp32 (raw rows first, then compressed),
    which must hold zeros on entry in the wanted rows (the tiles' contributions are added
    atomically; unwanted rows are never touched).

    ``schedule`` (BWD_SCHEDULES): "serial" waits for each wgmma before the next step; "pipelined"
    issues S and dP together, and each dkv chunk's GEMMs before the previous chunk's atomics (two
    accumulators), so the atomics overlap the tensor cores; "staged" is pipelined and writes each
    chunk to shared memory first, so that its atomics are 16 bytes wide and each warp's cover
    two whole key rows of the chunk (the fragment layout gives 8-byte atomics spread over 8 rows).
    """
    T = tilelang().language
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    HB, BK, D = BLOCK_HEADS, BLOCK_KEYS, dim
    batch, seq_len, heads = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("heads")
    n_raw, n_comp, n_slots = T.dynamic("n_raw"), T.dynamic("n_comp"), T.dynamic("n_slots")
    by_index = mode == "indices"
    idx_shape = [batch, seq_len, n_slots] if by_index else [batch, seq_len]

    # The key rows of tile ``tt`` into k_s by zero-filling cp.async, one source per tile (a
    # uniform branch), rows computed, not read from rows_s: a select between the two sources went
    # through registers (LDG, then an STS waiting on it: 18 % of the stall samples), and a read
    # of rows_s put a barrier before every row (docs/performance.md v14). No wait here: the copy
    # overlaps the previous tile's dkv GEMMs and atomics, which do not read k_s.
    no_wait = {"parallel_async_without_async_commit_wait": True}

    @T.macro
    def load_keys(k_s, Raw, Comp, Indices, b, s, tt, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots):
        base = (tt - window_tiles) * BK
        if tt < window_tiles:
            for r, d in T.Parallel(BK, D, prefer_async=True, annotations=no_wait):
                k_s[r, d] = T.if_then_else(
                    lo + tt * BK + r <= own, Raw[b, T.min(lo + tt * BK + r, n_raw - 1), d], T.cast(0, bf16)
                )
        elif by_index:
            for r, d in T.Parallel(BK, D, prefer_async=True, annotations=no_wait):
                k_s[r, d] = T.if_then_else(
                    (base + r < n_sel) & (Indices[b, s, T.min(base + r, n_slots - 1)] >= 0)
                    & (Indices[b, s, T.min(base + r, n_slots - 1)] < n_comp),
                    Comp[b, T.max(Indices[b, s, T.min(base + r, n_slots - 1)], 0), d], T.cast(0, bf16),
                )  # fmt: skip
        else:
            for r, d in T.Parallel(BK, D, prefer_async=True, annotations=no_wait):
                k_s[r, d] = T.if_then_else(
                    base + r < n_sel, Comp[b, T.min(ks + base + r, n_comp - 1), d], T.cast(0, bf16)
                )
        T.ptx_commit_group()

    pipelined = schedule != "serial"
    staged = schedule == "staged"
    n_chunks = D // dkv_chunk
    if pipelined and n_chunks % 2:
        raise ValueError(f"the pipelined backward needs an even number of dkv chunks, got {n_chunks}")
    # Accumulator registers per thread, for the fences that keep nvcc from reading an accumulator
    # before its wgmma's wait.
    pair_regs, dq_regs, kv_regs = HB * BK // BWD_THREADS, HB * D // BWD_THREADS, BK * dkv_chunk // BWD_THREADS

    @T.macro
    def next_keys(k_s, Raw, Comp, Indices, b, s, t, tiles, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots):
        if t + 1 < tiles:
            load_keys(k_s, Raw, Comp, Indices, b, s, t + 1, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots)

    @T.macro
    def issue_dkv(ds_s, p_s, q_s, do_s, acc, c):
        """acc = dS^T Q + P^T dO for columns of chunk ``c``, issued and not waited for."""
        T.wgmma_gemm(ds_s, q_s[:, c * dkv_chunk : (c + 1) * dkv_chunk], acc, transpose_A=True, clear_accum=True)
        T.wgmma_gemm(p_s, do_s[:, c * dkv_chunk : (c + 1) * dkv_chunk], acc, transpose_A=True)

    @T.macro
    def add_dkv_direct(dKV, acc, rows_s, stage_s, b, c):
        for r, d in T.Parallel(BK, dkv_chunk):
            if rows_s[r] >= 0:
                T.atomic_add(dKV[b, rows_s[r], c * dkv_chunk + d], acc[r, d])

    @T.macro
    def add_dkv_staged(dKV, acc, rows_s, stage_s, b, c):
        T.sync_threads()  # every thread has read the previous chunk's staging tile
        for r, d in T.Parallel(BK, dkv_chunk):
            stage_s[r, d] = acc[r, d]
        T.sync_threads()
        for r, d in T.Parallel(BK, dkv_chunk):
            if rows_s[r] >= 0:
                T.atomic_add(dKV[b, rows_s[r], c * dkv_chunk + d], stage_s[r, d])

    add_dkv = add_dkv_staged if staged else add_dkv_direct

    @T.prim_func
    def sparse_window_bwd(
        Q: T.Tensor([batch, seq_len, heads, D], bf16),
        Raw: T.Tensor([batch, n_raw, D], bf16),
        Comp: T.Tensor([batch, n_comp, D], bf16),
        WindowStart: T.Tensor([batch, seq_len], i32),
        Indices: T.Tensor(idx_shape, i32),
        KE: T.Tensor([batch, seq_len], i32),
        Params: T.Tensor([2], f32),
        Window: T.Tensor([1], i32),
        Needs: T.Tensor([3], i32),
        dO: T.Tensor([batch, seq_len, heads, D], bf16),
        Lse: T.Tensor([batch, seq_len, heads], f32),
        O: T.Tensor([batch, seq_len, heads, D], bf16),
        Delta: T.Tensor([batch, seq_len, heads], f32),
        dQ: T.Tensor([batch, seq_len, heads, D], bf16),
        dKV: T.Tensor([batch, n_raw + n_comp, D], f32),
    ):
        with T.Kernel(seq_len, heads // HB, batch, threads=BWD_THREADS) as (s, g, b):
            q_s = T.alloc_shared([HB, D], bf16)
            do_s = T.alloc_shared([HB, D], bf16)
            k_s = T.alloc_shared([BK, D], bf16)
            p_s = T.alloc_shared([HB, BK], bf16)
            ds_s = T.alloc_shared([HB, BK], bf16)
            rows_s = T.alloc_shared([BK], i32)  # dKV row of each key of the tile, -1 = unseen
            stage_s = T.alloc_shared([BK, dkv_chunk + STAGE_ROW_PAD] if staged else [1, 8], f32)
            acc_s = T.alloc_fragment([HB, BK], f32)
            acc_dp = T.alloc_fragment([HB, BK], f32)
            acc_dq = T.alloc_fragment([HB, D], f32)
            acc_kv = T.alloc_fragment([BK, dkv_chunk], f32)
            acc_kv1 = T.alloc_fragment([BK, dkv_chunk], f32)  # pipelined: the other chunk
            lse2 = T.alloc_fragment([HB], f32)
            delta = T.alloc_fragment([HB], f32)
            o_do = T.alloc_fragment([HB, DELTA_CHUNK], f32)
            o_do_sum = T.alloc_fragment([HB], f32)
            delta_s = T.alloc_shared([HB], f32)

            h0 = g * HB
            own = s + n_raw - seq_len
            scale = Params[0]
            scale_log2 = Params[0] * LOG2E
            window = Window[0]
            need_dq, need_d_raw, need_d_comp = Needs[0] > 0, Needs[1] > 0, Needs[2] > 0
            ks, n_sel = _compressed_span(T, by_index, Indices, KE, b, s, n_slots)  # as in the forward
            lo, window_tiles, tiles = _tile_plan(T, own, WindowStart[b, s], window, n_sel)

            # The first key tile's cp.async go out before Q, dO and O are loaded (plain loads), so
            # that the two kinds of load overlap.
            if tiles > 0:
                load_keys(k_s, Raw, Comp, Indices, b, s, 0, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots)
            T.copy(Q[b, s, h0 : h0 + HB, :], q_s, disable_tma=True)
            T.copy(dO[b, s, h0 : h0 + HB, :], do_s, disable_tma=True)
            # delta = rowsum(dO * O) here, from dO already in shared memory (the separate delta
            # kernel read dO a second time); written out for the sink's gradient.
            T.clear(delta_s)
            for c in T.unroll(D // DELTA_CHUNK):  # unrolled: all of O's loads in flight at once
                for h, d in T.Parallel(HB, DELTA_CHUNK):
                    o_do[h, d] = T.cast(O[b, s, h0 + h, c * DELTA_CHUNK + d], f32) * T.cast(do_s[h, c * DELTA_CHUNK + d], f32)
                T.reduce_sum(o_do, o_do_sum, dim=1)
                for h in T.Parallel(HB):
                    delta_s[h] += o_do_sum[h]
            for h in T.Parallel(HB):
                lse2[h] = Lse[b, s, h0 + h] * LOG2E
                delta[h] = delta_s[h]
            for h in T.Parallel(HB):
                Delta[b, s, h0 + h] = delta_s[h]
            T.clear(acc_dq)
            for t in T.serial(tiles):
                base = (t - window_tiles) * BK
                for r in T.Parallel(BK):
                    if t < window_tiles:
                        rows_s[r] = T.if_then_else(lo + t * BK + r <= own, lo + t * BK + r, -1)
                    else:
                        if by_index:
                            key = T.if_then_else(base + r < n_sel, Indices[b, s, T.min(base + r, n_slots - 1)], -1)
                            rows_s[r] = T.if_then_else((key >= 0) & (key < n_comp), n_raw + key, -1)
                        else:
                            rows_s[r] = T.if_then_else(base + r < n_sel, n_raw + ks + base + r, -1)
                T.sync_threads()
                # The tile's key rows were prefetched (before the loop, or during the previous
                # tile's dkv GEMMs): wait for them here.
                T.ptx_wait_group(0)
                T.sync_threads()
                if pipelined:
                    T.wgmma_gemm(q_s, k_s, acc_s, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(do_s, k_s, acc_dp, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(acc_s, num_regs=pair_regs)
                    T.warpgroup_fence_operand(acc_dp, num_regs=pair_regs)
                else:
                    T.gemm(q_s, k_s, acc_s, transpose_B=True, clear_accum=True)
                    T.gemm(do_s, k_s, acc_dp, transpose_B=True, clear_accum=True)
                for h, c in T.Parallel(HB, BK):
                    acc_s[h, c] = T.if_then_else(
                        rows_s[c] >= 0, T.exp2(acc_s[h, c] * scale_log2 - lse2[h]), T.cast(0, f32)
                    )
                    acc_dp[h, c] = acc_s[h, c] * (acc_dp[h, c] - delta[h]) * scale
                T.copy(acc_s, p_s)
                T.copy(acc_dp, ds_s)
                if pipelined:
                    T.fence_proxy_async()  # P and dS are written by st.shared and read by wgmma
                T.sync_threads()
                # Uniform branches: gradients nobody asked for are neither computed nor added.
                want_dkv = ((t < window_tiles) & need_d_raw) | ((t >= window_tiles) & need_d_comp)
                if pipelined:
                    if need_dq:
                        T.wgmma_gemm(ds_s, k_s, acc_dq)
                    # One branch holds every wgmma of the dkv chunks, so ptxas sees each wait
                    # on every path (it serialises all wgmmas when it cannot).
                    if want_dkv:
                        issue_dkv(ds_s, p_s, q_s, do_s, acc_kv, 0)
                        T.wait_wgmma(2)  # dq's GEMM (the only reader of k_s) is done; chunk 0 runs on
                        T.warpgroup_fence_operand(acc_dq, num_regs=dq_regs)
                        T.sync_threads()  # every warp is done with k_s
                        next_keys(k_s, Raw, Comp, Indices, b, s, t, tiles, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots)
                        # Chunks in pairs (n_chunks is even): acc_kv holds the even ones, acc_kv1
                        # the odd ones; chunk c + 1's GEMMs run while chunk c is added.
                        for j in T.unroll(n_chunks // 2):
                            issue_dkv(ds_s, p_s, q_s, do_s, acc_kv1, 2 * j + 1)
                            T.wait_wgmma(2)
                            T.warpgroup_fence_operand(acc_kv, num_regs=kv_regs)
                            add_dkv(dKV, acc_kv, rows_s, stage_s, b, 2 * j)
                            if 2 * j + 2 < n_chunks:
                                issue_dkv(ds_s, p_s, q_s, do_s, acc_kv, 2 * j + 2)
                                T.wait_wgmma(2)
                            else:
                                T.wait_wgmma(0)
                            T.warpgroup_fence_operand(acc_kv1, num_regs=kv_regs)
                            add_dkv(dKV, acc_kv1, rows_s, stage_s, b, 2 * j + 1)
                    else:
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(acc_dq, num_regs=dq_regs)
                        T.sync_threads()
                        next_keys(k_s, Raw, Comp, Indices, b, s, t, tiles, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots)
                else:
                    if need_dq:
                        T.gemm(ds_s, k_s, acc_dq)
                    T.sync_threads()  # every warp is done with k_s
                    next_keys(k_s, Raw, Comp, Indices, b, s, t, tiles, lo, own, window_tiles, n_sel, ks, n_raw, n_comp, n_slots)
                    if want_dkv:
                        for c in T.serial(n_chunks):
                            T.gemm(ds_s, q_s[:, c * dkv_chunk : (c + 1) * dkv_chunk], acc_kv, transpose_A=True, clear_accum=True)
                            T.gemm(p_s, do_s[:, c * dkv_chunk : (c + 1) * dkv_chunk], acc_kv, transpose_A=True)
                            add_dkv(dKV, acc_kv, rows_s, stage_s, b, c)
                T.sync_threads()
            if need_dq:
                T.copy(acc_dq, q_s)
                T.copy(q_s, dQ[b, s, h0 : h0 + HB, :], disable_tma=True)

    return sparse_window_bwd


def window_dkv_kernel(dim: int):
    """PrimFunc of the window keys' dkv, key-major: no atomics per (query, tile).

    Grid: (ceil(N_raw / 64), n_split, B), 256 threads. Block (k, j, b) owns raw rows
    [64 k, 64 k + 64) of batch b: the queries whose window can reach them own rows
    [64 k, 64 k + 62 + window] (contiguous), split into ``n_split`` runs of ``Chunk[0]`` queries
    (one run per block). For each of its queries that sees one of the rows (same document, in its
    window) and each 64-head group, it recomputes P and dS against the tile (S = Q K^T and
    dP = dO K^T, from the saved lse and delta) and accumulates dkv = dS^T Q + P^T dO for the 64
    rows in registers; at the end the [64, D] sum is added once into DRaw (fp32, zero on entry;
    the runs of a tile are the only adders). Every use of S and dP goes through a select on
    visibility: the tile is shared by queries that see different rows, so an unseen row's NaN
    or inf may reach S, never P, dS or dkv.

    Arguments: Q [B, S, H, D], Raw [B, N_raw, D] (bf16), WindowStart [B, S] int32, Params [2]
    fp32 (scale, has_sink), Window [1] int32, Chunk [n_split] int32 (queries per run),
    dO [B, S, H, D] bf16, Lse and Delta [B, S, H] fp32; out: DRaw [B, N_raw, D] fp32.
    """
    T = tilelang().language
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32
    HB, BK, D = BLOCK_HEADS, BLOCK_KEYS, dim
    batch, seq_len, heads = T.dynamic("batch"), T.dynamic("seq_len"), T.dynamic("heads")
    n_raw, n_split = T.dynamic("n_raw"), T.dynamic("n_split")

    @T.prim_func
    def window_dkv(
        Q: T.Tensor([batch, seq_len, heads, D], bf16),
        Raw: T.Tensor([batch, n_raw, D], bf16),
        WindowStart: T.Tensor([batch, seq_len], i32),
        Params: T.Tensor([2], f32),
        Window: T.Tensor([1], i32),
        Chunk: T.Tensor([n_split], i32),
        dO: T.Tensor([batch, seq_len, heads, D], bf16),
        Lse: T.Tensor([batch, seq_len, heads], f32),
        Delta: T.Tensor([batch, seq_len, heads], f32),
        DRaw: T.Tensor([batch, n_raw, D], f32),
    ):
        with T.Kernel(T.ceildiv(n_raw, BK), n_split, batch, threads=BWD_THREADS) as (kt, j, b):
            k_s = T.alloc_shared([BK, D], bf16)
            q_s = T.alloc_shared([HB, D], bf16)
            do_s = T.alloc_shared([HB, D], bf16)
            p_s = T.alloc_shared([HB, BK], bf16)
            ds_s = T.alloc_shared([HB, BK], bf16)
            acc_s = T.alloc_fragment([HB, BK], f32)
            acc_dp = T.alloc_fragment([HB, BK], f32)
            acc_kv = T.alloc_fragment([BK, D], f32)
            lse2 = T.alloc_fragment([HB], f32)
            delta = T.alloc_fragment([HB], f32)

            k0 = kt * BK
            history = n_raw - seq_len  # rows in front of the shard's own rows
            window = Window[0]
            scale = Params[0]
            scale_log2 = Params[0] * LOG2E
            chunk = Chunk[0]
            # Queries whose window can reach rows [k0, k0 + BK): own in [k0, k0 + BK - 2 + window].
            first = T.max(k0 - history, 0) + j * chunk
            last = T.min(T.min(k0 + BK + window - 2 - history, seq_len - 1), first + chunk - 1)

            for r, d in T.Parallel(BK, D):
                k_s[r, d] = T.if_then_else(k0 + r < n_raw, Raw[b, T.min(k0 + r, n_raw - 1), d], T.cast(0, bf16))
            T.clear(acc_kv)
            T.sync_threads()
            for i in T.serial(T.max(last - first + 1, 0)):
                s = first + i
                own = s + history
                lo = T.max(T.max(WindowStart[b, s], own - window + 1), 0)
                # Uniform per block: skip queries whose window misses the tile (other document,
                # padding queries that see no raw row).
                if (lo <= own) & (lo < k0 + BK) & (own >= k0):
                    for g in T.serial(heads // HB):
                        h0 = g * HB
                        T.copy(Q[b, s, h0 : h0 + HB, :], q_s, disable_tma=True)
                        T.copy(dO[b, s, h0 : h0 + HB, :], do_s, disable_tma=True)
                        for h in T.Parallel(HB):
                            lse2[h] = Lse[b, s, h0 + h] * LOG2E
                            delta[h] = Delta[b, s, h0 + h]
                        T.sync_threads()
                        T.gemm(q_s, k_s, acc_s, transpose_B=True, clear_accum=True)
                        T.gemm(do_s, k_s, acc_dp, transpose_B=True, clear_accum=True)
                        for h, c in T.Parallel(HB, BK):
                            seen = (k0 + c >= lo) & (k0 + c <= own)
                            acc_s[h, c] = T.if_then_else(seen, T.exp2(acc_s[h, c] * scale_log2 - lse2[h]), T.cast(0, f32))
                            acc_dp[h, c] = T.if_then_else(seen, acc_s[h, c] * (acc_dp[h, c] - delta[h]) * scale, T.cast(0, f32))
                        T.copy(acc_s, p_s)
                        T.copy(acc_dp, ds_s)
                        T.sync_threads()
                        T.gemm(ds_s, q_s, acc_kv, transpose_A=True)
                        T.gemm(p_s, do_s, acc_kv, transpose_A=True)
                        T.sync_threads()
            if last >= first:
                for r, d in T.Parallel(BK, D):
                    if k0 + r < n_raw:
                        T.atomic_add(DRaw[b, T.min(k0 + r, n_raw - 1), d], acc_kv[r, d])

    return window_dkv


# ----------------------------------------------------------------------------------------------
# Launch wrappers (inputs validated by interface.sparse_window_attention)
# ----------------------------------------------------------------------------------------------

_param_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _params(device, scale: float, has_sink: bool, window: int):
    """Device scalars (scale, has_sink) and window, cached so no call re-uploads them."""
    key = (device, float(scale), bool(has_sink), int(window))
    cached = _param_cache.get(key)
    if cached is None:
        cached = (
            torch.tensor([float(scale), 1.0 if has_sink else 0.0], dtype=torch.float32, device=device),
            torch.tensor([int(window)], dtype=torch.int32, device=device),
        )
        _param_cache[key] = cached
    return cached


_needs_cache: dict[tuple, torch.Tensor] = {}


def _needs(device, need_dq: bool, need_d_raw: bool, need_d_comp: bool) -> torch.Tensor:
    """The backward's int32 [3] flags (dq, d raw rows, d compressed rows), cached per device."""
    key = (device, bool(need_dq), bool(need_d_raw), bool(need_d_comp))
    cached = _needs_cache.get(key)
    if cached is None:
        cached = torch.tensor([int(v) for v in key[1:]], dtype=torch.int32, device=device)
        _needs_cache[key] = cached
    return cached


def _pad_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    x = x.contiguous()
    return x if x.shape[-1] == dim else torch.nn.functional.pad(x, (0, dim - x.shape[-1]))


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Zero-pad axis 2 (heads) of ``[B, S, H, ...]`` to ``heads``."""
    if x.shape[2] == heads:
        return x.contiguous()
    pad = [0, 0] * (x.ndim - 3) + [0, heads - x.shape[2]]
    return torch.nn.functional.pad(x, pad).contiguous()


def last_valid_slots(indices: torch.Tensor) -> torch.Tensor:
    """int32 [B, S]: 1 + the last slot j with indices[b, i, j] >= 0, or 0 for a row of -1s."""
    if indices.shape[-1] == 0:
        return indices.new_zeros(indices.shape[:2])
    slots = torch.arange(1, indices.shape[-1] + 1, device=indices.device, dtype=torch.int16)  # T <= 2048
    return torch.where(indices >= 0, slots, 0).amax(-1).to(torch.int32)


class KernelInputs:
    """The operands both kernels take, padded to the built head dim, and the mode they select."""

    def __init__(self, q, raw_kv, window_start, window, compressed_kv, indices, ks, ke, sink, scale):
        batch, seq_len, heads, dim = q.shape
        self.dim, self.heads = dim, heads
        self.kdim = kernel_dim(dim)
        self.kheads = -(-heads // BLOCK_HEADS) * BLOCK_HEADS  # whole 64-head blocks
        self.q = _pad_heads(_pad_dim(q, self.kdim), self.kheads)
        self.raw = _pad_dim(raw_kv, self.kdim)
        self.n_raw = raw_kv.shape[1]
        self.window_start = window_start.contiguous()
        if indices is not None and indices.shape[-1] == 0:
            compressed_kv = None  # no slots: the same as no compressed keys
        if compressed_kv is None:  # no compressed keys: an empty range over one zero row
            compressed_kv = q.new_zeros(batch, 1, dim)
            ks = ke = torch.zeros(batch, seq_len, dtype=torch.int32, device=q.device)
            indices = None
        self.comp = _pad_dim(compressed_kv, self.kdim)
        if indices is not None:
            self.mode = "indices"
            # end = 1 + the last slot holding an index >= 0 (0 if none): the kernels read no
            # slot past it (the -1 tails of queries with fewer visible compressed rows).
            self.selector, self.end = indices.contiguous(), last_valid_slots(indices)
        else:
            self.mode = "range"
            self.selector, self.end = ks.contiguous(), ke.contiguous()
        self.has_sink = sink is not None
        self.sink = torch.zeros(self.kheads, dtype=torch.float32, device=q.device)
        if sink is not None:
            self.sink[:heads] = sink
        self.params, self.window = _params(q.device, scale, self.has_sink, window)
        self.window_length = int(window)


def sparse_window_forward(inputs: KernelInputs, *, out=None, lse=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, H, D] bf16, lse [B, S, H] fp32) on the GPU; ``out`` / ``lse`` (optional,
    contiguous, at the built head dim and padded head count) receive the result, every element
    written; the returned tensors are views of them at the real heads and dim."""
    q = inputs.q
    batch, seq_len, heads, _ = q.shape
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty((batch, seq_len, heads), dtype=torch.float32, device=q.device) if lse is None else lse
    if q.numel():
        kernel = _compile_forward(forward_config(inputs.kdim, inputs.mode))
        kernel(q, inputs.raw, inputs.comp, inputs.window_start, inputs.selector, inputs.end, inputs.sink,
               inputs.params, inputs.window, out, lse)
    return out[:, :, : inputs.heads, : inputs.dim], lse[:, :, : inputs.heads]


def attention_delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """rowsum(dO * O) in fp32, [B, S, H] (inputs [B, S, H, D] bf16, D a multiple of 128)."""
    dim = out.shape[-1]
    rows = out.numel() // dim
    delta = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
    if rows:
        kernel = compile_cached(attention_delta_kernel, dim=dim)
        kernel(out.contiguous().view(rows, dim), grad_out.contiguous().view(rows, dim), delta.view(rows))
    return delta


def window_dkv_mode() -> str:
    """The window-dkv summation in use: NEMO_DSA_WINDOW_DKV if set, else DEFAULT_WINDOW_DKV."""
    return _choice_from_env("NEMO_DSA_WINDOW_DKV", DEFAULT_WINDOW_DKV, WINDOW_DKV_MODES)


_split_cache: dict[tuple, torch.Tensor] = {}


def window_dkv_split(device, n_raw: int, batch: int, window: int) -> torch.Tensor:
    """Chunk [n_split] int32 for :func:`window_dkv_kernel`: each raw tile's candidate queries
    (64 + window - 1) split into runs so that the grid fills about two waves of the GPU."""
    key = (device, n_raw, batch, window)
    cached = _split_cache.get(key)
    if cached is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        candidates = BLOCK_KEYS + window - 1
        blocks = -(-n_raw // BLOCK_KEYS) * batch
        n_split = max(1, min(-(-2 * sms // blocks), -(-candidates // 16)))
        chunk = -(-candidates // n_split)
        n_split = -(-candidates // chunk)
        cached = torch.full((n_split,), chunk, dtype=torch.int32, device=device)
        if len(_split_cache) > 256:
            _split_cache.clear()
        _split_cache[key] = cached
    return cached


def sparse_window_backward(inputs: KernelInputs, out, lse, grad_out, *, dq=None, need_dq: bool = True,
                           need_d_raw: bool = True, need_d_comp: bool = True):
    """(dq, d raw_kv, d compressed_kv, delta) for the saved forward; gradients in bf16, ``None``
    for each one not wanted (``need_*``: neither computed nor added; with none wanted only delta
    runs). The window keys' dkv is summed as :func:`window_dkv_mode` says. ``dq`` (optional,
    contiguous, at the built head dim) receives dq, every element written."""
    q = inputs.q
    batch, seq_len, heads, _ = q.shape
    # Padded heads: zero dO (so zero delta and gradients) and a finite lse of 0.
    grad_out = _pad_heads(_pad_dim(grad_out, inputs.kdim), inputs.kheads)
    out = _pad_heads(_pad_dim(out, inputs.kdim), inputs.kheads)
    delta = None  # rowsum(dO * O): the main kernel writes it; the delta kernel when it does not run
    n_comp = inputs.comp.shape[1]
    key_major = need_d_raw and window_dkv_mode() == "key-major"
    atomic_d_raw = need_d_raw and not key_major  # window dkv added by the query-major kernel
    lse = _pad_heads(lse, inputs.kheads)
    shape = (batch, inputs.n_raw + n_comp, inputs.kdim)
    dkv = None
    if need_dq or atomic_d_raw or need_d_comp:
        dq = torch.empty_like(q) if dq is None else dq
        # Rows nobody wants are never added to, so they need no zeros (one allocation).
        if atomic_d_raw and need_d_comp:
            dkv = torch.zeros(shape, dtype=torch.float32, device=q.device)
        else:
            dkv = torch.empty(shape, dtype=torch.float32, device=q.device)
            if atomic_d_raw:
                dkv[:, : inputs.n_raw].zero_()
            elif need_d_comp:
                dkv[:, inputs.n_raw :].zero_()
        if q.numel():
            delta = torch.empty(out.shape[:-1], dtype=torch.float32, device=q.device)
            config = backward_config(inputs.kdim, inputs.mode)
            kernel = compile_cached(sparse_window_bwd_kernel, pass_configs=config.pass_configs(), **config.kernel_kwargs())
            kernel(q, inputs.raw, inputs.comp, inputs.window_start, inputs.selector, inputs.end, inputs.params,
                   inputs.window, _needs(q.device, need_dq, atomic_d_raw, need_d_comp), grad_out, lse, out, delta,
                   dq, dkv)  # fmt: skip
    if delta is None:
        delta = attention_delta(out, grad_out)
    dim, heads = inputs.dim, inputs.heads
    d_raw = None
    if key_major:
        d_raw32 = torch.zeros((batch, inputs.n_raw, inputs.kdim), dtype=torch.float32, device=q.device)
        if q.numel():
            config = WindowDkvConfig(inputs.kdim)
            kernel = compile_cached(window_dkv_kernel, pass_configs=config.pass_configs(), **config.kernel_kwargs())
            chunk = window_dkv_split(q.device, inputs.n_raw, batch, int(inputs.window_length))
            kernel(q, inputs.raw, inputs.window_start, inputs.params, inputs.window, chunk, grad_out, lse, delta, d_raw32)
        d_raw = d_raw32[..., :dim].to(q.dtype)
    elif need_d_raw:
        d_raw = dkv[:, : inputs.n_raw, :dim].to(q.dtype)
    d_comp = dkv[:, inputs.n_raw :, :dim].to(q.dtype) if need_d_comp else None
    return dq[:, :, :heads, :dim] if need_dq else None, d_raw, d_comp, delta[:, :, :heads]


def compile_config(config) -> None:
    """Compile (or load from TileLang's disk cache) one configuration of
    :func:`dispatched_configs`, or the delta kernel of a head dim given as an int."""
    if isinstance(config, int):
        compile_cached(attention_delta_kernel, dim=config)
    elif isinstance(config, ForwardConfig):
        _compile_forward(config)
    elif isinstance(config, BackwardConfig):
        compile_cached(sparse_window_bwd_kernel, pass_configs=config.pass_configs(), **config.kernel_kwargs())
    else:
        compile_cached(window_dkv_kernel, pass_configs=config.pass_configs(), **config.kernel_kwargs())

