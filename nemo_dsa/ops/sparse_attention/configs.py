"""Configurations of the sparse-attention kernels: block shapes, schedules, register splits and
the compiled variants (one frozen dataclass per compiled kernel), chosen by plain Python so that
the interface can validate inputs without importing TileLang."""

import os
from dataclasses import asdict, dataclass

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


# Forward schedules (NEMO_DSA_ATTN_FWD overrides the default, for A/B measurements):
# - "balanced": each consumer warpgroup scores half of a tile's keys and adds P V for half of D
#   (FlashMLA's split of the work); 6-7 % faster than the first schedule, where one consumer
#   scored every key (9.94 against 10.61 ms at S=32768; docs/performance.md v12; that schedule was
#   removed in v22). The control for:
# - "balanced-lean": balanced with per-tile column flags for the mask and lazy rescaling of O,
#   13-17 % faster than balanced at S = 16K-65K in the same run (8.17 against 9.43 ms at
#   S=32768; v21);
# - "alternating" (forward_alternating.py: the consumers take turns on whole tiles, FlashMLA's
#   schedule): within 3 % of balanced at S >= 32768 and 9 % slower at 16384 (v18). The control for:
# - "alternating-lean", the default: alternating with balanced-lean's column flags and lazy
#   rescaling, which also take the corrections off the consumers' hand-over in most rounds:
#   18-19 % faster than alternating and 1-7 % faster than balanced-lean at S = 16K-65K in the
#   same run (7.42 against 7.58 ms at S=32768 on an H100; v23).
FWD_SCHEDULES = ("balanced", "balanced-lean", "alternating", "alternating-lean")
DEFAULT_FWD_SCHEDULE = "alternating-lean"
# Backward schedules (NEMO_DSA_ATTN_BWD selects). All issue S and dP together and overlap each
# dkv chunk's atomics with the next chunk's GEMMs (2-4 % faster than waiting for every GEMM, v19).
# - "staged" (the control; the default of v20-v28) passes each chunk through shared memory so
#   that a warp's atomics cover whole 128-byte lines: fwd + bwd 34.9 against 37.5 ms at
#   S = 32768 for 8-byte atomics from the accumulator (v20). Its probes: the staging 23 % of the
#   backward, the atomics 21 % (v28).
# - "transposed": each chunk from the accumulator to 16-byte atomics over whole lines after two
#   lane exchanges (no staging, no barriers in the chunk loop), in chunks of 128 columns at
#   D = 512: 10-12.5 % faster than staged on an H100 at S = 16K-32K (v29; v28's "shuffled", with
#   the first exchange only and so half lines, gained 4-6 %).
# - "transposed-ahead", the default: transposed with Q and dO loaded by TMA and each tile's dKV
#   rows read one tile ahead: 13.7-14.1 % faster than staged (v29).
# Removed after measurement: a TMA add of the staged chunk (+37 %, v20), "staged-ahead" (+2-3 %,
# v28), "pipelined" (8-byte atomics, +12.5 %, v28), "shuffled" and "shuffled-ahead" (v29),
# "split" (S on one warpgroup, dP on the other, P handed over in fp32: +15-16 %, v30).
BWD_SCHEDULES = ("staged", "transposed", "transposed-ahead")
# The schedules that load Q and dO by TMA and read each tile's dKV rows one tile ahead.
AHEAD_SCHEDULES = ("transposed-ahead",)
DEFAULT_BWD_SCHEDULE = "transposed-ahead"
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
    "balanced": (208, 200, 96),
    "balanced-lean": (200, 192, 112),
    "alternating": (216, 216, 72),
    "alternating-lean": (216, 216, 72),
}


@dataclass(frozen=True)
class ForwardConfig:
    """One compiled forward (every field is an argument of :func:`kernels.sparse_window_fwd_kernel`)."""

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
        for the alternating schedules)."""
        p_tiles = 2 if self.schedule.startswith("alternating") else 1
        return 2 * self.dim * (BLOCK_HEADS + self.num_stages * BLOCK_KEYS) + p_tiles * 2 * BLOCK_HEADS * BLOCK_KEYS


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


def _checked_schedule(dim: int, mode: str, schedule: str | None, schedules: tuple, in_use) -> str:
    """``schedule`` (``in_use()`` if None) after checking it, the head dim and the mode."""
    if dim not in KERNEL_DIMS:
        raise ValueError(f"dim must be one of {KERNEL_DIMS} for a kernel, got {dim}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    schedule = in_use() if schedule is None else schedule
    if schedule not in schedules:
        raise ValueError(f"schedule must be one of {schedules}, got {schedule!r}")
    return schedule


def forward_config(dim: int, mode: str, schedule: str | None = None) -> ForwardConfig:
    """Stages: as many 64-key tiles as fit beside Q in 227 KiB (2 at D = 512, 4 at D = 128);
    ``schedule`` None: :func:`forward_schedule`."""
    schedule = _checked_schedule(dim, mode, schedule, FWD_SCHEDULES, forward_schedule)
    c0, c1, producer = FWD_REGISTERS[schedule]
    stages = 2 if dim == 512 or schedule.startswith("alternating") else 4  # alternating: a stage per consumer
    return ForwardConfig(dim, mode, stages, c0, c1, producer, schedule)


def backward_schedule() -> str:
    """The backward schedule in use: NEMO_DSA_ATTN_BWD if set, else DEFAULT_BWD_SCHEDULE."""
    return _choice_from_env("NEMO_DSA_ATTN_BWD", DEFAULT_BWD_SCHEDULE, BWD_SCHEDULES)


def window_dkv_mode() -> str:
    """The window-dkv summation in use: NEMO_DSA_WINDOW_DKV if set, else DEFAULT_WINDOW_DKV."""
    return _choice_from_env("NEMO_DSA_WINDOW_DKV", DEFAULT_WINDOW_DKV, WINDOW_DKV_MODES)


def backward_config(dim: int, mode: str, schedule: str | None = None) -> BackwardConfig:
    """``schedule`` None: :func:`backward_schedule`."""
    schedule = _checked_schedule(dim, mode, schedule, BWD_SCHEDULES, backward_schedule)
    # Chunks of 128 columns: half the re-reads of dS and P from shared memory a tile (each
    # warpgroup reads both for every chunk), -3.9 % with the register add at D = 512 (v28); the
    # staging tile of "staged" would not fit at 128, and D = 128 needs an even chunk count.
    wide = dim == 512 and schedule != "staged"
    return BackwardConfig(dim, mode, dkv_chunk=128 if wide else 64, schedule=schedule)


def dispatched_configs() -> list:
    """Every forward, backward and key-major window-dkv configuration the wrappers can compile."""
    return (
        [forward_config(d, m, sched) for sched in FWD_SCHEDULES for d in KERNEL_DIMS for m in MODES]
        + [backward_config(d, m, sched) for sched in BWD_SCHEDULES for d in KERNEL_DIMS for m in MODES]
        + [WindowDkvConfig(d) for d in KERNEL_DIMS]
    )
