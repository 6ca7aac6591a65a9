"""The plugin under context parallelism: nemo-automodel's own DeepSeek-V4 CP sharder, 2 gloo ranks.

Each rank shards one packed THD row with the built-in's ``prepare_model_inputs_for_cp`` sharder
(documents re-padded to the compression multiple, contiguous shards, ``_dsv4_cp_group``) and runs
the plugin on its shard. Put back together, the shards' logits equal one process running the
plugin on the same (re-padded) row: the sharder's output reaches nemo_dsa's metadata as it is.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from _support.cp_spawn import run_on_ranks
from _support.v4_builtin_and_plugin import backend, build_plugin, randomize_, rel, thd_batch, tiny_config

pytestmark = pytest.mark.slow

CP = 2
# Documents of 100, 301 and 37 tokens: the sharder pads each to a multiple of 128 and the row
# to 768, so the second document runs across the two shards (rank 1 needs rank 0's keys).
DOCS = [100, 301, 37]


def _shard_and_run(rank: int, world_size: int, state: dict, batch: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = build_plugin(tiny_config())
    model.load_state_dict(state)
    model.eval()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    sharder = model.prepare_model_inputs_for_cp(dict(batch))["cp_sharder"]
    _, shard, _ = sharder.shard_batch(mesh, None, dict(batch))
    assert shard["_dsv4_cp_group"] is not None
    labels = shard.pop("labels")
    with torch.no_grad():
        logits = model(**shard).logits
    keys = ("input_ids", "position_ids", "packed_seq_ids", "padding_mask")
    return {"logits": logits, "labels": labels, **{k: shard[k] for k in keys}}


def test_cp_shards_equal_one_process():
    torch.manual_seed(0)
    source = build_plugin(tiny_config())
    source.initialize_weights(dtype=torch.float32)
    randomize_(source, seed=21)
    state = source.state_dict()
    batch, _ = thd_batch(DOCS, DOCS, seed=22)
    batch["labels"] = batch["input_ids"].clone()

    shards = run_on_ranks(_shard_and_run, CP, state, batch)
    whole = {k: torch.cat([s[k] for s in shards], dim=1) for k in shards[0]}
    assert whole["input_ids"].shape[1] == 768
    assert shards[1]["packed_seq_ids"][0, 0] == shards[0]["packed_seq_ids"][0, -1] == 2  # a document spans ranks
    real = ~whole["padding_mask"]
    assert int(real.sum()) == sum(DOCS)
    source.eval()
    with torch.no_grad():
        reference = source(
            input_ids=whole["input_ids"], position_ids=whole["position_ids"],
            packed_seq_ids=whole["packed_seq_ids"], padding_mask=whole["padding_mask"], qkv_format="thd",
        ).logits  # fmt: skip
    err = rel(whole["logits"][real], reference[real])
    print("cp logits rel", err)
    assert err <= 1e-6
