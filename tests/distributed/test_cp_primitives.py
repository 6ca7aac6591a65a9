"""Context-parallel primitives on real gloo process groups, and the batch sharding helper.

Each rank's ``gather_sequence`` / ``previous_tail`` (forward and backward) is compared with the
single-process equivalent: one process holding the whole sequence plays every rank, so the
gradient of the whole sequence is the sum of what every rank's use contributes.
The workers are spawned once per world size; each check reports its own traceback.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from _support.cp_primitive_checks import check_gather, check_metadata_without_grad, check_previous_tail, random_values
from _support.cp_spawn import run_on_ranks
from nemo_dsa.distributed import cp_padded_length, cp_shard_multiple, shard_batch
from nemo_dsa.metadata import build_attention_metadata


def check_empty_tail_and_errors(ctx, rank, size):
    x = torch.randn(2, 5, 3, requires_grad=True)
    assert ctx.previous_tail(x, 0, 1).shape == (2, 0, 3)
    with pytest.raises(ValueError, match="n must be >= 0"):
        ctx.previous_tail(x, -1, 1)
    with pytest.raises(ValueError, match="dim must be an int in"):
        ctx.gather_sequence(x, 3)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ctx.gather_sequence([1, 2], 0)


def check_context_for_group(ctx, rank, size):
    import torch.distributed as dist

    from nemo_dsa.distributed import ProcessGroupContext, sequence_context_for

    made = sequence_context_for(dist.group.WORLD)
    assert isinstance(made, ProcessGroupContext) and (made.rank, made.size) == (rank, size)
    from torch.distributed.device_mesh import init_device_mesh

    mesh_ctx = ProcessGroupContext(init_device_mesh("cpu", (size,), mesh_dim_names=("cp",)))
    assert (mesh_ctx.rank, mesh_ctx.size) == (rank, size)
    with pytest.raises(TypeError, match="cp_group must be a torch.distributed.ProcessGroup"):
        ProcessGroupContext("world")


def check_subgroups(ctx, rank, size):
    """Two CP groups side by side (DP x CP): point-to-point must use global peer ranks."""
    import torch.distributed as dist

    from nemo_dsa.distributed import ProcessGroupContext

    half = size // 2
    groups = [dist.new_group(list(range(0, half))), dist.new_group(list(range(half, size)))]
    sub = ProcessGroupContext(groups[rank // half])
    assert (sub.rank, sub.size) == (rank % half, half)
    seed = 300 + 50 * (rank // half)  # different data in each group
    if half == 1:  # one-rank groups: the whole sequence is local
        x = random_values((2, 4, 3), torch.float32, seed)
        assert sub.gather_sequence(x, 1) is x
        assert torch.equal(sub.previous_tail(x, 3, 1), torch.zeros(2, 3, 3))
        return
    check_previous_tail(sub, sub.rank, half, (2, 4, 3), 1, 3, torch.float32, seed)
    check_gather(sub, sub.rank, half, (2, 4, 3), 1, torch.float32, seed + 10)


def check_shard_batch_with_group(ctx, rank, size):
    """shard_batch(cp_group) and nemo-automodel's sharder give the explicit-rank shard."""
    import torch.distributed as dist
    from nemo_automodel.components.distributed.context_parallel.sharder import ContextParallelSharder
    from torch.distributed.device_mesh import init_device_mesh

    from nemo_dsa.integrations.automodel.cp import prepare_model_inputs_for_cp

    ratios = (0, 4, 4)
    batch = _packed_batch(seq_len=21)
    expected = shard_batch(batch, compress_ratios=ratios, cp_rank=rank, cp_size=size, pad_token_id=258)
    mine = shard_batch(batch, dist.group.WORLD, compress_ratios=ratios, pad_token_id=258)
    _assert_same_batch(mine, expected)

    class ModelWithHook(torch.nn.Module):  # what the nemo-automodel model class declares
        _owns_cp_attention = True

        def prepare_model_inputs_for_cp(self, batch, *, num_chunks=1):
            return prepare_model_inputs_for_cp(ratios, batch, num_chunks=num_chunks)

    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("cp",))
    # nemo-automodel's own resolution: it calls the hook and configures the sharder on the mesh.
    sharder = ContextParallelSharder(model=ModelWithHook(), device_mesh=mesh, batch=dict(batch), padding_token_id=258)
    _, sharded = sharder.shard(dict(batch))
    assert sharded.pop("cp_group") is not None
    _assert_same_batch(sharded, expected)
    # The framework's verbs undo the layout: gathered and trimmed labels are the input labels.
    restored = sharder.gather_token_tensor(sharded["labels"], seq_dim=1, trim=True)
    assert torch.equal(restored, batch["labels"])


def check_init_from_env(ctx, rank, size):
    """torchrun-style setup on an initialised world: one CP group, or DP x CP subgroups."""
    import os

    from nemo_dsa.distributed import ProcessGroupContext, init_from_env

    os.environ.pop("WORLD_SIZE", None)  # an initialised world is enough
    assert init_from_env(cp_size=1) == (None, 0, 1)
    whole = init_from_env()
    assert (whole.cp_rank, whole.cp_size) == (rank, size)
    half = init_from_env(cp_size=size // 2) if size >= 4 else None
    if half is not None:
        assert (half.cp_rank, half.cp_size) == (rank % (size // 2), size // 2)
        sub = ProcessGroupContext(half.cp_group)
        shard = torch.full((1, 2), float(rank))
        expected = torch.arange(rank - rank % (size // 2), rank - rank % (size // 2) + size // 2).float()
        assert torch.equal(sub.gather_sequence(shard, 1), expected.repeat_interleave(2)[None])
    with pytest.raises(ValueError, match="cp_size=3 must divide"):
        init_from_env(cp_size=3)


CHECKS = {
    "gather_fp32_dim1": lambda c, r, s: check_gather(c, r, s, (2, 5, 3), 1, torch.float32, 10),
    "gather_bf16_negative_dim": lambda c, r, s: check_gather(c, r, s, (3, 7, 2, 4), -3, torch.bfloat16, 20),
    "gather_fp32_dim0": lambda c, r, s: check_gather(c, r, s, (3, 4), 0, torch.float32, 30),
    "tail_shorter_than_shard": lambda c, r, s: check_previous_tail(c, r, s, (2, 6, 3), 1, 2, torch.float32, 40),
    "tail_whole_shard": lambda c, r, s: check_previous_tail(c, r, s, (2, 6, 3), 1, 6, torch.float32, 50),
    "tail_spans_ranks": lambda c, r, s: check_previous_tail(c, r, s, (2, 6, 3), 1, 9, torch.float32, 60),
    "tail_bf16_negative_dim": lambda c, r, s: check_previous_tail(c, r, s, (3, 5, 2, 4), -3, 3, torch.bfloat16, 70),
    "tail_dim0": lambda c, r, s: check_previous_tail(c, r, s, (5, 2, 4), 0, 4, torch.float32, 80),
    "metadata_without_grad": check_metadata_without_grad,
    "empty_tail_and_errors": check_empty_tail_and_errors,
    "context_for_group": check_context_for_group,
    "subgroups": check_subgroups,
    "shard_batch_with_group": check_shard_batch_with_group,
    "init_from_env": check_init_from_env,
}


def _run_checks(rank: int, size: int) -> dict[str, str | None]:
    import torch.distributed as dist

    from nemo_dsa.distributed import ProcessGroupContext

    ctx = ProcessGroupContext(dist.group.WORLD)
    results = {}
    for name, check in CHECKS.items():
        try:
            check(ctx, rank, size)
            results[name] = None
        except Exception:  # reported per check; the collectives stay in step because
            results[name] = traceback.format_exc()  # failures are asserts after them
        dist.barrier()
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"{p}ranks")
def rank_results(request):
    return request.param, run_on_ranks(_run_checks, request.param)


@pytest.mark.parametrize("name", list(CHECKS))
def test_primitive_matches_single_process(rank_results, name):
    size, per_rank = rank_results
    failures = [f"rank {r}:\n{res[name]}" for r, res in enumerate(per_rank) if res[name] is not None]
    assert not failures, f"{name} on {size} ranks failed\n" + "\n".join(failures)


# --- sharding helper (no process group needed) -------------------------------------------------


def _packed_batch(seq_len: int = 21, rows: int = 2) -> dict:
    """Rows of documents with document-local positions and nemo-automodel-style seq_lens."""
    gen = torch.Generator().manual_seed(5)
    lens = [[7, 9, 5], [13, 8, -1000]]
    position_ids = torch.cat([torch.cat([torch.arange(n) for n in row if n > 0])[None] for row in lens])
    return {
        "input_ids": torch.randint(0, 256, (rows, seq_len), generator=gen),
        "labels": torch.randint(0, 256, (rows, seq_len), generator=gen),
        "position_ids": position_ids,
        "seq_lens": torch.tensor(lens),
        "seq_lens_padded": torch.tensor(lens),
        "qkv_format": "thd",
    }


def _assert_same_batch(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected), (sorted(actual), sorted(expected))
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


def test_multiple_and_padded_length():
    assert cp_shard_multiple((0, 4, 16, 4), 2) == 32
    assert cp_shard_multiple((0, 0), 3) == 3
    assert cp_shard_multiple((4, 6), 2) == 24
    assert cp_padded_length(100, (4, 16), 2) == 128
    assert cp_padded_length(128, (4, 16), 2) == 128
    assert cp_padded_length(100, (4, 16), 1) == 100


@pytest.mark.parametrize("size", [2, 3, 4])
def test_shards_concatenate_to_the_padded_batch(size):
    batch = _packed_batch()
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["packed_seq_ids"] = torch.tensor([[1] * 7 + [2] * 9 + [3] * 5, [1] * 13 + [2] * 8])
    shards = [shard_batch(batch, compress_ratios=(0, 4), cp_rank=r, cp_size=size, pad_token_id=258) for r in range(size)]
    padded = cp_padded_length(21, (0, 4), size)
    pad = padded - 21
    assert pad > 0 and padded % (4 * size) == 0
    for shard in shards:
        assert shard["input_ids"].shape == (2, padded // size)
        assert shard["qkv_format"] == "thd" and torch.equal(shard["seq_lens"], batch["seq_lens"])
        # The padding joins the last document's padded tail (the -1000 slot stays empty).
        assert shard["seq_lens_padded"].tolist() == [[7, 9, 5 + pad], [13, 8 + pad, -1000]]
    cat = {k: torch.cat([s[k] for s in shards], dim=1) for k in ("input_ids", "labels", "position_ids", "attention_mask", "packed_seq_ids")}
    for key, fill in (("input_ids", 258), ("labels", -100), ("attention_mask", 0), ("packed_seq_ids", 0)):
        assert torch.equal(cat[key][:, :21], batch[key]), key
        assert (cat[key][:, 21:] == fill).all(), key
    # Positions keep counting through the padding.
    assert torch.equal(cat["position_ids"][:, :21], batch["position_ids"])
    assert torch.equal(cat["position_ids"][:, 21:], batch["position_ids"][:, -1:] + torch.arange(1, pad + 1))


def test_seq_lens_alone_gains_padded_lengths_and_no_padding_keeps_fields():
    batch = _packed_batch()
    del batch["seq_lens_padded"]
    shard = shard_batch(batch, compress_ratios=(4,), cp_rank=1, cp_size=2)
    assert shard["seq_lens_padded"].tolist() == [[7, 9, 8], [13, 11, -1000]]
    assert torch.equal(shard["seq_lens"], batch["seq_lens"])
    # One row given as 1-D [ndocs] (legal for the metadata builder) keeps its rank, and the shard's
    # lengths still build metadata.
    single = {"input_ids": torch.arange(14)[None], "seq_lens": torch.tensor([5, 9])}
    shard = shard_batch(single, compress_ratios=(4,), cp_rank=0, cp_size=2)
    assert shard["seq_lens_padded"].tolist() == [5, 11]
    build_attention_metadata(compress_ratio=4, seq_lens=shard["seq_lens"], seq_lens_padded=shard["seq_lens_padded"],
                             cp_rank=0, cp_size=2, batch_size=1, seq_len=8)
    # Already a multiple: nothing padded, cu_seqlens passes through whole.
    even = {"input_ids": torch.arange(32).view(2, 16), "cu_seqlens": torch.tensor([0, 5, 16])}
    shard = shard_batch(even, compress_ratios=(4,), cp_rank=1, cp_size=2)
    assert torch.equal(shard["input_ids"], even["input_ids"][:, 8:])
    assert torch.equal(shard["cu_seqlens"], even["cu_seqlens"])


def test_extra_sequence_keys_and_inputs_embeds():
    gen = torch.Generator().manual_seed(3)
    batch = {"inputs_embeds": torch.randn(2, 10, 4, generator=gen), "doc_weight": torch.rand(2, 10, generator=gen)}
    with pytest.raises(ValueError, match="doc_weight.*extra_sequence_keys"):
        shard_batch(batch, compress_ratios=(4,), cp_rank=0, cp_size=2)
    shards = [
        shard_batch(batch, compress_ratios=(4,), cp_rank=r, cp_size=2, extra_sequence_keys={"doc_weight": -1.0})
        for r in range(2)
    ]
    embeds = torch.cat([s["inputs_embeds"] for s in shards], dim=1)
    weight = torch.cat([s["doc_weight"] for s in shards], dim=1)
    assert embeds.shape == (2, 16, 4) and torch.equal(embeds[:, :10], batch["inputs_embeds"])
    assert (embeds[:, 10:] == 0).all() and (weight[:, 10:] == -1.0).all()


def test_no_cp_is_identity():
    batch = _packed_batch()
    out = shard_batch(batch, compress_ratios=(4,))
    assert out is not batch
    _assert_same_batch(out, batch)


@pytest.mark.parametrize(
    "change, kwargs, error, match",
    [
        (lambda b: b.update(seq_lens_padded=torch.tensor([[7, 9, 4], [13, 8, -1000]])), {}, ValueError, "seq_lens_padded: lengths of row 0 sum to 20"),
        (lambda b: b.update(cu_seqlens=torch.tensor([0, 7, 16, 21])), {}, ValueError, "cu_seqlens: the row length 21"),
        (lambda b: b.update(labels=b["labels"][:, :20]), {}, ValueError, r"batch\['labels'\] must have shape \[2, 21"),
        (lambda b: b.pop("input_ids"), {}, ValueError, "input_ids"),
        (lambda b: None, {"cp_rank": 2}, ValueError, "cp_rank must be < cp_size=2"),
        (lambda b: None, {"cp_size": 0}, ValueError, "cp_size must be >= 1"),
        (lambda b: None, {"cp_rank": -1}, ValueError, "cp_rank must be >= 0"),
    ],
)
def test_shard_batch_errors_name_the_field(change, kwargs, error, match):
    batch = _packed_batch()
    change(batch)
    args = {"cp_rank": 0, "cp_size": 2, **kwargs}
    with pytest.raises(error, match=match):
        shard_batch(batch, compress_ratios=(4,), **args)
    with pytest.raises(TypeError, match="batch must be a mapping"):
        shard_batch([1], cp_rank=0, cp_size=2)


def test_init_from_env_outside_torchrun(monkeypatch):
    from nemo_dsa.distributed import init_from_env

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_from_env() == (None, 0, 1)
    with pytest.raises(ValueError, match=r"cp_size=2 must divide the number of processes \(WORLD_SIZE=1\)"):
        init_from_env(cp_size=2)
    with pytest.raises(ValueError, match="cp_size must be a positive int"):
        init_from_env(cp_size=0)


@pytest.mark.parametrize("size", [2, 4])
def test_shards_build_the_metadata_of_the_padded_row(size):
    """Every field the sharder writes is what build_attention_metadata expects under CP."""
    from nemo_dsa.metadata import build_attention_metadata

    batch = _packed_batch()
    batch["packed_seq_ids"] = torch.tensor([[1] * 7 + [2] * 9 + [3] * 5, [1] * 13 + [2] * 8])
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    fields = ("position_ids", "seq_lens", "seq_lens_padded", "packed_seq_ids", "attention_mask")
    shards = [shard_batch(batch, compress_ratios=(4,), cp_rank=r, cp_size=size) for r in range(size)]
    metas = [build_attention_metadata(compress_ratio=4, cp_rank=r, cp_size=size, **{k: shards[r][k] for k in fields})
             for r in range(size)]  # fmt: skip
    whole = {k: torch.cat([s[k] for s in shards], 1) if k not in ("seq_lens", "seq_lens_padded") else shards[0][k]
             for k in fields}  # fmt: skip
    full = build_attention_metadata(compress_ratio=4, **whole)
    for name in ("ks", "ke", "doc_ids", "positions", "group_valid", "group_doc_ids"):
        assert torch.equal(torch.cat([getattr(m, name) for m in metas], 1), getattr(full, name)), name
    # The unpadded row's real tokens see exactly what they see without padding.
    alone = build_attention_metadata(compress_ratio=4, **{k: batch[k] for k in fields})
    assert torch.equal(full.ks[:, :21], alone.ks) and torch.equal(full.ke[:, :21], alone.ke)
    assert not full.token_valid[:, 21:].any()


def test_unmasked_rows_get_a_mask_for_the_padding():
    batch = {"input_ids": torch.arange(20).view(2, 10), "labels": torch.arange(20).view(2, 10)}
    shards = [shard_batch(batch, compress_ratios=(4,), cp_rank=r, cp_size=2) for r in range(2)]
    mask = torch.cat([s["attention_mask"] for s in shards], dim=1)
    assert mask.tolist() == [[1] * 10 + [0] * 6] * 2
    assert "attention_mask" not in shard_batch(batch, compress_ratios=(4,), cp_rank=0, cp_size=1)


def test_process_group_context_needs_an_initialised_world():
    import torch.distributed as dist

    from nemo_dsa.distributed import ProcessGroupContext

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="cp_group: torch.distributed is not initialized"):
        ProcessGroupContext(None)


def test_broadcast_position_ids_are_sharded():
    batch = {"input_ids": torch.arange(20).view(2, 10), "position_ids": torch.arange(10)[None]}
    shards = [shard_batch(batch, compress_ratios=(4,), cp_rank=r, cp_size=2) for r in range(2)]
    assert torch.equal(torch.cat([s["position_ids"] for s in shards], 1), torch.arange(16)[None])
