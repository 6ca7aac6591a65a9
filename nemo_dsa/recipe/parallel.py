"""Data- and context-parallel set-up for the recipe, the message a stalled collective turns into, and
rank 0's failure shared with every rank (so all stop together)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Parallel:
    """Where this process sits in the torchrun job (a ``dp_size x cp_size`` grid of ranks).

    ``rank``/``size``: this process in the whole job; ``group``: its CP group, handed to the model
    (None without CP); ``dp_rank``/``dp_size``: which slice of every global batch it trains on;
    ``fsdp_mesh``: the 1-D mesh of every rank the parameters are sharded over (None without DP).
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    timeout_s: float | None = None
    cp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    fsdp_mesh: Any = None
    owns_process_group: bool = False  # this run initialised it (and destroys it at the end)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Parameters, gradients and optimizer state are FSDP2-sharded (data parallelism)."""
        return self.fsdp_mesh is not None


def launch_rank() -> int:
    """This process's rank in the torchrun job (0 outside torchrun), before any process group exists."""
    return int(os.environ.get("RANK", "0"))


def setup_parallel(cp_size: int, timeout_s: float, dp_size: int = 1, device_type: str = "cpu") -> Parallel:
    """Join the torchrun job of ``dp_size x cp_size`` ranks (nothing when both are 1).

    Rank ``r`` is CP rank ``r % cp_size`` of data-parallel replica ``r // cp_size``: each CP group
    holds contiguous sequence shards of the same rows (``nemo_dsa.distributed.shard_batch``), the
    model's attention reaching its peers through the ``cp_group`` passed to its forward; each
    replica trains on its slice of the global batch. With ``dp_size > 1`` the parameters are
    sharded over every rank with FSDP2 (``shard_model``), whose reduce-scatter sums the gradients
    of all ranks; with CP alone the gradients are all-reduced over the CP group.
    ``timeout_s`` bounds every collective (``recipe.dist_timeout_s``): a stalled peer stops the
    run with ``stalled_collective``'s message instead of blocking for gloo's 10 minutes.
    """
    world_needed = cp_size * dp_size
    if world_needed == 1:
        return Parallel()
    shape = f"recipe.dp_size={dp_size} x recipe.cp_size={cp_size}"
    if "WORLD_SIZE" not in os.environ:
        keys = " ".join(f"recipe.{k}={v}" for k, v in (("dp_size", dp_size), ("cp_size", cp_size)) if v > 1)
        raise ValueError(f"{keys} needs a torchrun launch: torchrun --nproc-per-node={world_needed} "
                         f"-m nemo_dsa.train {keys} ...")
    from nemo_dsa.distributed import init_from_env

    world = int(os.environ["WORLD_SIZE"])
    if world != world_needed:
        raise ValueError(f"{shape} = {world_needed} ranks must equal the torchrun world size {world}")
    import torch.distributed as dist

    owns = not dist.is_initialized()
    backend = "nccl" if device_type == "cuda" else "gloo"  # device=cpu on a GPU host stays on gloo
    env = init_from_env(cp_size, backend=backend, timeout_s=timeout_s)  # CP groups of contiguous ranks

    rank = dist.get_rank()
    mesh = None
    if dp_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",))
    return Parallel(rank=rank, size=world, group=env.cp_group, timeout_s=timeout_s, cp_size=cp_size,
                    dp_rank=rank // cp_size, dp_size=dp_size, fsdp_mesh=mesh, owns_process_group=owns)


def wait_for_all(par: Parallel) -> None:
    """A barrier over every rank of the job (nothing in a single process)."""
    if par.size > 1:
        import torch.distributed as dist

        dist.barrier()


# Set once this process destroyed the process group it initialised: ``exit_process`` then ends it
# without interpreter finalization (see there).
_ended_process_group = False


def _end_process_group() -> None:
    """Destroy the process group this run initialised; the process then leaves by ``exit_process``."""
    from nemo_dsa.distributed import shutdown

    global _ended_process_group
    _ended_process_group = True
    shutdown()


def finish_parallel(par: Parallel) -> None:
    """End a finished multi-rank run together: a barrier (rank 0's last save is done before any
    rank leaves), then the process group this run initialised destroyed (see ``exit_process``)."""
    if par.size == 1 or not par.owns_process_group:
        return
    wait_for_all(par)
    _end_process_group()


def abandon_parallel(par: Parallel) -> None:
    """A failed multi-rank run: the process group it initialised destroyed without a barrier (the
    other ranks may be stopped or gone), for the same reason as ``finish_parallel``."""
    if par.size == 1 or not par.owns_process_group:
        return
    try:
        _end_process_group()
    except Exception:  # noqa: BLE001 - the run's own error is the one to report
        pass


def exit_process(code: int, error: BaseException | None = None) -> None:
    """End a process whose multi-rank run is over with ``code`` (``error``'s traceback printed
    first, as Python would), skipping interpreter finalization.

    A gloo worker thread can still be dropping its last reference to a tensor of the final
    collectives (which needs the GIL) when the main thread returns; once finalization has begun
    CPython ends such a thread with ``pthread_exit``, whose unwinding through C++ aborts the whole
    process (``terminate called without an active exception``, exit -6) after it reported success
    or its one-line error. So the ``atexit`` handlers (logging, loggers' flushes) run here, with
    the interpreter whole, and the process exits at once. A single-process run returns normally.
    """
    if not _ended_process_group:
        return
    import atexit
    import traceback

    if error is not None:
        traceback.print_exception(error)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(code)


def shard_model(model: torch.nn.Module, par: Parallel) -> torch.nn.Module:
    """FSDP2 (``fully_shard``) over every rank: each decoder layer, then the rest.

    Gradients are summed, not averaged (divide factor 1, plain sums, which gloo also has): the
    recipe normalises the loss by the global label count itself, as without DP.
    """
    if not par.sharded:
        return model
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=par.fsdp_mesh)
    fully_shard(model, mesh=par.fsdp_mesh)
    for module in model.modules():  # each FSDP unit reduces its own gradients
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def drop_unreached_gradients(model: torch.nn.Module, par: Parallel) -> None:
    """Set to None the sharded gradients that are exactly zero on every rank.

    FSDP2 hands some parameters that no loss term reaches (the V4 indexer's with
    ``indexer_kl_coef`` 0) an all-zero gradient where one process leaves ``grad`` None, and AdamW
    steps a zero gradient: weight decay and the step count would then differ from one process's
    run. (A reached parameter whose gradient is exactly zero everywhere is treated alike.)
    """
    if not par.sharded:
        return
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.grad is not None]
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    if not local:
        return
    # On the gradients' device (NCCL has no CPU tensors), one host read for all of them.
    reached = torch.stack([g.ne(0).any() for g in local]).to(torch.float32)
    dist.all_reduce(reached)
    for p, hit in zip(params, reached.tolist()):
        if hit == 0:
            p.grad = None


def dp_slice(batch: dict[str, torch.Tensor], par: Parallel) -> dict[str, torch.Tensor]:
    """This replica's rows of a global batch (every rank builds the same global batch)."""
    if par.dp_size == 1:
        return batch
    rows = batch["input_ids"].shape[0] // par.dp_size
    return {k: v[par.dp_rank * rows : (par.dp_rank + 1) * rows] for k, v in batch.items()}


def all_reduce_sum(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Sum over every rank of the job (a copy; ``x`` itself in a single process)."""
    if par.size == 1:
        return x
    import torch.distributed as dist

    x = x.detach().clone()
    dist.all_reduce(x)
    return x


def is_collective_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


# How gloo (and NCCL's socket transport) report a peer whose process is gone: killed, crashed,
# or its host lost. Matched in lower case.
_PEER_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
              "socket closed", "remote process exited")


def is_peer_lost(error: BaseException) -> bool:
    text = str(error).lower()
    return any(phrase in text for phrase in _PEER_LOST)


class RanksStopped(RuntimeError):
    """The run stopped, every rank of it together, for the reason the message gives (a stalled
    collective, a failed save); the command line prints it as one paragraph, exit 1."""


class StalledCollective(RanksStopped):
    """A collective ran past ``recipe.dist_timeout_s`` (the message names the silent ranks)."""


class PeerFailed(RanksStopped):
    """Rank 0's own work (a checkpoint save) failed: the other ranks stop with this instead of
    waiting for it at their next collective."""


def stalled_collective(error: BaseException, par: Parallel, step: int | None, timed_out: set[int],
                       during: str | None = None) -> StalledCollective:
    """A one-paragraph error for a collective that ran past ``recipe.dist_timeout_s``.

    ``timed_out``: the ranks that reported a timeout of their own (see ``loop``); a live rank
    waiting on the same collective times out too, so the ranks missing from it are the stalled ones.
    ``during``: what the ranks were doing outside a training step (``saving the checkpoint of step 4``).
    """
    silent = sorted(set(range(par.size)) - timed_out - {par.rank})
    who = (f"rank(s) {silent} reported no timeout of their own: they are stopped, hung or dead" if silent
           else "every rank timed out waiting (slow work rather than a stalled rank?)")
    where = f"in step {step}" if during is None else f"while {during}"
    return StalledCollective(
        f"rank {par.rank}: a collective {where} did not complete within recipe.dist_timeout_s={par.timeout_s}s; "
        f"{who}. Raise recipe.dist_timeout_s if steps or saves are simply slow. ({describe_error(error)})"
    )


class PeerLost(RanksStopped):
    """A collective lost its connection to a rank whose process is gone (the message names it)."""


def peer_lost(error: BaseException, par: Parallel, step: int | None, alive: set[int],
              during: str | None = None) -> PeerLost:
    """A one-line error for a collective whose peer's process died (killed, crashed).

    ``alive``: the ranks that reported the failure themselves (see ``loop``); the others are the
    ones whose process is gone (or, in a larger job, still waiting on a collective of their own).
    """
    gone = sorted(set(range(par.size)) - alive - {par.rank})
    who = (f"rank(s) {gone} did not report it: their process died or was killed" if gone
           else "every rank reported it (a network failure?)")
    where = f"in step {step}" if during is None else f"while {during}"
    phrase = next(p for p in _PEER_LOST if p in str(error).lower())
    return PeerLost(
        f"rank {par.rank}: lost the connection to another rank {where}; {who}. Any checkpoint saved before is "
        f"intact: run again to resume from the newest ({type(error).__name__}: {phrase})"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def describe_error(error: BaseException) -> str:
    """``Type: first line of the message``: how one rank's error is named to the others."""
    return f"{type(error).__name__}: {_first_line(error)}"


FAILURE_BYTES = 512  # byte 0: rank 0 failed; then its error as UTF-8 (one fixed-size broadcast)


def share_failure(par: Parallel, error: BaseException | None) -> str | None:
    """Rank 0's ``error`` (None: its work succeeded) on every rank, as one line ``Type: message``.

    One broadcast of a small byte tensor from rank 0 over the whole job, which every rank must
    call at the same point; nothing in a single process (None: the caller holds its own error).
    """
    if par.size == 1:
        return None
    import torch.distributed as dist

    buffer = torch.zeros(FAILURE_BYTES, dtype=torch.uint8)
    if par.is_main and error is not None:
        text = describe_error(error).encode()[: FAILURE_BYTES - 1]
        buffer[0] = 1
        buffer[1 : 1 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    # NCCL carries device tensors only (a device=cpu run on a GPU host is on gloo).
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    shared = buffer if device is None else buffer.to(device)
    dist.broadcast(shared, src=0)
    received = shared.cpu()
    if int(received[0]) == 0:
        return None
    return bytes(received[1:].tolist()).rstrip(b"\0").decode(errors="ignore")  # a cut character is dropped
