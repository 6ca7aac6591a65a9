"""torchrun environment -> process group and context-parallel group.

``torchrun --nproc-per-node P -m nemo_dsa.train cp_size=P`` sets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT; ``init_from_env`` turns them into the CP group the model's forward
takes. With ``cp_size < world size`` the world splits into consecutive CP groups
(ranks ``[k*cp, (k+1)*cp)``), the remaining axis being data parallel.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import NamedTuple

import torch

from nemo_dsa._checks import is_positive_int


class CPEnv(NamedTuple):
    """``cp_group`` is None without CP (single process or cp_size 1)."""

    cp_group: object
    cp_rank: int
    cp_size: int


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def init_from_env(cp_size: int | None = None, backend: str | None = None, timeout_s: float = 600.0) -> CPEnv:
    """Initialise torch.distributed from the torchrun environment and build the CP group.

    Args:
        cp_size: ranks per CP group (default: the whole world). Must divide WORLD_SIZE.
        backend: "nccl" or "gloo"; default nccl when CUDA is available, else gloo.
        timeout_s: collective timeout (a hung peer raises instead of blocking forever).

    Returns:
        ``CPEnv(cp_group, cp_rank, cp_size)``. Outside torchrun (no WORLD_SIZE, or 1) with
        ``cp_size`` None or 1 nothing is initialised and ``CPEnv(None, 0, 1)`` comes back.
        On CUDA the current device is set to LOCAL_RANK.
    """
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE", 1)
    cp_size = world if cp_size is None else cp_size
    if not is_positive_int(cp_size):
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if world % cp_size:
        raise ValueError(f"cp_size={cp_size} must divide the number of processes (WORLD_SIZE={world})")
    if world == 1 and not dist.is_initialized():
        return CPEnv(None, 0, 1)

    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    world, rank = dist.get_world_size(), dist.get_rank()
    if cp_size == 1:
        return CPEnv(None, 0, 1)
    if cp_size == world:
        return CPEnv(dist.group.WORLD, rank, world)
    # Every rank must create every group, in the same order.
    mine = None
    for first in range(0, world, cp_size):
        group = dist.new_group(list(range(first, first + cp_size)))
        if first <= rank < first + cp_size:
            mine = group
    return CPEnv(mine, rank % cp_size, cp_size)


def shutdown() -> None:
    """Destroy the default process group if this process initialised one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
