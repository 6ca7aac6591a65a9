"""A context-parallel rank whose process is killed: the survivor stops with one line naming it.

Two ranks on gloo (``recipe.cp_size=2``), launched as torchrun would (its environment, one
process per rank, each in its own session) so that no launcher kills the survivor for it. Rank 1
SIGKILLs itself at the start of step 2; rank 0's next collective then loses its connection
("Connection reset by peer" from gloo), long before ``recipe.dist_timeout_s``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from _support.short_recipe_run import ROOT, SHORT

DEADLINE_S = 120
ERROR = "nemo-dsa-train: error: "

CHILD = textwrap.dedent("""
    import os, signal, sys
    import nemo_dsa.recipe.loop as loop
    from nemo_dsa.train import main

    if os.environ["RANK"] == os.environ["KILLED_RANK"]:
        real, calls = loop.train_step, []
        def killed_in_step_2(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        loop.train_step = killed_in_step_2
    sys.exit(main(sys.argv[1:]))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_cp_rank_is_named_on_one_line_by_the_survivor(tmp_path, killed):
    script = tmp_path / "rank.py"
    script.write_text(CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "KILLED_RANK": str(killed),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # this checkout's code
    # A timeout far past the test's: the survivor must stop on the lost connection, not on it.
    cmd = [sys.executable, str(script), *SHORT, "recipe.cp_size=2", "recipe.dist_timeout_s=600",
           f"run_dir={tmp_path / 'run'}"]
    procs = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
    try:
        deadline = time.monotonic() + DEADLINE_S
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, (tmp_path / f"rank{1 - killed}.err").read_text()[-3000:]
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    survivor = 1 - killed
    text = (tmp_path / f"rank{survivor}.err").read_text()
    assert procs[killed].returncode == -signal.SIGKILL
    assert procs[survivor].returncode == 1 and "Traceback" not in text, text[-3000:]
    (line,) = [line for line in text.splitlines() if line.startswith(ERROR)]
    assert line.startswith(f"{ERROR}rank {survivor}: lost the connection to another rank in step 2; rank(s) [{killed}] "
                           "did not report it: their process died or was killed."), line
    assert "Any checkpoint saved before is intact" in line, line
