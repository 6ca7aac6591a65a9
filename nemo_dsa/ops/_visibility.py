"""The compact visibility pair (ks, ke) shared by every op: validation and the unpacked default.

Query i of row b sees compressed key j iff ``ks[b, i] <= j < ke[b, i]`` (DSA-SPEC, "Visibility");
a query that sees nothing has ``ks == ke``.
"""

from __future__ import annotations

import contextlib

import torch

from nemo_dsa._checks import check_tensor
from nemo_dsa.ops._memo import memo_on_tensors


def check_ks_ke(
    ks, ke, *, batch: int, queries: int, num_keys: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ks/ke: both given, int32 [B, S] on ``device``, with 0 <= ks <= ke <= num_keys."""
    if (ks is None) != (ke is None):
        missing = "ke" if ke is None else "ks"
        raise ValueError(f"ks and ke must be given together; {missing} is missing")
    for name, value in (("ks", ks), ("ke", ke)):
        check_tensor(name, value, ndim=2, dtypes=(torch.int32,), shape=(batch, queries), device=device)
    if ks.numel():
        # One device-to-host sync for all three checks, once per (ks, ke) pair: every indexer
        # layer of a step passes the same metadata tensors.
        below, above, reversed_ = memo_on_tensors(
            (ks, ke), ("ks_ke_checks", num_keys),
            lambda: torch.stack(((ks < 0).any(), (ke > num_keys).any(), (ke < ks).any())).tolist(),
        )
        if below:
            raise ValueError(f"ks must be >= 0, got minimum {int(ks.min())}")
        if above:
            raise ValueError(f"ke must be <= the number of keys {num_keys}, got maximum {int(ke.max())}")
        if reversed_:
            raise ValueError("ke must be >= ks for every query (ks == ke means the query sees no key)")
    return ks, ke


def causal_ks_ke(
    batch: int, queries: int, num_keys: int, ratio: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unpacked causal rule for rows starting at global position 0: ks = 0, ke = min((i+1)//R, K)."""
    position = torch.arange(queries, device=device, dtype=torch.int64)
    ke = torch.clamp((position + 1) // ratio, max=num_keys).to(torch.int32)
    ke = ke.unsqueeze(0).expand(batch, queries).contiguous()
    return torch.zeros_like(ke), ke


def visible_mask(ks: torch.Tensor, ke: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Dense boolean ``[..., S, K]`` form of the (ks, ke) ranges."""
    keys = torch.arange(num_keys, device=ks.device)
    return (keys >= ks.unsqueeze(-1)) & (keys < ke.unsqueeze(-1))


@contextlib.contextmanager
def ieee_fp32_matmul():
    """Run CUDA fp32 matmuls in full IEEE fp32 (no TF32), restoring the caller's setting after.

    The V4 reference promises fp32 products and sums; TF32 would silently drop 13 mantissa bits.
    A no-op for CPU work.
    """
    if not torch.cuda.is_available():
        yield
        return
    matmul = torch.backends.cuda.matmul
    # torch >= 2.9 has fp32_precision and refuses to read the legacy allow_tf32 flag once the new
    # one was set, so use the new flag wherever it exists.
    flag, ieee = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    previous = getattr(matmul, flag)
    setattr(matmul, flag, ieee)
    try:
        yield
    finally:
        setattr(matmul, flag, previous)
