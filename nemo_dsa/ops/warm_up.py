"""The TileLang kernels a model can need at any sequence length, built before its first step.

Every compile-cache key is free of the sequence length (lengths are dynamic dimensions of the
kernels), but the wrappers' *choice* of a kernel still depends on the call: the sparse attention
runs its range mode when a layer has no compressed keys or an empty index list (very short
sequences) and its index mode otherwise, and a bf16 index-order selection takes the vector select
on 16-byte aligned scores and the radix select on others (chunk slices at ragged lengths). The
radix select's sort is sized by the caller's top-k (``topk.kernels.select_build``), not by the
keys a call keeps, so short sequences need no build of their own. :func:`model_builds` names
every such choice for a model's shapes, and :func:`warm_up` builds them all once, so no later
length compiles; ``scripts/precompile_kernels.py`` fills TileLang's disk cache with the same set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_dsa._checks import check_positive_int
from nemo_dsa.ops._tilelang import KernelBuild
from nemo_dsa.ops.sparse_attention.configs import MODES, backward_config, forward_config, kernel_dim
from nemo_dsa.ops.topk.kernels import selection_builds

FAMILIES = ("v4", "v41")


@dataclass(frozen=True)
class ModelBuilds:
    """The length-dependent kernel choices of one model: top-k selections and attention configs."""

    selections: tuple[KernelBuild, ...]
    attention: tuple  # ForwardConfig / BackwardConfig of every mode at the model's head dim

    def names(self) -> list[str]:
        return [b.name() for b in self.selections] + [repr(c) for c in self.attention]


def model_builds(
    family: str, topk: int, attention_dim: int, candidate_block_size: int | None = None, *,
    selections: bool = True, attention: bool = True,
) -> ModelBuilds:
    """Every selection and attention kernel a ``family`` model ("v4": fp32 scores by score;
    "v41": bf16 scores by index, masked by candidate blocks of ``candidate_block_size`` keys in
    reindex layers) of top-``topk`` and attention head dim ``attention_dim`` can choose, at any
    sequence length, packed or not. ``selections`` / ``attention``: include those kernels (a
    layer whose selection or attention runs the reference needs none of them)."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    check_positive_int("topk", topk)
    check_positive_int("attention_dim", attention_dim)
    if family == "v4":
        builds = selection_builds(torch.float32, topk, "score")
    else:
        # Reindex layers mask in the select when the row's blocks fit its block map, and select
        # unmasked (the mask applied to the scores) when a long row's do not.
        blocks = (0,)
        if candidate_block_size is not None:
            blocks = (0, check_positive_int("candidate_block_size", candidate_block_size))
        builds = selection_builds(torch.bfloat16, topk, "index", blocks)
    dim = kernel_dim(attention_dim)
    configs = tuple(forward_config(dim, mode) for mode in MODES) + tuple(backward_config(dim, mode) for mode in MODES)
    return ModelBuilds(tuple(builds) if selections else (), configs if attention else ())


_warmed: set[tuple] = set()


def warm_up(builds: ModelBuilds) -> None:
    """Build (compile, or load from TileLang's disk cache) every kernel of ``builds`` on the
    current CUDA device. Once per set and device: later calls (every layer of every step calls
    it) return at once."""
    key = (builds, torch.cuda.current_device())
    if key in _warmed:
        return
    from nemo_dsa.ops.sparse_attention.kernels import compile_config

    for build in builds.selections:
        build.compile()
    for config in builds.attention:
        compile_config(config)
    _warmed.add(key)
