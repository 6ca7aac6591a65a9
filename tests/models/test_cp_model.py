"""DSAForCausalLM under context parallelism equals the single-process run.

Real gloo groups of 2 and 4 CPU processes. Each rank gets its contiguous shard from
``shard_batch`` (rows padded to a multiple of cp_size * lcm(ratios)), runs the model with
``cp_group`` and backpropagates its share of the global objective (its label-count share of
the LM loss plus its share of the globally normalised indexer KL loss); the gathered logits, the
global loss and the summed parameter gradients must equal one process running the whole,
unpadded batch (V4 index-key gradients to bf16 precision: ``_grad_tolerance`` in
_support/cp_model_cases.py says why).
Layouts: plain and right-padded unpacked rows, packed rows whose documents start off the
compression grid and cross shard boundaries (window longer than a 4-rank shard in one case).
Both scoring modes (V4 also with the KL loss); V4.1 with layer roles and candidate blocks.
"""

from __future__ import annotations

import pytest
import torch

from _support.cp_model_cases import (CASES, PAD_ID, SEQ_LEN, all_cases, assert_cp_matches, build_model, make_batch,
                                     single_process_run)
from _support.cp_spawn import run_on_ranks
from nemo_dsa.distributed import shard_batch


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"{p}ranks")
def cp_results(request):
    return request.param, run_on_ranks(all_cases, request.param)


@pytest.fixture(scope="module")
def references():
    return {case: single_process_run(case) for case in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_cp_equals_single_process(cp_results, references, case):
    size, per_rank = cp_results
    assert_cp_matches(per_rank[0], references[case], case, size)


def test_cp_rejects_shards_that_split_groups(cp_results):
    size, per_rank = cp_results
    errors = [f"rank {r}:\n{res['whole_groups_error']}" for r, res in enumerate(per_rank) if res["whole_groups_error"]]
    assert not errors, "\n".join(errors)


def test_padding_in_shards_is_padding():
    """The sharder's padding is invisible to the real tokens (single process, padded vs not)."""
    ref = single_process_run("v4-packed")
    model = build_model("v4", 6)
    padded = shard_batch(make_batch("packed"), compress_ratios=model.config.compress_ratios, cp_rank=0, cp_size=1)
    assert padded["input_ids"].shape[1] == SEQ_LEN  # cp_size 1: nothing to pad
    whole = {k: torch.cat([shard_batch(make_batch("packed"), compress_ratios=(0, 4, 8, 4), cp_rank=r, cp_size=2,
                                       pad_token_id=PAD_ID)[k] for r in range(2)], dim=1)
             for k in ("input_ids", "labels", "position_ids")}  # fmt: skip
    spans = shard_batch(make_batch("packed"), compress_ratios=(0, 4, 8, 4), cp_rank=0, cp_size=2)
    out = model(**whole, seq_lens=spans["seq_lens"], seq_lens_padded=spans["seq_lens_padded"])
    torch.testing.assert_close(out.logits[:, :SEQ_LEN], ref["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref["loss"], rtol=1e-6, atol=1e-6)
