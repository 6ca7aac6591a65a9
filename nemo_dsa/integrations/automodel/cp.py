"""nemo-automodel's context-parallel hook for nemo_dsa models (contiguous shards).

nemo-automodel asks a model for its CP batch layout through ``prepare_model_inputs_for_cp``, which
returns ``{"cp_sharder": ContextParallelSharder(...)}``; the recipe then calls
``shard_batch(cp_mesh, tp_mesh, batch, loss_mask=..., padding_token_id=...)`` and passes the
resulting batch to ``model.forward`` (so ``cp_group`` reaches the forward as a keyword). The
sharding itself is ``nemo_dsa.distributed.shard_batch``; this module only adapts it to the
framework's sharder. nemo-automodel is imported inside the functions, when the framework calls them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nemo_dsa.distributed.sharding import cp_padded_length, shard_batch

__all__ = ["automodel_shard_batch", "prepare_model_inputs_for_cp"]


def automodel_shard_batch(
    cp_mesh,
    tp_mesh,
    batch: dict[str, Any],
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    compress_ratios: Iterable[int] = (),
):
    """nemo-automodel ``ContextParallelSharder.shard_batch`` for nemo_dsa models.

    Returns ``(context factory, sharded batch with cp_group, ShardLayout)``: contiguous shards,
    padded at the row end, so the framework's gather/trim verbs restore the caller's layout.
    """
    import contextlib

    from nemo_automodel.components.distributed.context_parallel.sharder import ShardLayout

    del tp_mesh
    group = cp_mesh.get_group() if cp_mesh is not None and cp_mesh.size() > 1 else None
    batch = dict(batch)
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    primary = batch["inputs_embeds"] if "inputs_embeds" in batch else batch["input_ids"]
    seq_len = primary.shape[1]
    sharded = shard_batch(batch, group, compress_ratios=compress_ratios, pad_token_id=padding_token_id)
    sharded["cp_group"] = group
    size = 1 if group is None else cp_mesh.size()
    layout = ShardLayout(original_seq_len=seq_len, padded_seq_len=cp_padded_length(seq_len, compress_ratios, size))
    return contextlib.nullcontext, sharded, layout


def prepare_model_inputs_for_cp(compress_ratios: Iterable[int], batch: dict[str, Any], *, num_chunks: int = 1) -> dict:
    """Body of a model's ``prepare_model_inputs_for_cp`` hook: ``{"cp_sharder": sharder}``.

    Use as ``return prepare_model_inputs_for_cp(self.config.compress_ratios, batch, num_chunks=n)``.
    The batch is left untouched (the framework shards it through the returned sharder).
    """
    from functools import partial

    from nemo_automodel.components.distributed.context_parallel.sharder import (
        ContextParallelSharder,
        contiguous_local_indices,
    )

    del batch
    if num_chunks != 1:
        raise ValueError(f"num_chunks: nemo_dsa shards contiguously in one chunk per rank, got {num_chunks}")
    return {
        "cp_sharder": ContextParallelSharder(
            shard_batch=partial(automodel_shard_batch, compress_ratios=tuple(compress_ratios)),
            local_token_global_indices=contiguous_local_indices,
        )
    }
