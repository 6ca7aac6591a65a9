"""The test suite and a recipe run write into temporary folders only: nothing into the checkout
(``runs/``, ``.hypothesis/``) and no folder left behind in the temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nemo_dsa.evaluate import main as evaluate_main
from nemo_dsa.export import main as export_main
from nemo_dsa.train import main as train_main

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=1", "recipe.ckpt_every=1",
         "recipe.val_every=1", "recipe.val_batches=1", "recipe.warmup_steps=0", "recipe.num_threads=1",
         "recipe.plot=false"]


def _checkout_state() -> set[str]:
    """Every changed, untracked or ignored path git sees, bytecode caches aside."""
    out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if "__pycache__" not in line and ".pytest_cache" not in line}


def test_the_session_keeps_its_caches_in_one_temporary_folder_and_removes_it(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TILELANG_CACHE_DIR", "HYPOTHESIS_STORAGE_DIRECTORY")}
    code = ("import os, conftest\n"
            "from hypothesis.configuration import storage_directory\n"
            "print(os.environ['TILELANG_CACHE_DIR']); print(storage_directory('examples').path)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**env, "TMPDIR": str(tmp), "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    tilelang, hypothesis = (Path(line) for line in proc.stdout.split())
    assert tilelang.is_relative_to(tmp) and hypothesis.is_relative_to(tmp)  # not ~/.tilelang, not ./.hypothesis
    assert list(tmp.iterdir()) == []  # removed when the process ended


def test_a_recipe_run_leaves_the_checkout_as_it_was(tmp_path, capsys):
    before = _checkout_state()
    assert train_main([*SHORT, f"run_dir={tmp_path / 'run'}"]) == 0
    assert evaluate_main([f"run_dir={tmp_path / 'run'}"]) == 0
    assert export_main([f"run_dir={tmp_path / 'run'}", f"out={tmp_path / 'hf'}"]) == 0
    assert train_main([*SHORT, f"run_dir={tmp_path / 'failed'}", "model.config.index_topk=0"]) == 2
    assert _checkout_state() == before
