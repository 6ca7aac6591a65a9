"""One rank's ``gather_sequence`` / ``previous_tail`` (forward and backward) against one process
holding the whole sequence and playing every rank: run inside a process group by the gloo and NCCL
context-parallel tests (``ctx`` is the rank's ProcessGroupContext)."""

from __future__ import annotations

import torch


def random_values(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype in (torch.float32, torch.float64):
        return torch.randn(shape, generator=gen, dtype=dtype)
    # Small integers: bf16 sums of a few of them are exact, so comparisons can be bitwise.
    return torch.randint(-3, 4, shape, generator=gen).to(dtype)


def _full_shape(local_shape, dim, size):
    shape = list(local_shape)
    shape[dim] = local_shape[dim] * size
    return shape


def reference_previous_tail(full, rank, local, n, dim):
    """The n entries before position rank*local of the whole sequence, zeros before its start."""
    zeros = full.new_zeros([*full.shape[:dim], n, *full.shape[dim + 1 :]])
    return torch.cat([zeros, full], dim=dim).narrow(dim, rank * local, n)


def _assert_grad(actual, expected, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(actual, expected)


def check_gather(ctx, rank, size, local_shape, dim, dtype, seed, device="cpu"):
    dim_pos = dim % len(local_shape)
    local = local_shape[dim_pos]
    full = random_values(_full_shape(local_shape, dim_pos, size), dtype, seed).to(device)
    weights = [random_values(full.shape, dtype, seed + 1 + r).to(device) for r in range(size)]
    whole = full.clone().requires_grad_()
    sum((whole * w).sum() for w in weights).backward()  # every rank reads every shard

    shard = full.narrow(dim_pos, rank * local, local).clone().requires_grad_()
    out = ctx.gather_sequence(shard, dim)
    assert torch.equal(out, full), "gathered tensor differs from the whole sequence"
    (out * weights[rank]).sum().backward()
    _assert_grad(shard.grad, whole.grad.narrow(dim_pos, rank * local, local), dtype)


def check_previous_tail(ctx, rank, size, local_shape, dim, n, dtype, seed, device="cpu"):
    dim_pos = dim % len(local_shape)
    local = local_shape[dim_pos]
    full = random_values(_full_shape(local_shape, dim_pos, size), dtype, seed).to(device)
    tail_shape = list(local_shape)
    tail_shape[dim_pos] = n
    weights = [random_values(tail_shape, dtype, seed + 1 + r).to(device) for r in range(size)]
    whole = full.clone().requires_grad_()
    sum((reference_previous_tail(whole, r, local, n, dim_pos) * weights[r]).sum() for r in range(size)).backward()

    shard = full.narrow(dim_pos, rank * local, local).clone().requires_grad_()
    tail = ctx.previous_tail(shard, n, dim)
    assert tail.shape == tuple(tail_shape), (tail.shape, tail_shape)
    assert torch.equal(tail, reference_previous_tail(full, rank, local, n, dim_pos))
    (tail * weights[rank]).sum().backward()
    _assert_grad(shard.grad, whole.grad.narrow(dim_pos, rank * local, local), dtype)


def check_metadata_without_grad(ctx, rank, size, device="cpu"):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 50, (2, 6 * size), generator=gen).to(device)
    flags = (torch.rand(2, 6 * size, generator=gen) > 0.5).to(device)
    for full in (ids, flags):
        shard = full[:, rank * 6 : (rank + 1) * 6]
        out = ctx.gather_sequence(shard, 1)
        assert out.dtype == full.dtype and torch.equal(out, full)
        tail = ctx.previous_tail(shard, 4, -1)
        assert tail.dtype == full.dtype and torch.equal(tail, reference_previous_tail(full, rank, 6, 4, 1))
