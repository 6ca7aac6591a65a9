"""Multi-rank saves that fail: every rank stops together with one readable error, none hangs.

Two ranks on gloo (FSDP2, ``recipe.dp_size=2``), launched as torchrun would (its environment,
one process per rank) so each rank's exit code and stderr are its own and no launcher kills the
survivor for it: a rank that stops here stops by itself. Every child has a deadline.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from _support.short_recipe_run import ROOT, SHORT

CHILD_DEADLINE_S = 120  # far past any expected exit: a hung rank fails the test instead of blocking it
ERROR = "nemo-dsa-train: error: "

# Runs the recipe's command line in one rank; ``STALL_RANK`` / ``STALL_IN`` (a name in
# nemo_dsa.recipe.loop) make that rank announce its pid in ``PID_FILE`` and pause 3 s before the
# call, in which the test stops it with a real SIGSTOP; ``FAIL_RANK`` / ``FAIL_IN`` make that
# rank's call raise an OSError instead.
CHILD = textwrap.dedent("""
    import os, sys, time
    import nemo_dsa.recipe.loop as loop
    from nemo_dsa.train import main

    if os.environ.get("STALL_RANK") == os.environ["RANK"]:
        name, pid_file = os.environ["STALL_IN"], os.environ["PID_FILE"]
        real = getattr(loop, name)
        def stall_first_call(*args, **kwargs):
            if not os.path.exists(pid_file):
                with open(pid_file + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.rename(pid_file + ".tmp", pid_file)
                time.sleep(3)  # the test sends SIGSTOP meanwhile
            return real(*args, **kwargs)
        setattr(loop, name, stall_first_call)
    if os.environ.get("FAIL_RANK") == os.environ["RANK"]:  # FAIL_IN raises a real OSError on that rank
        import errno
        def fail(*args, **kwargs):
            raise OSError(errno.EIO, "Input/output error (injected)")
        setattr(loop, os.environ["FAIL_IN"], fail)
    sys.exit(main(sys.argv[1:]))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, *extra: str, env_extra: dict[str, str] | None = None,
            layout: str = "recipe.dp_size=2") -> list[subprocess.Popen]:
    """Both ranks of ``layout``, stderr in ``rank<r>.err``, each in its own session."""
    script = tmp_path / "rank.py"
    script.write_text(CHILD)
    base = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", **(env_extra or {})}
    cmd = [sys.executable, str(script), *SHORT, layout, f"run_dir={tmp_path / 'run'}", *extra]
    procs = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
    return procs


def _reap(procs: list[subprocess.Popen]) -> None:
    """Kill (their whole sessions) the ranks still running; a stopped one is continued first."""
    for proc in procs:
        if proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        proc.wait()


def _stderr(tmp_path: Path, rank: int) -> str:
    return (tmp_path / f"rank{rank}.err").read_text()


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(ERROR)]


@pytest.fixture
def unwritable_checkpoints(request, tmp_path) -> Iterator[str]:
    """``run/checkpoints`` such that rank 0's save fails with a real OSError (only rank 0 writes it)."""
    root = tmp_path / "run" / "checkpoints"
    root.parent.mkdir()
    if request.param == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory; the not-a-directory case covers root")
        root.mkdir()
        root.chmod(0o555)
        yield "PermissionError: [Errno 13] Permission denied"
        root.chmod(0o755)
    else:  # a file where the directory belongs: mkdir beneath it fails, for root too
        root.write_text("not a directory\n")
        yield "NotADirectoryError: [Errno 20] Not a directory"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["recipe.dp_size=2", "recipe.cp_size=2"])  # FSDP2 gathers first; CP does not
@pytest.mark.parametrize("unwritable_checkpoints", ["read-only", "not-a-directory"], indirect=True)
def test_a_failed_save_on_rank_0_stops_every_rank_naming_it(tmp_path, unwritable_checkpoints, layout):
    """Rank 0 raises its own error; rank 1 stops at once (not at its next collective, not after
    recipe.dist_timeout_s=120) with one line naming rank 0's failure."""
    cause = unwritable_checkpoints
    procs = _launch(tmp_path, "recipe.dist_timeout_s=120", layout=layout)
    try:
        deadline = time.monotonic() + CHILD_DEADLINE_S
        while all(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, _stderr(tmp_path, 0)[-3000:]
            time.sleep(0.05)
        first_exit = time.monotonic()
        while any(p.poll() is None for p in procs):
            assert time.monotonic() - first_exit < 10, "one rank went on after the other stopped"
            time.sleep(0.05)
    finally:
        _reap(procs)
    rank0, rank1 = _stderr(tmp_path, 0), _stderr(tmp_path, 1)
    assert procs[0].returncode == 1 and "Traceback" not in rank0, rank0[-3000:]
    (line,) = _error_lines(rank0)  # its own error, as one line
    assert line.startswith(f"{ERROR}rank 0: saving the checkpoint of step 2 failed ({cause}"), line
    assert procs[1].returncode == 1, rank1[-3000:]
    assert "Traceback" not in rank1, rank1[-3000:]
    (line,) = _error_lines(rank1)
    assert line.startswith(f"{ERROR}rank 1: rank 0 failed while saving the checkpoint of step 2 ({cause}"), line
    assert "every rank stops" in line
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("stopped,stall_in,during", [
    # rank 0 times out in the FSDP2 gather of the full state
    (1, "gather_full_state", "saving the checkpoint of step 2"),
    # rank 1 times out waiting for rank 0's save (the outcome broadcast)
    (0, "save_checkpoint", "saving the checkpoint of step 2"),
    # rank 1 times out at the barrier after rank 0's repairs of run_dir, and after its summary
    (0, "clean_failed_saves", "waiting for rank 0 to tidy run_dir before training"),
    (0, "_finish", "writing the run's summary after step 4"),
], ids=["gather", "save", "start", "summary"])
def test_a_rank_stopped_around_a_save_is_named_in_one_paragraph(tmp_path, stopped, stall_in, during):
    """A real SIGSTOP of one rank just before ``stall_in``: the live rank stops after
    recipe.dist_timeout_s=6 with the one-paragraph stalled-collective error naming what the ranks
    were doing (the save and its step) and the stopped rank."""
    live = 1 - stopped
    pid_file = tmp_path / "stopped.pid"
    procs = _launch(tmp_path, "recipe.dist_timeout_s=6",
                    env_extra={"STALL_RANK": str(stopped), "STALL_IN": stall_in, "PID_FILE": str(pid_file)})
    message = (f"{ERROR}rank {live}: a collective while {during} did not complete within "
               f"recipe.dist_timeout_s=6.0s; rank(s) [{stopped}] reported no timeout of their own")
    try:
        deadline = time.monotonic() + CHILD_DEADLINE_S
        while not pid_file.exists():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, _stderr(tmp_path, live)[-3000:]
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        assert pid == procs[stopped].pid
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] not in ("T", "t"):
            assert time.monotonic() - stopped_at < 2, "the rank did not stop"  # delivery is asynchronous
            time.sleep(0.01)
        try:
            procs[live].wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank {live} still waits 60 s after rank {stopped} stopped: "
                        + _stderr(tmp_path, live)[-3000:])
        waited = time.monotonic() - stopped_at
    finally:
        _reap(procs)
    text = _stderr(tmp_path, live)
    assert procs[live].returncode == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    (line,) = _error_lines(text)
    assert line.startswith(message), line
    assert 6 - 3 <= waited < 6 + 30, waited  # the timeout, then up to 5 s for other ranks' reports


def _shared(rank: int, world_size: int, message: str | None) -> list:
    from nemo_dsa.recipe.parallel import Parallel, share_failure

    par = Parallel(rank=rank, size=world_size)
    error = OSError(28, message) if message is not None and rank == 0 else None
    # Rank 1's own error is not rank 0's: only rank 0's counts.
    ignored = RuntimeError("rank 1's own") if rank == 1 else None
    return [share_failure(par, error or ignored), share_failure(par, None)]


@pytest.mark.slow
def test_share_failure_gives_every_rank_rank_0s_error_as_one_line():
    from _support.cp_spawn import run_on_ranks

    from nemo_dsa.recipe.parallel import FAILURE_BYTES, Parallel, share_failure

    long = "é" * FAILURE_BYTES + "\nsecond line"  # cut inside a 2-byte character, more than one line
    (ok0, none0), (ok1, none1) = run_on_ranks(_shared, 2, None)
    assert ok0 is ok1 is none0 is none1 is None
    (got0, none0), (got1, none1) = run_on_ranks(_shared, 2, "No space left on device")
    assert got0 == got1 == "OSError: [Errno 28] No space left on device" and none0 is none1 is None
    (cut0, _), (cut1, _) = run_on_ranks(_shared, 2, long)
    assert cut0 == cut1 and cut1.startswith("OSError: [Errno 28] éé") and "second" not in cut1
    assert len(cut1.encode()) <= FAILURE_BYTES - 1 and set(cut1[len("OSError: [Errno 28] "):]) == {"é"}
    # One process: no collective (no process group exists here) and nothing to share.
    assert share_failure(Parallel(), OSError("disk full")) is None


@pytest.mark.slow
@pytest.mark.parametrize("unwritable_checkpoints", ["not-a-directory"], indirect=True)
def test_a_failed_save_in_one_process_is_one_line(tmp_path, unwritable_checkpoints):
    """A single-process run whose save fails (disk, path) prints one line naming the step and the
    cause and exits 1, no traceback."""
    cmd = [sys.executable, "-m", "nemo_dsa.train", *SHORT, f"run_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=CHILD_DEADLINE_S)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = _error_lines(proc.stderr)
    assert line.startswith(f"{ERROR}rank 0: saving the checkpoint of step 2 failed ({unwritable_checkpoints}"), line
    assert line.endswith("run again to resume from the newest"), line


@pytest.mark.slow
@pytest.mark.parametrize("fail_in,during", [
    ("clean_failed_saves", "tidying run_dir before training"),
    ("atomic_write", "writing config.yaml and metrics.jsonl before training"),
    ("_finish", "writing the run's summary after step 4"),
], ids=["tidy", "config", "summary"])
def test_rank_0s_other_work_failing_stops_every_rank_naming_it(tmp_path, fail_in, during):
    """Rank 0's own work outside the saves (tidying run_dir first, then writing config.yaml and
    starting metrics.jsonl, the summary last) failing: both ranks stop at once with one line each,
    rank 1's naming rank 0's error."""
    procs = _launch(tmp_path, "recipe.dist_timeout_s=120", env_extra={"FAIL_RANK": "0", "FAIL_IN": fail_in})
    try:
        for proc in procs:
            proc.wait(timeout=CHILD_DEADLINE_S)
    finally:
        _reap(procs)
    rank0, rank1 = _stderr(tmp_path, 0), _stderr(tmp_path, 1)
    cause = "OSError: [Errno 5] Input/output error (injected)"
    assert [p.returncode for p in procs] == [1, 1] and "Traceback" not in rank0 + rank1, rank0[-2000:] + rank1[-2000:]
    assert _error_lines(rank0) == [f"{ERROR}rank 0: {during} failed ({cause}). Any checkpoint saved before is "
                                   "intact: fix the cause and run again to resume from the newest"]
    (line,) = _error_lines(rank1)
    assert line.startswith(f"{ERROR}rank 1: rank 0 failed while {during} ({cause}); every rank stops."), line


EXITING = textwrap.dedent("""
    import atexit, sys
    import nemo_dsa.recipe.parallel as parallel

    atexit.register(lambda: print("atexit ran", flush=True))
    parallel._ended_process_group = sys.argv[1] == "ended"
    parallel.exit_process(3, error=ValueError("the run's bug") if sys.argv[2] == "error" else None)
    print("returned", flush=True)
""")


@pytest.mark.parametrize("ended,error", [("ended", "none"), ("ended", "error"), ("single", "error")])
def test_a_rank_whose_process_group_ended_exits_at_once_after_its_atexit_handlers(tmp_path, ended, error):
    """``exit_process``: once the process group is destroyed the process ends with the code given
    (its error's traceback first), its atexit handlers run; a single-process run returns."""
    script = tmp_path / "exiting.py"
    script.write_text(EXITING)
    proc = subprocess.run([sys.executable, str(script), ended, error], cwd=ROOT, capture_output=True, text=True,
                          timeout=CHILD_DEADLINE_S)  # fmt: skip
    if ended == "single":
        assert (proc.returncode, proc.stdout) == (0, "returned\natexit ran\n") and proc.stderr == "", proc.stderr
        return
    assert (proc.returncode, proc.stdout) == (3, "atexit ran\n"), proc.stderr
    assert ("ValueError: the run's bug" in proc.stderr) == (error == "error"), proc.stderr
