"""Faults the recipe survives: kills mid-write and mid-save, a second run on the same run_dir,
corrupt or truncated checkpoints, non-finite gradients, changed recipes on resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _support.short_recipe_run import ROOT, SHORT
from nemo_dsa.recipe.files import RunDirLock, RunDirLocked
from nemo_dsa.recipe.parallel import RanksStopped
from nemo_dsa.recipe.state import CorruptCheckpoint
from nemo_dsa.train import load_config, read_metrics, train, warmup_cosine


def _run(run_dir, *extra):
    return train(load_config([*SHORT, f"run_dir={run_dir}", *extra]))


def _losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "loss" in r}


def _weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "checkpoints" / f"step_{step:07d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run's losses, which every interrupted run must reproduce bitwise."""
    run_dir = tmp_path_factory.mktemp("reference")
    _run(run_dir)
    return _losses(run_dir)


def _killed_run(run_dir, kill_when: str, *extra) -> subprocess.CompletedProcess:
    """Run the recipe in a subprocess that SIGKILLs itself at the point ``kill_when`` names."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        import nemo_dsa.recipe.files as files, nemo_dsa.recipe.state as state
        from nemo_dsa.train import main

        def die():
            os.kill(os.getpid(), signal.SIGKILL)

        if {kill_when!r} == "mid-save":  # the weights are written, the state file and manifest are not
            real = state.write_state_file
            state.write_state_file = lambda path, obj: die() if "step_0000004" in str(path) else real(path, obj)
        elif {kill_when!r} == "mid-metrics-rewrite":  # the new metrics.jsonl is written, not yet renamed
            real = files.os.replace
            files.os.replace = lambda a, b: die() if str(b).endswith("metrics.jsonl") else real(a, b)
        sys.exit(main(sys.argv[1:]))
    """)
    cmd = [sys.executable, "-c", script, *SHORT, f"run_dir={run_dir}", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_kill_mid_checkpoint_save_loses_nothing(tmp_path, reference):
    proc = _killed_run(tmp_path, "mid-save")
    assert proc.returncode == -9, proc.stderr[-2000:]
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".tmp-step_0000004", "step_0000002"]
    resumed = _run(tmp_path)
    assert resumed.resumed_from == 2 and resumed.step == 4
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_0000002", "step_0000004"]  # the leftover is gone
    assert _losses(tmp_path) == reference


@pytest.mark.slow
def test_a_kill_while_metrics_are_rewritten_on_resume_loses_nothing(tmp_path, reference):
    _run(tmp_path, "recipe.stop_at_step=2")
    before = read_metrics(tmp_path / "metrics.jsonl")
    proc = _killed_run(tmp_path, "mid-metrics-rewrite")
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert read_metrics(tmp_path / "metrics.jsonl") == before  # the old file, whole
    _run(tmp_path)
    assert _losses(tmp_path) == reference
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_metrics_are_appended_and_a_torn_last_line_is_dropped_on_resume(tmp_path, reference):
    _run(tmp_path, "recipe.stop_at_step=2")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.2')  # a kill mid-append
    _run(tmp_path)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert _losses(tmp_path) == reference
    assert all("time" in r and r["elapsed_s"] >= 0 for r in records)
    assert [r["event"] for r in records if "event" in r] == ["start", "data", "first_step", "resume", "data"]


def test_a_second_run_on_a_locked_run_dir_stops_naming_the_holder(tmp_path):
    with RunDirLock(tmp_path):
        with pytest.raises(RunDirLocked, match=f"in use by pid {os.getpid()} on host"):
            _run(tmp_path)
        proc = subprocess.run([sys.executable, "-m", "nemo_dsa.train", *SHORT, f"run_dir={tmp_path}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and f"in use by pid {os.getpid()}" in proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "checkpoints").exists()
    assert _run(tmp_path, "recipe.max_steps=1").step == 1  # released: the next run proceeds


@pytest.mark.parametrize("damage", ["truncate", "flip-bit", "no-manifest"])
def test_a_corrupt_newest_checkpoint_is_named_and_the_previous_one_is_used(tmp_path, reference, damage):
    _run(tmp_path)
    newest = tmp_path / "checkpoints" / "step_0000004"
    if damage == "truncate":
        weights = newest / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "flip-bit":
        state = newest / "trainer_state.pt"
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0x10
        state.write_bytes(bytes(data))
    else:
        (newest / "manifest.json").unlink()
    with pytest.raises(CorruptCheckpoint, match=str(newest)):
        _run(tmp_path, f"resume={newest}")  # a checkpoint named explicitly is not replaced silently
    result = _run(tmp_path)
    assert result.resumed_from == 2 and result.step == 4
    fallback = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "checkpoint_fallback"]
    assert len(fallback) == 1 and str(newest) in fallback[0]["reason"]
    assert (tmp_path / "checkpoints" / "corrupt-step_0000004").is_dir()
    assert _losses(tmp_path) == reference


class _NanGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss whose gradients are not finite."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


@pytest.fixture
def nan_gradients_at():
    """Make the embedding's gradient NaN in the training forwards numbered in ``steps`` (1-based)."""
    calls = {"n": 0}
    steps: set[int] = set()

    def hook(module, args, output):
        if isinstance(module, torch.nn.Embedding) and module.training and torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] in steps:
                return _NanGradient.apply(output)
        return None

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    yield steps
    handle.remove()


def test_a_step_with_non_finite_gradients_is_skipped(tmp_path, nan_gradients_at):
    nan_gradients_at.add(3)
    result = _run(tmp_path, "recipe.ckpt_every=1", "recipe.keep_checkpoints=5")
    assert result.step == 4 and result.skipped_steps == 1
    skipped = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "skipped"]
    assert [r["step"] for r in skipped] == [3] and skipped[0]["step_grad_norm"] == "nan"
    w2, w3, w4 = (_weights(tmp_path, s) for s in (2, 3, 4))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)  # step 3 changed nothing
    assert not all(torch.equal(w3[k], w4[k]) for k in w3)  # step 4 trained again
    assert all(torch.isfinite(w).all() for w in w4.values())
    assert set(_losses(tmp_path)) == {1, 2, 4}
    assert json.loads((tmp_path / "summary.json").read_text())["skipped_steps"] == 1


def test_too_many_skipped_steps_stop_the_run(tmp_path, nan_gradients_at):
    nan_gradients_at.update({2, 3})
    with pytest.raises(FloatingPointError, match=r"recipe.max_skipped_steps=1"):
        _run(tmp_path, "recipe.max_skipped_steps=1")
    ckpt = tmp_path / "checkpoints" / "step_0000002"
    assert all(torch.isfinite(w).all() for w in _weights(tmp_path, 2).values()) and ckpt.is_dir()


def test_resume_applies_the_new_lr_and_refuses_a_new_data_layout(tmp_path):
    _run(tmp_path, "recipe.stop_at_step=2", "recipe.log_every=1")
    with pytest.raises(ValueError, match=r"changed corpus_sha256, seq_len, val_percent \(corpus_sha256: '\w{12}\.\.\.' -> "):
        _run(tmp_path, "recipe.seq_len=64", "recipe.val_percent=10")
    with pytest.raises(ValueError, match=r"changed seed"):
        _run(tmp_path, "seed=7")
    _run(tmp_path, "recipe.lr=1e-3", "recipe.log_every=1", "recipe.betas=[0.8,0.9]")
    records = read_metrics(tmp_path / "metrics.jsonl")
    change = next(r for r in records if r.get("event") == "recipe_change")
    assert change["changed"] == {"lr": [3e-3, 1e-3], "betas": [[0.9, 0.95], [0.8, 0.9]]}
    lr = {r["step"]: r["lr"] for r in records if "lr" in r}
    schedule = [warmup_cosine(s, warmup_steps=2, max_steps=4, min_lr_ratio=0.1) for s in range(4)]
    assert [lr[s] for s in (1, 2, 3, 4)] == [3e-3 * schedule[0], 3e-3 * schedule[1], 1e-3 * schedule[2],
                                              1e-3 * schedule[3]]
    state = torch.load(tmp_path / "checkpoints" / "step_0000004" / "trainer_state.pt", weights_only=False)
    assert state["recipe"]["lr"] == 1e-3 and state["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9)


@pytest.mark.slow
def test_a_stopped_rank_stops_the_run_after_dist_timeout_s_naming_it(tmp_path):
    """2 CP ranks on gloo; rank 1 gets a real SIGSTOP in step 2: rank 0 stops after
    recipe.dist_timeout_s (not gloo's 600 s) with a message naming rank 1.

    Rank 1 announces its pid at step 2 and pauses 3 s (shorter than the 6 s timeout), in which
    the test stops it: without the SIGSTOP it would go on and the run would finish."""
    import signal
    import time

    script = tmp_path / "stall.py"
    pid_file = tmp_path / "rank1.pid"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        import nemo_dsa.recipe.loop as loop
        from nemo_dsa.train import main

        real, calls = loop.train_step, {{"n": 0}}
        def train_step(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2 and os.environ["RANK"] == "1":
                with open({str(pid_file)!r} + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.rename({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
                time.sleep(3)  # the test sends SIGSTOP meanwhile
            return real(*args, **kwargs)
        loop.train_step = train_step
        sys.exit(main(sys.argv[1:]))
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           *SHORT, "recipe.cp_size=2", "recipe.dist_timeout_s=6", f"run_dir={tmp_path / 'run'}"]
    message = "rank 0: a collective in step 2 did not complete within recipe.dist_timeout_s=6.0s"
    stderr_path = tmp_path / "stderr.txt"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                start_new_session=True)
    rank1 = None
    try:
        deadline = time.monotonic() + 150
        while not pid_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, stderr_path.read_text()[-3000:]
            time.sleep(0.05)
        rank1 = int(pid_file.read_text())
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while Path(f"/proc/{rank1}/stat").read_text().rsplit(")", 1)[-1].split()[0] not in ("T", "t"):
            assert time.monotonic() - stopped_at < 2, "rank 1 did not stop"  # delivery is asynchronous
            time.sleep(0.01)
        while message not in stderr_path.read_text():
            assert time.monotonic() - stopped_at < 60, stderr_path.read_text()[-3000:]
            time.sleep(0.1)
        waited = time.monotonic() - stopped_at
        assert 6 - 3 <= waited < 6 + 30  # the timeout, then the 5 s wait for other ranks' reports
        assert "rank(s) [1] reported no timeout of their own" in stderr_path.read_text()
    finally:
        if rank1 is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(rank1, sig)
                except ProcessLookupError:
                    pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0


def test_a_failed_save_leaves_nothing_behind_and_the_rerun_continues(tmp_path, reference, monkeypatch):
    """A disk-full error while saving step 4: the error surfaces, no ``.tmp-step*`` remains, and a
    rerun resumes from step 2 and reproduces the uninterrupted losses."""
    import errno

    import nemo_dsa.recipe.state as state

    real = state.write_state_file

    def full_disk(path, obj):
        if "step_0000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(state, "write_state_file", full_disk)
    with pytest.raises(RanksStopped, match="saving the checkpoint of step 4 failed .OSError: .Errno 28. No space left") as err:
        _run(tmp_path)
    assert isinstance(err.value.__cause__, OSError)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000002"]
    monkeypatch.setattr(state, "write_state_file", real)
    assert _run(tmp_path).resumed_from == 2
    assert _losses(tmp_path) == reference


def test_resume_refuses_a_changed_corpus(tmp_path, monkeypatch):
    """The corpus comes from the running interpreter's docstrings: a different one (another Python,
    a patched standard library) would silently change the data stream, so resume refuses it."""
    import nemo_dsa.data as data

    _run(tmp_path, "recipe.stop_at_step=2")
    real = data.stdlib_documents
    monkeypatch.setattr(data, "stdlib_documents", lambda *a, **k: real(*a, **k)[1:])
    with pytest.raises(ValueError, match="changed corpus_sha256"):
        _run(tmp_path)


def test_no_intact_checkpoint_is_an_error_not_a_silent_restart(tmp_path):
    _run(tmp_path, "recipe.max_steps=2")
    (tmp_path / "checkpoints" / "step_0000002" / "manifest.json").write_text("{}")
    with pytest.raises(CorruptCheckpoint, match="no intact checkpoint"):
        _run(tmp_path, "recipe.max_steps=2")
    assert _losses(tmp_path)  # the metrics of the first run are still there
    assert _run(tmp_path, "recipe.max_steps=2").resumed_from is None  # rerun: starts over, as the message says


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    from nemo_dsa.recipe.state import save_checkpoint

    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[1, 2] = float("inf")
    with pytest.raises(FloatingPointError, match="non-finite weights"):
        save_checkpoint(tmp_path, 7, model, None, None, None, {}, keep=2)
    assert not (tmp_path / "checkpoints").exists()


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path, reference, capsys):
    """resume=<step 2> of a run that reached step 4: step 4 is renamed abandoned-step_*, so the
    next resume=auto continues the new run (step 3), not the abandoned one; nothing is deleted."""
    _run(tmp_path)
    ckpts = tmp_path / "checkpoints"
    abandoned_weights = _weights(tmp_path, 4)
    capsys.readouterr()
    resumed = _run(tmp_path, f"resume={ckpts / 'step_0000002'}", "recipe.stop_at_step=3")
    assert resumed.resumed_from == 2 and resumed.step == 3
    assert "set aside step_0000004 as " in capsys.readouterr().err
    assert sorted(p.name for p in ckpts.iterdir()) == ["abandoned-step_0000004", "step_0000002", "step_0000003"]
    again = _run(tmp_path)
    assert again.resumed_from == 3 and again.step == 4
    assert _losses(tmp_path) == reference
    kept = load_file(str(ckpts / "abandoned-step_0000004" / "model.safetensors"))
    assert all(torch.equal(kept[k], abandoned_weights[k]) for k in kept)  # never pruned
    events = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "checkpoint_abandoned"]
    assert len(events) == 1 and events[0]["path"].endswith("abandoned-step_0000004")


@pytest.mark.parametrize("kill_when", ["between-renames", "before-delete"])
def test_a_kill_while_a_step_is_saved_again_leaves_an_intact_checkpoint(tmp_path, kill_when):
    """Saving an existing step renames the old copy aside, renames the new one in, then deletes the
    old: a SIGKILL between the renames or before the delete leaves one intact step_* (the old
    copy renamed back, or the new one) once the next run has cleaned up."""
    from nemo_dsa.recipe.state import clean_failed_saves, verify_checkpoint

    script = textwrap.dedent(f"""
        import os, shutil, signal, torch
        import nemo_dsa.recipe.state as state

        class Stream:
            def state_dict(self):
                return {{"epoch": 0, "cursor": 0, "offset": 0, "seed": 0}}

        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        state.save_checkpoint({str(tmp_path)!r}, 4, model, opt, sched, Stream(), {{}}, keep=2)
        with torch.no_grad():
            model.weight.fill_(7.0)

        def die():
            os.kill(os.getpid(), signal.SIGKILL)

        if {kill_when!r} == "between-renames":  # the old copy is aside, the new one not yet in
            real = os.rename
            os.rename = lambda a, b: die() if ".tmp-step_" in str(a) else real(a, b)
        else:  # the new copy is in, the old one not yet deleted
            real = shutil.rmtree
            shutil.rmtree = lambda p, *a, **k: die() if ".replaced-" in str(p) else real(p, *a, **k)
        state.save_checkpoint({str(tmp_path)!r}, 4, model, opt, sched, Stream(), {{}}, keep=2)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    ckpts = tmp_path / "checkpoints"
    left = sorted(p.name for p in ckpts.iterdir())
    if kill_when == "between-renames":
        assert left == [".replaced-step_0000004", ".tmp-step_0000004"]
    else:
        assert left == [".replaced-step_0000004", "step_0000004"]
    removed, restored = clean_failed_saves(tmp_path)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_0000004"]
    assert [p.name for p in restored] == (["step_0000004"] if kill_when == "between-renames" else [])
    verify_checkpoint(ckpts / "step_0000004")
    weight = load_file(str(ckpts / "step_0000004" / "model.safetensors"))["weight"]
    assert bool((weight == 7.0).all()) == (kill_when == "before-delete")  # the new copy only once it is in
