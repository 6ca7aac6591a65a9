"""The disk says no: a full disk during a save and a read-only run_dir are one line, no traceback.

Real failures, no patched writes: a small tmpfs mounted in a private user and mount namespace
(``unshare -rm``, where the kernel allows it) gives a real ENOSPC; ``RLIMIT_FSIZE`` gives a real
EFBIG (Python ignores SIGXFSZ, so the write fails instead of the process dying) anywhere; a
read-only bind mount (or, for a user other than root, a directory without write permission)
gives a real read-only run_dir.
"""

from __future__ import annotations

import os
import resource
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=2", "recipe.ckpt_every=2",
         "recipe.val_every=2", "recipe.warmup_steps=1", "recipe.num_threads=1", "recipe.plot=false"]
TRAIN = [sys.executable, "-m", "nemo_dsa.train", *SHORT]
ERROR = "nemo-dsa-train: error: "
DEADLINE_S = 300


@cache
def _namespaces() -> bool:
    """Whether this kernel lets an unprivileged process mount in its own user + mount namespace."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True, timeout=60)
    return probe.returncode == 0


def _in_namespace(setup: str, command: list[str], after: str = "") -> subprocess.CompletedProcess:
    """``command`` after the shell lines ``setup`` (mounts), then ``after``, in a private namespace."""
    script = f"set -e; {setup}; set +e; {shlex.join(command)}; code=$?; {after or 'true'}; exit $code"
    return subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=DEADLINE_S)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith(ERROR)]
    return line


# tmpfs sizes: 2 MiB holds config.yaml and metrics.jsonl but not the weights (3.6 MB); 6 MiB holds
# the weights but not them and the train state (6.8 MB) too.
@pytest.mark.slow
@pytest.mark.parametrize("size,fails", [("2m", "model.safetensors"), ("6m", "trainer_state.pt")])
def test_a_full_disk_during_a_save_is_one_line_and_leaves_nothing_behind(tmp_path, size, fails):
    if not _namespaces():
        pytest.skip("no user + mount namespaces here for a real full tmpfs (the RLIMIT_FSIZE test covers the write)")
    disk = tmp_path / "disk"
    disk.mkdir()
    listing = tmp_path / "listing"
    proc = _in_namespace(f"mount -t tmpfs -o size={size} tmpfs {disk}", [*TRAIN, f"run_dir={disk / 'run'}"],
                         after=f"ls -A {disk / 'run' / 'checkpoints'} > {listing}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _one_error_line(proc)
    assert line.startswith(f"{ERROR}rank 0: saving the checkpoint of step 2 failed (OSError: [Errno 28] No space "
                           f"left on device"), line
    assert line.endswith("run again to resume from the newest"), line
    assert listing.read_text() == "", "a failed save leaves no .tmp-step_* behind"


@pytest.mark.slow
def test_a_file_size_limit_during_a_save_is_one_line(tmp_path):
    """A real EFBIG from the kernel (``RLIMIT_FSIZE``): the save's write fails, the run says so on one line."""
    limit = 1 << 20  # config.yaml and metrics.jsonl fit; the weights do not

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([*TRAIN, f"run_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=DEADLINE_S, preexec_fn=limited)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _one_error_line(proc)
    assert line.startswith(f"{ERROR}rank 0: saving the checkpoint of step 2 failed (OSError: [Errno 27] File too "
                           "large"), line
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("existing", [False, True])  # a new run_dir, or one whose earlier run left its .lock
def test_a_read_only_run_dir_is_one_line_exit_2(tmp_path, existing):
    parent = tmp_path / "ro"
    run_dir = parent / "run"
    parent.mkdir()
    if existing:
        run_dir.mkdir()
        (run_dir / ".lock").write_text("{}\n")
    if _namespaces():
        proc = _in_namespace(f"mount --bind {parent} {parent}; mount -o remount,bind,ro {parent}",
                             [*TRAIN, f"run_dir={run_dir}"])
        reason = "Read-only file system"
    elif os.geteuid() != 0:
        for path in (run_dir, parent) if existing else (parent,):
            path.chmod(0o555)
        proc = subprocess.run([*TRAIN, f"run_dir={run_dir}"], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=DEADLINE_S)
        for path in (parent, run_dir) if existing else (parent,):
            path.chmod(0o755)
        reason = "Permission denied"
    else:
        pytest.skip("root writes through permissions and this kernel allows no private read-only mount")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_error_line(proc)
    assert line.startswith(f"{ERROR}run_dir {run_dir} cannot be written ({reason}: "), line
    assert line.endswith("pick a writable run_dir"), line
