"""Run a function on real gloo process groups (separate CPU processes, loopback only).

``run_on_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, initialises gloo through
a file store, calls ``fn(rank, world_size, *args)`` in each and returns the per-rank results.
A worker exception fails the caller with the worker's traceback; a hung collective times out.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 120
# A fork server imports torch once; every worker after that is a cheap fork of it (spawning
# re-imports torch per process, seconds each on a 2-core machine). Forking pytest itself is
# unsafe once it has used OpenMP, the server never has.
_START_METHOD = "forkserver"
_PRELOAD = [
    "torch",
    "torch.distributed",
    "nemo_dsa.distributed",
    "nemo_automodel.components.distributed.context_parallel.sharder",  # skipped if not installed
]
multiprocessing.get_context(_START_METHOD).set_forkserver_preload(_PRELOAD)


def _worker(rank: int, fn, world_size: int, backend: str, store_file: str, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    if "TILELANG_CACHE_DIR" not in os.environ:  # a test session's (tests/conftest.py) is inherited
        os.environ["TILELANG_CACHE_DIR"] = os.path.join(out_dir, "tilelang")  # removed with out_dir
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{store_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(_to_cpu(result), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def run_on_ranks(fn, world_size: int, *args, backend: str = "gloo") -> list:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]`` computed on one process group.

    ``backend="nccl"`` puts rank r on ``cuda:r``; results come back on the CPU.
    """
    # Gloo picks its interface from the hostname unless told: keep all traffic on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # NVLink multicast stays off (shared GPU hosts; see the device notes).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with tempfile.TemporaryDirectory(prefix="nemo-dsa-cp-") as tmp:
        store_file = os.path.join(tmp, "store")
        mp.start_processes(
            _worker,
            args=(fn, world_size, backend, store_file, tmp, args),
            nprocs=world_size,
            join=True,
            start_method=_START_METHOD,
        )
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
