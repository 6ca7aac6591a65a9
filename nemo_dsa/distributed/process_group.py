"""``SequenceContext`` over a torch.distributed process group (contiguous sequence shards).

Rank ``r`` of a CP group of size ``P`` holds global tokens ``[r*S, (r+1)*S)``. The attention
module needs two things from the other ranks:

* ``gather_sequence``: every rank's shard of a tensor, concatenated in rank order (compressed KV,
  index keys, group metadata). Every rank consumes the whole gathered tensor, so the gradient of
  a rank's shard is the *sum* over ranks of the gradient slices: a reduce-scatter.
* ``previous_tail``: the ``n`` positions just before this shard (sliding window, ratio-4
  compressor overlap). Forward is one point-to-point hop ``r-1 -> r``; backward sends the
  gradient back along ``r -> r-1``. When ``n`` exceeds the shard length the window spans
  several ranks and the tail is cut out of a full gather instead.

Collectives run in autograd's backward, so every rank must use each result the same way
(the model code is rank-agnostic, which guarantees it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_dsa._checks import check_positive_int
from nemo_dsa.layers.context import SequenceContext

# torch 2.13 renamed the single-tensor collectives; the GPU machine runs an older torch.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _wire_view(x: torch.Tensor) -> torch.Tensor:
    """Bools travel as uint8 (same bytes): not every backend reduces or gathers bool."""
    return x.view(torch.uint8) if x.dtype == torch.bool else x


def _all_gather_along(x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Concatenate equal-shaped shards of ``x`` from every rank along ``dim`` (no autograd)."""
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((size * front.shape[0], *front.shape[1:]), dtype=front.dtype, device=front.device)
    _all_gather_single(_wire_view(out), _wire_view(front), group=group)
    return out.movedim(0, dim)


def _reduce_scatter_along(grad: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    """Sum ``grad`` over ranks and keep this rank's slice along ``dim`` (inverse of the gather)."""
    front = grad.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // size, *front.shape[1:]), dtype=front.dtype, device=front.device)
    _reduce_scatter_single(out, front, group=group)
    return out.movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return _all_gather_along(x, dim, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Sum low-precision gradients in fp32: a bf16 ring reduction would round after every hop
        # (the per-rank partial sums arriving here are already rounded once, unavoidably).
        wide = grad.float() if grad.dtype in (torch.bfloat16, torch.float16) else grad
        return _reduce_scatter_along(wide, ctx.dim, ctx.group, ctx.size).to(grad.dtype), None, None, None


def _shift_to_next_rank(payload: torch.Tensor, recv_like: torch.Tensor, rank: int, size: int, group, forward: bool):
    """Send ``payload`` one rank along the chain and return what arrived (zeros if nothing does).

    ``forward=True`` moves data r -> r+1 (rank 0 receives nothing); ``False`` moves r -> r-1
    (the last rank receives nothing).
    """
    received = torch.zeros(recv_like.shape, dtype=recv_like.dtype, device=recv_like.device)
    send_to, recv_from = (rank + 1, rank - 1) if forward else (rank - 1, rank + 1)
    ops = []  # P2POp wants global ranks
    if 0 <= send_to < size:
        peer = dist.get_global_rank(group, send_to)
        ops.append(dist.P2POp(dist.isend, _wire_view(payload.contiguous()), peer, group))
    if 0 <= recv_from < size:
        peer = dist.get_global_rank(group, recv_from)
        ops.append(dist.P2POp(dist.irecv, _wire_view(received), peer, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


class _PreviousTail(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, dim: int, group, rank: int, size: int) -> torch.Tensor:
        ctx.n, ctx.dim, ctx.group, ctx.rank, ctx.size = n, dim, group, rank, size
        ctx.x_shape = x.shape
        tail = x.narrow(dim, x.shape[dim] - n, n)
        return _shift_to_next_rank(tail, tail, rank, size, group, forward=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # The gradient of the tail we received belongs to the previous rank's last n entries.
        grad_of_own_tail = _shift_to_next_rank(grad, grad, ctx.rank, ctx.size, ctx.group, forward=False)
        grad_x = grad.new_zeros(ctx.x_shape)
        grad_x.narrow(ctx.dim, ctx.x_shape[ctx.dim] - ctx.n, ctx.n).copy_(grad_of_own_tail)
        return grad_x, None, None, None, None, None


def _zeros_before(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """What precedes the global start: ``n`` zeros along ``dim``."""
    shape = list(x.shape)
    shape[dim] = n
    return x.new_zeros(shape)


class ProcessGroupContext(SequenceContext):
    """Context parallelism over ``group``: this process holds shard ``dist.get_rank(group)``."""

    def __init__(self, group) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("cp_group: torch.distributed is not initialized (call init_process_group first)")
        if hasattr(group, "get_group") and getattr(group, "ndim", None) == 1:  # a 1-D DeviceMesh
            group = group.get_group()
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"cp_group must be a torch.distributed.ProcessGroup (or a 1-D DeviceMesh), got {type(group).__name__}"
            )
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("cp_group: this process is not a member of the group")
        self.group = group
        self.rank = rank
        self.size = dist.get_world_size(group)

    def __repr__(self) -> str:
        return f"ProcessGroupContext(rank={self.rank}, size={self.size})"

    @staticmethod
    def _check(x, dim: int) -> int:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int) or not -x.ndim <= dim < x.ndim:
            raise ValueError(f"dim must be an int in [{-x.ndim}, {x.ndim}) for x of shape {tuple(x.shape)}, got {dim}")
        return dim % x.ndim

    def gather_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All ranks' shards of ``x`` concatenated along ``dim`` in rank order.

        Every rank must pass the same shape. Floating tensors that require grad get the
        reduce-scatter backward; other tensors (metadata) are gathered without autograd.
        """
        dim = self._check(x, dim)
        if self.size == 1:
            return x
        if x.requires_grad:
            return _GatherSequence.apply(x, dim, self.group, self.size)
        return _all_gather_along(x, dim, self.group, self.size)

    def previous_tail(self, x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
        """The ``n`` entries of the global sequence just before this shard, along ``dim``.

        Positions before the global start (rank 0, or ``n`` reaching past rank 0) are zeros;
        callers mask them through the metadata. Autograd-aware.
        """
        dim = self._check(x, dim)
        check_positive_int("n", n, minimum=0)
        local = x.shape[dim]
        if self.size == 1 or n == 0:
            return _zeros_before(x, n, dim)
        if n <= local:
            if x.requires_grad:
                return _PreviousTail.apply(x, n, dim, self.group, self.rank, self.size)
            tail = x.narrow(dim, local - n, n)
            return _shift_to_next_rank(tail, tail, self.rank, self.size, self.group, forward=True)
        # The window reaches over more than one rank: cut it out of the full sequence.
        full = self.gather_sequence(x, dim)
        end = self.rank * local
        start = end - n
        have = full.narrow(dim, max(start, 0), end - max(start, 0))
        if start >= 0:
            return have
        return torch.cat([_zeros_before(x, -start, dim), have], dim=dim)
