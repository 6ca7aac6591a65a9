"""NaN/inf never crosses a document or a CP rank boundary in the whole model (CPU, fp32).

A packed row holds documents A and B. A forward hook on the embedding replaces its output by a
leaf tensor (so the gradient reaching each position's input is observable) and, in the poisoned
run, writes NaN or inf into every embedding row of A. B's logits, B's loss (labels on B only) and
the loss gradient reaching B's embedding rows must be bitwise those of the clean run, where A keeps
its finite embeddings: B must not depend on A at all. Layouts put B after A (also starting off the
compression grid of 4 and 8) and before A, with window 4 and ``sliding_window=1``; both scoring
modes (V4 also with the straight-through indexer term). The parameter gradients are not
compared: A's rows are NaN in the forward, so a weight gradient ``X^T dY`` sums NaN x 0 over A's
rows - that is the trainer's non-finite-step guard.

Under context parallelism (2 gloo ranks) A lies entirely on rank 0 and B, wholly or partly, on
rank 1: rank 1's logits and embedding gradients must be bitwise those of the clean CP run.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from _support.cp_spawn import run_on_ranks
from _support.helpers import TINY_VOCAB, tiny_config
from nemo_dsa.distributed import shard_batch
from nemo_dsa.models.dsa_lm.modeling import DSAForCausalLM

SEQ = 32  # a multiple of 2 ranks x lcm(4, 8): the CP shards need no padding
POISONS = {"nan": float("nan"), "inf": float("inf")}

# Document order and lengths in the row; "A" is poisoned.
LAYOUTS = {
    "b-after-a": (("A", 12), ("B", 20)),
    "b-after-a-off-grid": (("A", 13), ("B", 19)),  # B starts at 13: off the 4 and 8 grids
    "b-before-a-off-grid": (("B", 14), ("A", 18)),  # A starts at 14
}
# CP layouts: rank 0 holds positions 0..15, rank 1 holds 16..31.
CP_LAYOUTS = {
    "a-fills-rank0": (("A", 16), ("B", 16)),
    "b-spans-ranks": (("A", 13), ("B", 19)),  # B starts off the grid on rank 0 and continues on rank 1
}


# Scoring modes; V4 also with the straight-through term, through which the LM loss trains the
# indexer (its backward then runs in the model's backward).
VARIANTS = {
    "v4": dict(scoring="v4"),
    "v4-straight-through": dict(scoring="v4", indexer_straight_through=True),
    "v41": dict(scoring="v41"),
}


def make_model(variant: str, window: int) -> DSAForCausalLM:
    torch.manual_seed(0)  # identical weights in every run and every process
    return DSAForCausalLM(tiny_config(sliding_window=window, **VARIANTS[variant]))


def make_batch(layout) -> tuple[dict, torch.Tensor]:
    """The packed row (labels on B only) and the bool [1, SEQ] mask of A's positions."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, TINY_VOCAB, (1, SEQ), generator=gen)
    labels = torch.randint(0, TINY_VOCAB, (1, SEQ), generator=gen)
    in_a = torch.zeros(1, SEQ, dtype=torch.bool)
    position_ids = torch.zeros(1, SEQ, dtype=torch.long)
    start = 0
    for name, length in layout:
        position_ids[0, start : start + length] = torch.arange(length)
        in_a[0, start : start + length] = name == "A"
        start += length
    assert start == SEQ
    labels = labels.masked_fill(in_a, -100)
    seq_lens = torch.tensor([[length for _, length in layout]])
    batch = {"input_ids": ids, "labels": labels, "position_ids": position_ids, "seq_lens": seq_lens,
             "qkv_format": "thd"}  # fmt: skip
    return batch, in_a


def run(model, batch: dict, in_a: torch.Tensor, poison: float | None, cp_group=None) -> dict:
    """Logits, loss and the loss gradient at every embedding row; A's rows set to ``poison``."""
    leaves = []

    def hook(module, inputs, output):
        leaf = output.detach().clone().requires_grad_(True)
        leaves.append(leaf)
        if poison is None:
            return leaf
        return torch.where(in_a.unsqueeze(-1), torch.full_like(leaf, poison), leaf)

    handle = model.embed.register_forward_hook(hook)
    try:
        out = model(**batch, cp_group=cp_group)
    finally:
        handle.remove()
    model.zero_grad(set_to_none=True)
    out.loss.backward()
    return {"logits": out.logits.detach(), "loss": out.loss.detach(), "embed_grad": leaves[0].grad}


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    assert torch.isfinite(expected).all(), f"{what}: the clean run is not finite"
    if not torch.equal(actual, expected):
        pytest.fail(f"{what} differs from the clean run (max |diff| {(actual - expected).abs().max()})")


@pytest.mark.parametrize("window", [4, 1])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_poisoned_document_does_not_reach_the_other(variant, layout, window):
    model = make_model(variant, window)
    batch, in_a = make_batch(LAYOUTS[layout])
    in_b = ~in_a[0]
    clean = run(model, batch, in_a, None)
    for name, value in POISONS.items():
        poisoned = run(model, batch, in_a, value)
        assert not torch.isfinite(poisoned["logits"][0, in_a[0]]).all(), f"{name}: the poison never reached A"
        assert_bitwise(poisoned["logits"][0, in_b], clean["logits"][0, in_b], f"{name}: B's logits")
        assert_bitwise(poisoned["loss"], clean["loss"], f"{name}: B's loss")
        assert_bitwise(poisoned["embed_grad"][0, in_b], clean["embed_grad"][0, in_b], f"{name}: B's embedding gradient")


# ----------------------------------------------------------------------------------------------
# Context parallelism: 2 gloo ranks
# ----------------------------------------------------------------------------------------------

CP_CASES = [(v, layout, w) for v in VARIANTS for layout in CP_LAYOUTS for w in (4, 1)]


def _case_id(case) -> str:
    return f"{case[0]}-{case[1]}-window{case[2]}"


def cp_all_cases(rank: int, size: int) -> dict:
    """Clean and poisoned runs of every CP case on this rank (stops at the first failure)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    results = {}
    for case in CP_CASES:
        variant, layout, window = case
        try:
            model = make_model(variant, window)
            batch, in_a = make_batch(CP_LAYOUTS[layout])
            batch["in_a"] = in_a
            local = shard_batch(batch, group, compress_ratios=model.config.compress_ratios,
                                extra_sequence_keys={"in_a": False})  # fmt: skip
            local_in_a = local.pop("in_a")
            runs = {"clean": run(model, local, local_in_a, None, group)}
            for name, value in POISONS.items():
                runs[name] = run(model, local, local_in_a, value, group)
            runs["in_a"] = local_in_a
            results[_case_id(case)] = runs
        except Exception:
            results[_case_id(case)] = traceback.format_exc()
            break  # a failed collective leaves the ranks out of step
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def cp_results():
    return run_on_ranks(cp_all_cases, 2)


@pytest.mark.parametrize("case", CP_CASES, ids=_case_id)
def test_poisoned_document_does_not_cross_ranks(cp_results, case):
    for rank, per_rank in enumerate(cp_results):
        result = per_rank.get(_case_id(case), "not run (an earlier case failed)")
        if isinstance(result, str):
            pytest.fail(f"rank {rank}:\n{result}")
    rank0, rank1 = (per_rank[_case_id(case)] for per_rank in cp_results)
    assert rank1["in_a"].sum() == 0, "layout: A must lie entirely on rank 0"
    assert rank0["in_a"].any()
    for name in POISONS:
        poisoned_a = rank0[name]["logits"][0, rank0["in_a"][0]]
        assert not torch.isfinite(poisoned_a).all(), f"{name}: the poison never reached A"
        assert_bitwise(rank1[name]["logits"], rank1["clean"]["logits"], f"{name}: rank 1's logits")
        assert_bitwise(rank1[name]["loss"], rank1["clean"]["loss"], f"{name}: rank 1's loss")
        assert_bitwise(rank1[name]["embed_grad"], rank1["clean"]["embed_grad"], f"{name}: rank 1's embedding gradient")
        in_b0 = ~rank0["in_a"][0]  # B's part on rank 0, if any
        assert_bitwise(rank0[name]["logits"][0, in_b0], rank0["clean"]["logits"][0, in_b0],
                       f"{name}: B's logits on rank 0")  # fmt: skip
        assert_bitwise(rank0[name]["embed_grad"][0, in_b0], rank0["clean"]["embed_grad"][0, in_b0],
                       f"{name}: B's embedding gradient on rank 0")  # fmt: skip
