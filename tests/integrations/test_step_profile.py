"""``benchmarks/step_profile.py`` on CPU at the tests' tiny widths: every op of a profiled plugin step
lands in one part, the parts add up to the profiled total, and the work counted from the calls'
shapes is what the formulas give for the tiny V4 step.

The profile's attribution is what these check: forward ops through the part ranges, backward
nodes through their forward op's sequence number (a backward left unattributed would pile into
"other"), the loss and optimizer by their ranges.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_dsa.integrations.side_by_side import TINY_OVERRIDES, TINY_SEQ, TINY_VOCAB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script():
    spec = importlib.util.spec_from_file_location("step_profile", os.path.join(ROOT, "benchmarks", "step_profile.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    load_script().main(["--device", "cpu", "--tiny", "--family", "v4", "v41", "--sides", "plugin",
                        "--steps", "1", "--warmup", "0", "--profile-steps", "1", "--out", str(out)])  # fmt: skip
    assert out.with_suffix(".md").read_text().count("| attention kernels |") == 2
    return {r["family"]: r for r in json.loads(out.read_text())["results"]}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_parts_add_up_to_the_profiled_total(results, family):
    profile = results[family]["profile"]
    parts = profile["part_ms"]
    assert sum(parts.values()) == pytest.approx(profile["total_ms"], rel=1e-9)
    assert profile["total_ms"] == pytest.approx(profile["profiled_total_ms"], rel=0.02)
    assert parts["other"] < 0.05 * profile["total_ms"], parts
    expected = ["attention kernels", "attention projections & glue", "indexer", "compressors", "RoPE & norms",
                "hyper-connections", "MoE", "LM head", "loss", "optimizer"]  # fmt: skip
    if family == "v41":
        expected.append("quant-dequant (ops/quant)")
    for part in expected:
        assert parts[part] > 0, (part, parts)
    rows = {r["part"]: r for r in results[family]["parts"]}
    assert rows["attention kernels"]["ms"] == parts["attention kernels"]


def window_pairs(seq: int, window: int) -> int:
    return sum(min(window, i + 1) for i in range(seq))


@pytest.mark.slow
def test_work_of_the_tiny_v4_step(results):
    tiny, seq, vocab = TINY_OVERRIDES["v4"], TINY_SEQ["v4"], TINY_VOCAB
    work = results["v4"]["profile"]["work"]
    window, topk = tiny["sliding_window"], tiny["index_topk"]
    # Ratios 0 / 4 / 128: the window on every layer, top-6 of the ratio-4 groups, every ratio-128 group.
    pairs = 3 * window_pairs(seq, window)
    pairs += sum(min(topk, (i + 1) // 4) for i in range(seq)) + sum((i + 1) // 128 for i in range(seq))
    assert work["attention kernels"]["flops"] == 14 * tiny["head_dim"] * tiny["num_attention_heads"] * pairs
    # The ratio-4 indexer scores every causal (query, group) pair, forward only.
    scored = sum((i + 1) // 4 for i in range(seq))
    assert work["indexer"]["flops"] >= 2 * tiny["index_n_heads"] * tiny["index_head_dim"] * scored
    assert work["LM head"]["flops"] == 6 * seq * tiny["hidden_size"] * vocab
    for part in ("attention projections & glue", "MoE", "compressors"):
        assert work[part]["flops"] > 0, part
    for part in ("RoPE & norms", "hyper-connections", "embedding", "optimizer", "loss"):
        assert work[part]["bytes"] > 0, part
