"""Context-parallel set-up for the recipe, and the message a stalled collective turns into."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Parallel:
    """Where this process sits: CP rank/size and the group handed to the model (None = no CP)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    timeout_s: float | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_rank() -> int:
    """This process's rank in the torchrun job (0 outside torchrun), before any process group exists."""
    return int(os.environ.get("RANK", "0"))


def setup_parallel(cp_size: int, timeout_s: float) -> Parallel:
    """cp_size 1: nothing. cp_size > 1: join the torchrun job; every rank is one CP shard.

    The recipe has no data parallelism: the world is one CP group of ``cp_size`` ranks, each
    holding a contiguous sequence shard of every row (``nemo_dsa.distributed.shard_batch``); the
    model's attention reaches the other ranks through the ``cp_group`` passed to its forward.
    ``timeout_s`` bounds every collective (``recipe.dist_timeout_s``): a stalled peer stops the
    run with ``stalled_collective``'s message instead of blocking for gloo's 10 minutes.
    """
    if cp_size == 1:
        return Parallel()
    if "WORLD_SIZE" not in os.environ:
        raise ValueError(
            f"recipe.cp_size={cp_size} needs a torchrun launch: "
            f"torchrun --nproc-per-node={cp_size} -m nemo_dsa.train recipe.cp_size={cp_size} ..."
        )
    from nemo_dsa.distributed import init_from_env

    world = int(os.environ["WORLD_SIZE"])
    if world != cp_size:
        raise ValueError(f"recipe.cp_size={cp_size} must equal the torchrun world size {world} (no data parallelism)")
    env = init_from_env(cp_size, timeout_s=timeout_s)
    return Parallel(rank=env.cp_rank, size=env.cp_size, group=env.cp_group, timeout_s=timeout_s)


def all_reduce_sum(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Sum over the CP group (a copy; ``x`` itself without CP)."""
    if par.group is None:
        return x
    import torch.distributed as dist

    x = x.detach().clone()
    dist.all_reduce(x, group=par.group)
    return x


def is_collective_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


class StalledCollective(RuntimeError):
    """A collective ran past ``recipe.dist_timeout_s`` (the message names the silent ranks)."""


def stalled_collective(error: BaseException, par: Parallel, step: int, timed_out: set[int]) -> StalledCollective:
    """A one-paragraph error for a collective that ran past ``recipe.dist_timeout_s``.

    ``timed_out``: the ranks that reported a timeout of their own (see ``loop``); a live rank
    waiting on the same collective times out too, so the ranks missing from it are the stalled ones.
    """
    silent = sorted(set(range(par.size)) - timed_out - {par.rank})
    who = (f"rank(s) {silent} reported no timeout of their own: they are stopped, hung or dead" if silent
           else "every rank timed out waiting (a slow step rather than a stalled rank?)")
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return StalledCollective(
        f"rank {par.rank}: a collective in step {step} did not complete within recipe.dist_timeout_s={par.timeout_s}s; "
        f"{who}. Raise recipe.dist_timeout_s if steps are simply slow. ({type(error).__name__}: {first})"
    )
