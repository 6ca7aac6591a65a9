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


def _train_ft_v41_pipeline(tmp_path, nproc: int, *overrides: str) -> tuple[str, list[float]]:
    """examples/automodel/deepseek_v41_plugin_tiny_pp.yaml through train_ft_cpu.py on ``nproc`` gloo
    processes for three steps and a validation pass: the log and the training losses."""
    import json
    import math

    before = _run_outputs_in_checkout()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(EXAMPLES / "train_ft_cpu.py"), "--config", str(EXAMPLES / "deepseek_v41_plugin_tiny_pp.yaml"),
           "--step_scheduler.max_steps", "3", "--step_scheduler.val_every_steps", "3",
           "--checkpoint.checkpoint_dir", str(tmp_path / "run"), "--dataset.max_examples", "64",
           "--validation_dataset.max_examples", "8", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "| step 2 | epoch 0 | loss" in log and "[val]" in log
    records = [json.loads(line) for line in (tmp_path / "run" / "training.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == [0, 1, 2] and all(math.isfinite(x) and x > 0 for x in losses)
    assert _run_outputs_in_checkout() == before
    return log, losses


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-ins apply only without CUDA")
def test_train_ft_cpu_runs_the_v41_plugin_in_two_pipeline_stages(tmp_path):
    """examples/automodel/deepseek_v41_plugin_tiny_pp.yaml: nemo-automodel's train_ft with
    ``distributed.pp_size: 2`` on two processes, the V4.1 plugin (every layer role, Engram on both
    stages) cut before layer 3 (docs/design.md, "DeepSeek-V4.1 pipeline stages"), packed batches."""
    log, losses = _train_ft_v41_pipeline(tmp_path, 2)
    # nemo-automodel's own split (3 / 3 layers) is a clean cut: stage 1 starts at Engram layer 3
    # (rank 0 logs its stage only).
    (stage0,) = [line for line in log.splitlines() if "PP Rank 0: Stage 0: Keeping modules:" in line]
    assert "['model.layers.0', 'model.layers.1', 'model.layers.2', " in stage0 and "model.layers.3" not in stage0
    assert losses[-1] < losses[0], losses  # measured 5.57, 5.36, 5.14


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-ins apply only without CUDA")
def test_train_ft_cpu_runs_v41_stages_with_data_and_expert_parallel_ranks(tmp_path):
    """The same config on four processes: 2 stages x 2 data-parallel ranks with expert parallelism
    (nemo-automodel's MoE parallelizer and FSDP2), so each stage's Engram table becomes a row-sharded
    DTensor of the two ranks holding that stage."""
    parallel = ("--distributed.dp_size", "2", "--distributed.ep_size", "2", "--step_scheduler.global_batch_size", "8")
    log, losses = _train_ft_v41_pipeline(tmp_path, 4, *parallel)
    assert "the Engram tables of layers [0] are row-sharded DTensors of ranks (0, 1)" in log


def test_the_example_configs_keep_checkpoints_outside_the_checkout():
    from omegaconf import OmegaConf

    for path in EXAMPLES.glob("*.yaml"):
        checkpoint = OmegaConf.load(path).get("checkpoint")
        if checkpoint is not None:
            assert Path(checkpoint.checkpoint_dir).is_absolute(), path
