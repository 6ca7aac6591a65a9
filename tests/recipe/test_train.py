"""The training recipe: a short run's outputs, exact resume, schedule, recipe errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from nemo_dsa.train import load_config, main, read_metrics, train, warmup_cosine

# A few seconds per run on 2 CPU cores; fp32 and a fixed thread count keep it bitwise repeatable.
SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=4", "recipe.ckpt_every=2",
         "recipe.val_every=2", "recipe.num_threads=1"]


def _run(run_dir, *extra):
    return train(load_config([*SHORT, f"run_dir={run_dir}", *extra]))


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def test_short_run_writes_metrics_plot_and_checkpoint(tmp_path):
    result = _run(tmp_path)
    assert result.step == 4 and result.resumed_from is None
    records = read_metrics(tmp_path / "metrics.jsonl")
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [1, 2, 3, 4]
    for r in train_records:
        assert math.isfinite(r["loss"]) and r["lr"] > 0 and r["tokens_per_s"] > 0 and math.isfinite(r["grad_norm"])
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["step_0000002", "step_0000004"]
    state = torch.load(tmp_path / "checkpoints" / "step_0000004" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4 and {"optimizer", "scheduler", "rng", "data"} <= set(state)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["step"] == 4 and summary["val_loss"] == result.val_loss


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    _run(full, "scoring=v41")
    stopped = _run(part, "scoring=v41", "recipe.stop_at_step=2")
    assert stopped.step == 2
    resumed = _run(part, "scoring=v41")
    assert resumed.resumed_from == 2 and resumed.step == 4
    a, b = _losses(full), _losses(part)
    assert a == b and set(a) == {1, 2, 3, 4}  # bitwise: JSON floats round-trip exactly
    wa = load_file(str(full / "checkpoints" / "step_0000004" / "model.safetensors"))
    wb = load_file(str(part / "checkpoints" / "step_0000004" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(ValueError, match="resume=never"):
        _run(part, "resume=never")
    with pytest.raises(ValueError, match="different model config.*index_topk"):
        _run(part, "scoring=v41", "model.config.index_topk=5", "recipe.max_steps=6")


def test_a_logging_window_spanning_the_stop_averages_as_without_it(tmp_path):
    """log_every=3 with a stop after step 2: the record at step 3 averages steps 1-3 either way
    (the checkpoint carries the steps since the last record)."""
    full, part = tmp_path / "full", tmp_path / "part"
    _run(full, "recipe.log_every=3")
    _run(part, "recipe.log_every=3", "recipe.stop_at_step=2")
    assert _losses(part) == {}  # nothing logged yet: the window is still open
    _run(part, "recipe.log_every=3")
    assert _losses(full) == _losses(part) and set(_losses(full)) == {3, 4}


def test_warmup_cosine_schedule():
    f = lambda s: warmup_cosine(s, warmup_steps=4, max_steps=20, min_lr_ratio=0.1)  # noqa: E731
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    decay = [f(s) for s in range(4, 21)]
    assert decay[0] == 1.0 and decay[-1] == pytest.approx(0.1)
    assert all(x > y for x, y in zip(decay, decay[1:]))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["recipe.max_steps=0"], "recipe.max_steps"),
        (["recipe.precision=fp8"], "recipe.precision"),
        (["recipe.stop_at_step=9"], "recipe.stop_at_step"),
        (["recipe.cp_size=0"], "recipe.cp_size"),
        (["recipe.cp_size=2"], "torchrun"),
        (["recipe.grad_clip=0"], "recipe.grad_clip"),
        (["model=v4_flash"], "meta device"),
        (["model.config.vocab_size=10"], "vocab_size"),
        (["resume=/nonexistent/ckpt"], "resume"),
    ],
)
def test_recipe_errors_name_the_key(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        _run(tmp_path, *overrides)


@pytest.mark.parametrize("override", ["recipe.max_step=2", "+recipe.max_step=2", "recipe.max_steps=abc"])
def test_the_recipe_schema_rejects_unknown_keys_and_wrong_types(tmp_path, override):
    """RecipeConfig in Hydra's ConfigStore: a typo (Hydra's error) or a key added past the schema
    with ``+`` (ours, naming the closest key) is refused when composing."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises((ConfigCompositionException, ValueError), match="max_step") as info:
        load_config([*SHORT, f"run_dir={tmp_path}", override])
    if override.startswith("+"):
        assert "did you mean max_steps?" in str(info.value)


def test_main_prints_config_and_help(capsys):
    assert main(["--print-config", "scoring=v41", "recipe.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "scoring: v41" in out and "max_steps: 7" in out
    assert main(["--help"]) == 0
    assert "scoring=v41" in capsys.readouterr().out


@pytest.mark.slow
def test_context_parallel_run_matches_single_process(tmp_path):
    """torchrun with 2 CPU ranks (gloo): the CP hook shards every row; losses equal cp_size=1's."""
    import os
    import subprocess
    import sys

    args = [*SHORT, "recipe.max_steps=2", "recipe.val_every=2", "recipe.plot=false"]
    _run(tmp_path / "single", *args[len(SHORT):])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "nemo_dsa.train", *args, "recipe.cp_size=2", f"run_dir={tmp_path / 'cp'}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("run_dir=") == 1  # one final line, from rank 0
    single, cp = _losses(tmp_path / "single"), _losses(tmp_path / "cp")
    assert set(cp) == {1, 2} and cp.keys() == single.keys()
    for step in single:
        assert cp[step] == pytest.approx(single[step], rel=1e-5)
    assert read_metrics(tmp_path / "cp" / "metrics.jsonl")[0]["cp_size"] == 2


def test_no_clipping_and_rerunning_a_finished_run(tmp_path):
    """grad_clip=null trains without clipping; running a finished run again is refused (it would
    train nothing) and leaves its files as they were."""
    from nemo_dsa.recipe.loop import RunFinished

    first = _run(tmp_path, "recipe.grad_clip=null", "recipe.max_steps=2")
    assert first.step == 2 and first.val_loss is not None
    files = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != ".lock"}
    with pytest.raises(RunFinished, match="finished run"):
        _run(tmp_path, "recipe.grad_clip=null", "recipe.max_steps=2")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != ".lock"} == files
    assert json.loads((tmp_path / "summary.json").read_text())["val_loss"] == first.val_loss
