"""Data parallelism in the recipe: FSDP2 over torchrun ranks on gloo (CPU), alone and with CP.

Every case trains the same global batch as one process; the losses, gradient norms, validation
losses and final weights agree within fp32 reduction-order noise, and checkpoints resume on
another number of ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nemo_dsa.train import load_config, main, read_metrics, train

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=4", "recipe.ckpt_every=2",
         "recipe.val_every=2", "recipe.warmup_steps=1", "recipe.plot=false"]


def _records(run_dir: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        if "event" not in r:
            out.setdefault(r["step"], {}).update({k: r[k] for k in ("loss", "grad_norm", "val_loss") if k in r})
    return out


def _torchrun(nproc: int, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "nemo_dsa.train", *SHORT, f"run_dir={run_dir}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("run_dir=") == 1  # one final line, from rank 0
    return proc


def _assert_close(records: dict[int, dict], reference: dict[int, dict]) -> None:
    assert records.keys() == reference.keys() and set(reference) == {1, 2, 3, 4}
    for step, ref in reference.items():
        assert records[step].keys() == ref.keys()
        for key, value in ref.items():
            assert records[step][key] == pytest.approx(value, rel=2e-5), (step, key)


# Adam divides each gradient by its own running RMS, so an entry whose gradient is tiny turns
# reduction-order noise into a visible step: the weights agree to 1e-4, against a largest possible
# movement of lr x steps = 1.2e-2 (measured: 2.1e-5 for DP2; 7.3e-5 before gradients FSDP2 invents
# for unreached parameters were dropped, when weight decay moved those).
WEIGHT_ATOL = 1e-4


def _weights(run_dir: Path, step: int = 4) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:07d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("single")
    train(load_config([*SHORT, "recipe.num_threads=1", f"run_dir={run_dir}"]))
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("dp,cp", [(2, 1), (2, 2)])
def test_data_parallel_equals_one_process_with_the_same_global_batch(tmp_path, single, dp, cp):
    _torchrun(dp * cp, tmp_path, f"recipe.dp_size={dp}", f"recipe.cp_size={cp}")
    _assert_close(_records(tmp_path), _records(single))
    start = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert (start["dp_size"], start["cp_size"]) == (dp, cp)
    ref, got = _weights(single), _weights(tmp_path)
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=WEIGHT_ATOL, msg=k)
    # The optimizer state is saved in one process's format (integer ids), with the same entries.
    saved = [torch.load(d / "checkpoints" / "step_0000004" / "trainer_state.pt", weights_only=False)["optimizer"]
             for d in (single, tmp_path)]
    assert [g["params"] for g in saved[0]["param_groups"]] == [g["params"] for g in saved[1]["param_groups"]]
    assert saved[0]["state"].keys() == saved[1]["state"].keys()
    for i, entry in saved[0]["state"].items():
        assert float(entry["step"]) == float(saved[1]["state"][i]["step"]) == 4
        got, ref = saved[1]["state"][i]["exp_avg_sq"], entry["exp_avg_sq"]
        # Held per tensor, in the units Adam divides by (its square root): a gradient element that
        # is a cancelling sum can move by 1e-3 of itself when DP x CP add it in another order (seen:
        # one element of 16,384 at 2.7e-3 relative on an AVX-512 Xeon).
        assert float((got - ref).norm() / ref.norm()) <= 1e-4, i
        torch.testing.assert_close(got.sqrt(), ref.sqrt(), rtol=1e-3, atol=1e-3 * float(ref.sqrt().max()))


@pytest.mark.slow
def test_checkpoints_resume_on_another_number_of_ranks(tmp_path, single):
    """DP=2 stops at step 2 and one process finishes; one process stops at 2 and DP=2 finishes."""
    a, b = tmp_path / "dp-then-single", tmp_path / "single-then-dp"
    _torchrun(2, a, "recipe.dp_size=2", "recipe.stop_at_step=2")
    resumed = train(load_config([*SHORT, "recipe.num_threads=1", f"run_dir={a}"]))
    assert resumed.resumed_from == 2 and resumed.step == 4
    train(load_config([*SHORT, "recipe.num_threads=1", f"run_dir={b}", "recipe.stop_at_step=2"]))
    proc = _torchrun(2, b, "recipe.dp_size=2")
    assert "resuming from step 2" in proc.stderr
    for run_dir in (a, b):
        _assert_close(_records(run_dir), _records(single))
        changes = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("event") == "recipe_change"]
        assert len(changes) == 1 and "dp_size" in changes[0]["changed"]  # (num_threads too: torchrun sets none)
        ref, got = _weights(single), _weights(run_dir)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=WEIGHT_ATOL, msg=k)


@pytest.mark.parametrize("extra,expected", [
    (["recipe.dp_size=2"], "recipe.dp_size=2 needs a torchrun launch: torchrun --nproc-per-node=2"),
    (["recipe.dp_size=2", "recipe.cp_size=2"], "recipe.dp_size=2 recipe.cp_size=2 needs a torchrun launch: "
                                               "torchrun --nproc-per-node=4"),
    (["recipe.dp_size=2", "recipe.batch_size=3"], "recipe.batch_size=3 must be a multiple of recipe.dp_size=2"),
    (["recipe.dp_size=0"], "recipe.dp_size must be an int >= 1, got 0"),
])
def test_data_parallel_mistakes_are_one_line(tmp_path, capsys, extra, expected):
    assert main([*SHORT, f"run_dir={tmp_path}", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
