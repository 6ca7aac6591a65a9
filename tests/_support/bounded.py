"""Run Python code in a child process under a time limit and report its peak memory.

A command refusing a crafted folder must end within seconds and stay under 1 GiB of CPU memory;
without the checks it hangs (a FIFO, ``/dev/zero``) or allocates what a config asks for. Run in a
child, a hang is killed at ``timeout`` and an allocation is capped by ``RLIMIT_AS`` (so a broken
check fails its test instead of stalling or exhausting the machine), and the child reports its own
peak resident memory (``PRINT_PEAK``).
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMORY_LIMIT = 1 << 30  # what a refused case may use, resident
ADDRESS_LIMIT = 4 << 30  # the child's address space (torch and nemo-automodel map under 1 GiB): a runaway allocation fails fast


@dataclass
class Outcome:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float
    peak_bytes: int

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


# The child's own peak resident memory, printed as its last stdout line. Not ru_maxrss: the child is
# forked from the test process before it execs, and Linux carries the forked image's resident size
# (the whole test process, over 1 GiB late in a full run) into ru_maxrss; VmHWM is the exec'd
# program's alone.
PRINT_PEAK = (
    "print('peak_kib=%s' % next(line.split()[1] for line in open('/proc/self/status') "
    "if line.startswith('VmHWM:')), flush=True)\n"
)


def run_python(code: str, *, timeout: float = 60.0, cwd: str | os.PathLike | None = None) -> Outcome:
    """Run ``code`` with this checkout's ``nemo_dsa`` first on the path; kill it after ``timeout``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_LIMIT, ADDRESS_LIMIT))

    start = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=limit)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, stderr = child.communicate()
        child.returncode = None
    # communicate() reaped the child: its rusage is in RUSAGE_CHILDREN only as a running maximum,
    # so the child reports its own peak on its last stdout line when it gets there.
    seconds = time.monotonic() - start
    peak = 0
    lines = stdout.strip().splitlines()
    if lines and lines[-1].startswith("peak_kib="):
        peak = int(lines[-1].split("=", 1)[1]) * 1024
        stdout = "\n".join(lines[:-1])
    return Outcome(child.returncode, stdout, stderr, seconds, peak)


def run_command(module: str, args: list[str], *, timeout: float = 60.0, cwd=None) -> Outcome:
    """``python -m <module> args`` (an entry point's ``main``), its exit code and peak memory."""
    code = (f"import sys\nfrom {module} import main\n"
            f"try:\n    code = main({args!r})\nexcept SystemExit as e:\n    code = e.code\n"
            + PRINT_PEAK + "sys.exit(code)\n")
    return run_python(code, timeout=timeout, cwd=cwd)


def assert_refused_on_one_line(outcome: Outcome, *needles: str, code: int = 2, after_imports: bool = False) -> str:
    """The command ended in time with ``code``, one line on stderr holding every needle, no
    traceback, and peak memory under ``MEMORY_LIMIT``; returns the line. ``after_imports``: the
    refusal is the last line, after what nemo-automodel's imports print (torchao, deprecations)."""
    assert outcome.returncode is not None, f"killed after {outcome.seconds:.0f} s (hung): {outcome.stderr[-500:]}"
    lines = [line for line in outcome.error_lines if not line.startswith(("W1", "I1"))]  # torch's own log lines
    lines = lines[-1:] if after_imports else lines
    assert outcome.returncode == code and len(lines) == 1, (outcome.returncode, outcome.stderr[-2000:])
    assert "Traceback" not in outcome.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert 0 < outcome.peak_bytes < MEMORY_LIMIT, outcome.peak_bytes
    return lines[0]
