"""Configurations of the sparse-attention kernels: block shapes, register splits and the compiled
variants (one frozen dataclass per compiled kernel), chosen by plain Python so that the
interface can validate inputs without importing TileLang."""

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

FWD_THREADS = 384
FWD_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_safe_memory_legalize": True}
FWD_STAGES = 2  # key-ring stages of the forward: one per consumer (each scores a whole tile)
BWD_THREADS = 256
BWD_PASS_CONFIGS = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True}

# setmaxnreg of the forward's warpgroups. They trade registers inside the block's launch
# allocation (168 a thread at 384 threads: 504 per thread-triple), so the three must sum to
# <= 504: a setmaxnreg.inc beyond it waits forever. The consumers hold a [64, D/2] fp32
# accumulator (128 registers a thread at D = 512) and a [64, 64] tile of logits; the producer
# only addresses its copies.
LAUNCH_REGISTERS = 168  # 65536 / 384, rounded down to a multiple of 8
CONSUMER_REGISTERS = 216
PRODUCER_REGISTERS = 72


@dataclass(frozen=True)
class ForwardConfig:
    """One compiled forward (every field is an argument of :func:`forward.sparse_window_fwd_kernel`)."""

    dim: int
    mode: str  # "indices" (per-query compressed indices) or "range" ([ks, ke))

    def kernel_kwargs(self) -> dict:
        return asdict(self)

    def pass_configs(self) -> dict:
        return dict(FWD_PASS_CONFIGS)

    def shared_memory_bytes(self) -> int:
        """Dynamic shared memory: Q [64, D] + key ring [2, 64, D] (bf16) + P [2, 64, 64] (one a
        consumer)."""
        return 2 * self.dim * (BLOCK_HEADS + FWD_STAGES * BLOCK_KEYS) + 2 * 2 * BLOCK_HEADS * BLOCK_KEYS


@dataclass(frozen=True)
class BackwardConfig:
    """One compiled backward (every field is an argument of :func:`backward.sparse_window_bwd_kernel`)."""

    dim: int
    mode: str
    dkv_chunk: int  # columns of dkv computed (and added) at a time: bounds its registers

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


def _check_shape(dim: int, mode: str) -> None:
    if dim not in KERNEL_DIMS:
        raise ValueError(f"dim must be one of {KERNEL_DIMS} for a kernel, got {dim}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def forward_config(dim: int, mode: str) -> ForwardConfig:
    _check_shape(dim, mode)
    return ForwardConfig(dim, mode)


def backward_config(dim: int, mode: str) -> BackwardConfig:
    """Chunks of 128 columns at D = 512: each warpgroup re-reads dS and P from shared memory for
    every chunk, so wider chunks halve those reads; D = 128 needs an even chunk count (64)."""
    _check_shape(dim, mode)
    return BackwardConfig(dim, mode, dkv_chunk=128 if dim == 512 else 64)


def dispatched_configs() -> list:
    """Every forward and backward configuration the wrappers can compile."""
    return [forward_config(d, m) for d in KERNEL_DIMS for m in MODES] + [
        backward_config(d, m) for d in KERNEL_DIMS for m in MODES
    ]
