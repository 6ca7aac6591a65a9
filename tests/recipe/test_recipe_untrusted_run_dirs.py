"""A run directory from someone else: its files never run code, never redirect a write, and a
malformed one is named on one line (and, for ``resume=auto``, set aside like a corrupt one)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_dsa.evaluate import main as evaluate_main
from nemo_dsa.generate import main as generate_main
from nemo_dsa.recipe.files import RunDirLock, RunDirUnusable
from nemo_dsa.recipe.state import CorruptCheckpoint, list_checkpoints, read_state, verify_checkpoint
from nemo_dsa.train import load_config, main, train

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=4", "recipe.ckpt_every=2",
         "recipe.val_every=2", "recipe.warmup_steps=1", "recipe.num_threads=1", "recipe.plot=false"]


class _WritesMarker:
    """Unpickling this calls ``exec`` on code that creates ``marker``: what a hostile state file does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",)


def _rewrite_manifest(checkpoint: Path) -> None:
    """Recompute the manifest's digests, as anyone editing a checkpoint can."""
    files = {p.name: {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "size": p.stat().st_size}
             for p in sorted(checkpoint.iterdir()) if p.name != "manifest.json"}
    (checkpoint / "manifest.json").write_text(json.dumps({"step": 0, "files": files}))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run with checkpoints at steps 2 and 4 (copied by each test that alters it)."""
    path = tmp_path_factory.mktemp("trained") / "run"
    train(load_config([*SHORT, f"run_dir={path}"]))
    return path


@pytest.fixture
def hostile(trained, tmp_path) -> tuple[Path, Path]:
    """A copy of the run whose newest trainer_state.pt runs code when unpickled, its manifest made to match."""
    run_dir = tmp_path / "hostile"
    shutil.copytree(trained, run_dir)
    marker = tmp_path / "code-ran"
    for checkpoint in list_checkpoints(run_dir):
        torch.save({"step": 4, "payload": _WritesMarker(marker)}, checkpoint / "trainer_state.pt")
        _rewrite_manifest(checkpoint)
    return run_dir, marker


def test_the_hostile_state_file_really_runs_code_when_unpickled(hostile):
    """The premise of the tests below: a plain ``torch.load`` of this file runs its code."""
    run_dir, marker = hostile
    state = list_checkpoints(run_dir)[-1] / "trainer_state.pt"
    code = f"import torch; torch.load({str(state)!r}, weights_only=False)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)
    assert marker.read_text() == "code ran"


def test_a_hostile_state_file_is_refused_on_one_line_and_runs_nothing(hostile, capsys):
    run_dir, marker = hostile
    newest = list_checkpoints(run_dir)[-1]
    verify_checkpoint(newest)  # its manifest matches: only the load can refuse it
    with pytest.raises(CorruptCheckpoint) as caught:
        read_state(newest)
    message = str(caught.value)
    assert message == (f"checkpoint {newest}: trainer_state.pt holds objects other than tensors and plain data; "
                       "refused (loading them could run code)")
    commands = [  # (command, arguments, lines before the error: resume=auto's notes on what it set aside)
        (generate_main, [f"run_dir={run_dir}", f"checkpoint={newest}", "prompt=x", "max_new_tokens=2"], 0),
        (generate_main, [f"run_dir={run_dir}", "prompt=x", "max_new_tokens=2"], 0),  # the newest intact: none is
        (evaluate_main, [f"run_dir={run_dir}"], 0),
        (main, [*SHORT, f"run_dir={run_dir.parent / 'resumed'}", f"resume={newest}"], 0),
        (main, [*SHORT, f"run_dir={run_dir}", "recipe.max_steps=6"], 2),  # resume=auto: both set aside
    ]
    for command, args, notes in commands:
        assert command(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == notes + 1 and ": error: " in err[-1] and "Traceback" not in "\n".join(err), err
        assert "trainer_state.pt holds objects other than tensors and plain data" in "\n".join(err), err
        assert not marker.exists()


def test_every_state_a_run_saves_loads_weights_only(trained):
    """What ``save_checkpoint`` writes (optimizer, scheduler, RNG states, data position, recipe)
    is tensors and plain data: a weights-only load restores it whole."""
    for checkpoint in list_checkpoints(trained):
        state = read_state(checkpoint)
        assert set(state) >= {"step", "optimizer", "scheduler", "rng", "data", "model_config", "recipe", "log_window"}
        assert isinstance(state["rng"]["torch"], torch.Tensor) and isinstance(state["rng"]["python"], tuple)


@pytest.mark.parametrize("manifest", [
    [],
    {"files": ["model.safetensors", "trainer_state.pt"]},
    {"files": {"trainer_state.pt": 5}},
    {"files": {"trainer_state.pt": {"size": "5", "sha256": "ab"}}},
    {"files": {"trainer_state.pt": {"size": 5}}},
    {"files": {"../../../etc/passwd": {"size": 5, "sha256": "ab"}, "trainer_state.pt": {"size": 5, "sha256": "ab"}}},
    {"files": {"model.safetensors": {"size": 5, "sha256": "ab"}}},
    "\udcff",
])
def test_a_manifest_of_the_wrong_structure_is_a_corrupt_checkpoint(trained, tmp_path, manifest):
    checkpoint = tmp_path / "step_0000004"
    shutil.copytree(list_checkpoints(trained)[-1], checkpoint)
    if manifest == "\udcff":
        (checkpoint / "manifest.json").write_bytes(b'{"files": "\xff"}')  # not UTF-8
    else:
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpoint, match=f"checkpoint {checkpoint}: {checkpoint / 'manifest.json'}"):
        verify_checkpoint(checkpoint)


def test_resume_auto_sets_a_wrong_structure_manifest_aside_and_falls_back(trained, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    newest = list_checkpoints(run_dir)[-1]
    (newest / "manifest.json").write_text(json.dumps({"files": {"trainer_state.pt": 7}}))
    assert main([*SHORT, f"run_dir={run_dir}", "recipe.max_steps=5"]) == 0
    err = capsys.readouterr().err
    assert f"{newest / 'manifest.json'} entry 'trainer_state.pt' is not" in err and "Traceback" not in err
    assert "falling back to the previous checkpoint" in err
    assert (run_dir / "checkpoints" / "corrupt-step_0000004").is_dir()
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"] == 2


def test_a_symlink_named_lock_is_refused_and_its_target_survives(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    precious = tmp_path / "precious.txt"
    precious.write_text("the content of someone's file\n")
    (run_dir / ".lock").symlink_to(precious)
    with pytest.raises(RunDirUnusable, match=r"\.lock is a symbolic link; remove it"):
        RunDirLock(run_dir).acquire()
    assert main([*SHORT, f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a symbolic link" in err[0], err
    assert precious.read_text() == "the content of someone's file\n"
    assert (run_dir / ".lock").is_symlink() and sorted(p.name for p in run_dir.iterdir()) == [".lock"]


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_lock_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if kind == "fifo":
        os.mkfifo(run_dir / ".lock")
    else:
        (run_dir / ".lock").mkdir()
    with pytest.raises(RunDirUnusable, match=r"\.lock is not a regular file; remove it"):
        RunDirLock(run_dir).acquire()
