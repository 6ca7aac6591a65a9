"""``logger=tensorboard``: TensorBoard scalars beside metrics.jsonl, purged past the step a run
resumes from; a clear one-line error when the tensorboard package is missing."""

from __future__ import annotations

import importlib.util

import pytest

from nemo_dsa.train import load_config, main, read_metrics, train

SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=4", "recipe.ckpt_every=2",
         "recipe.val_every=2", "recipe.warmup_steps=1", "recipe.num_threads=1", "recipe.plot=false"]


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_match_metrics_jsonl_across_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    train(load_config([*SHORT, "logger=tensorboard", f"run_dir={tmp_path}", "recipe.stop_at_step=3"]))
    step_2 = tmp_path / "checkpoints" / "step_0000002"
    assert train(load_config([*SHORT, "logger=tensorboard", f"run_dir={tmp_path}", f"resume={step_2}"])).resumed_from == 2
    records = read_metrics(tmp_path / "metrics.jsonl")
    scalars = _scalars(tmp_path / "tensorboard")
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("val_loss", "val/loss")):
        expected = [(r["step"], r[key]) for r in records if key in r and "event" not in r]
        got = sorted(scalars[tag])
        assert [s for s, _ in got] == [s for s, _ in expected] and len(got) == len({s for s, _ in got})
        assert all(v == pytest.approx(e, rel=1e-6) for (_, v), (_, e) in zip(got, expected))  # stored as fp32
    assert [s for s, _ in sorted(scalars["train/loss"])] == [1, 2, 3, 4]  # step 3 of the first run purged


def test_the_default_logger_writes_no_tensorboard_files(tmp_path):
    train(load_config([*SHORT, f"run_dir={tmp_path}", "recipe.max_steps=1"]))
    assert not (tmp_path / "tensorboard").exists()


def test_a_missing_tensorboard_package_is_one_line(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert main([*SHORT, "logger=tensorboard", f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["nemo-dsa-train: error: logger=tensorboard needs the 'tensorboard' package, which is not "
                   "installed: pip install 'nemo-dsa[tensorboard]' (or pip install tensorboard)"]
    assert not (tmp_path / "checkpoints").exists()
