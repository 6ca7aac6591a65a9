"""The README's nemo-automodel command on CPU: examples/automodel/train_ft_cpu.py runs the
unchanged train_ft recipe and config, and writes checkpoints outside the checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
    from nemo_automodel._transformers import auto_model  # noqa: F401 (needs torchao)
except ImportError as error:
    skip_without_automodel(error)

import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "automodel"


def _run_outputs_in_checkout() -> set[str]:
    """Paths in the checkout that look like a training run's output (others edit the tree meanwhile,
    so only these are compared)."""
    return {str(p.relative_to(REPO)) for p in REPO.rglob("*")
            if ".venv" not in p.parts and any(k in p.name for k in ("checkpoint", "epoch_", "step_", ".distcp"))
            and not p.name.endswith((".py", ".md", ".yaml", ".pyc"))}


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-ins apply only without CUDA")
def test_train_ft_cpu_runs_the_plugin_config_and_writes_outside_the_checkout(tmp_path):
    ckpt = tmp_path / "pretrained"
    subprocess.run([sys.executable, str(EXAMPLES / "write_tiny_v4_checkpoint.py"), "--output", str(ckpt)], cwd=REPO,
                   check=True, capture_output=True, timeout=300)
    before = _run_outputs_in_checkout()
    cmd = [sys.executable, str(EXAMPLES / "train_ft_cpu.py"), "--config", str(EXAMPLES / "deepseek_v4_plugin_tiny_ft.yaml"),
           "--model.pretrained_model_name_or_path", str(ckpt), "--step_scheduler.max_steps", "2",
           "--step_scheduler.val_every_steps", "2", "--step_scheduler.ckpt_every_steps", "2",
           "--checkpoint.enabled", "true", "--checkpoint.checkpoint_dir", str(tmp_path / "run"),
           "--dataset.max_examples", "32", "--validation_dataset.max_examples", "4"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = proc.stdout + proc.stderr
    assert "| step 1 | epoch 0 | loss" in log and "[val]" in log  # nemo-automodel counts steps from 0
    assert f"Saving checkpoint to {tmp_path / 'run'}" in log
    assert [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert _run_outputs_in_checkout() == before  # nothing written into the repository


def test_the_example_configs_keep_checkpoints_outside_the_checkout():
    from omegaconf import OmegaConf

    for path in EXAMPLES.glob("*.yaml"):
        checkpoint = OmegaConf.load(path).get("checkpoint")
        if checkpoint is not None:
            assert Path(checkpoint.checkpoint_dir).is_absolute(), path
