"""The command line as a user meets it: one-line errors (exit 2), Hydra's flags, sweeps, the
messages of a run, and bitwise-repeatable runs."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_dsa.train import main, read_metrics

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=2", "recipe.ckpt_every=2",
         "recipe.val_every=2", "recipe.warmup_steps=1", "recipe.num_threads=1", "recipe.plot=false"]


@pytest.mark.parametrize(
    "mistake,expected",
    [
        ("recipe.max_stepz=5", "recipe.max_stepz: no such key in recipe (did you mean max_steps?)"),
        ("+recipe.max_stepz=5", "recipe.max_stepz: no such key in recipe (did you mean max_steps?)"),
        ("model=tinyy", "model=tinyy: no such option in config group 'model'; options: small, tiny, v4_flash "
                        "(did you mean tiny?)"),
        ("recipe.max_steps=abc", "recipe.max_steps: expected an int, got 'abc'"),
        ("model.config.index_topk=0", "index_topk must be >= 1, got 0"),
        ("model.config.index_topkk=3", "model.config.index_topkk: no such key in model.config (did you mean index_topk?)"),
        ("seeed=3", "seeed: no such key in the top level (did you mean seed?)"),
        ("recipe.precision=fp8", "recipe.precision must be one of ('fp32', 'bf16'), got 'fp8'"),
        ("device=gpu", "device must be 'cpu' or 'cuda' (or 'cuda:N'), got 'gpu'"),
        ("recipe.max_steps=5,6", "recipe.max_steps=5,6: a list of options is a sweep; add -m to run each"),
        ("--verbos", "unknown flag --verbos"),
        ("recipe.plot=maybe", "recipe.plot: expected a bool (true/false), got 'maybe'"),
        ("recipe.betas=3", "recipe.betas: expected a list such as [0.9, 0.95], got an int"),
        ("run_dir", "run_dir: an override is key=value"),
        ("recipe=smok", "recipe=smok: no such option in config group 'recipe'; options: default, h200, smoke "
                        "(did you mean smoke?)"),
        ("recipe.cp_size=2", "recipe.cp_size=2 needs a torchrun launch"),
        ("seed=abc", "seed must be an int in [0, 2**63), got 'abc'"),
        ("seed=1.5", "seed must be an int in [0, 2**63), got 1.5"),
        ("seed=2**70", "seed must be an int in [0, 2**63), got '2**70'"),
        (f"seed={2**70}", f"seed must be an int in [0, 2**63), got {2**70}"),
        ("seed=-1", "seed must be an int in [0, 2**63), got -1"),
        ("recipe.seq_len=1", "recipe.seq_len must be an int >= 2 (a token and the next one it predicts), got 1"),
        ("recipe.seq_len=3", "recipe.min_piece must be an int in [2, recipe.seq_len=3]"),
        ("recipe.seq_len=7", "recipe.min_piece must be an int in [2, recipe.seq_len=7] (the shortest document piece a "
                             "row starts), got 8: lower recipe.min_piece or raise recipe.seq_len"),
        ("recipe.val_percent=0", "recipe.val_percent=0 holds out no validation documents, but recipe.val_batches=1 "
                                 "evaluates on them: set recipe.val_percent (e.g. 5) or recipe.val_batches=0"),
        ("run_dir=", "run_dir must name a directory for the run, got ''"),
        ("logger.log_dir=/tmp/elsewhere", "logger.log_dir must be a relative path inside run_dir (e.g. tensorboard), "
                                          "got '/tmp/elsewhere'"),
        ("logger.log_dir=../x", "logger.log_dir must be a relative path inside run_dir (e.g. tensorboard), got '../x'"),
        ("logger.log_dir=a/../../x", "logger.log_dir must be a relative path inside run_dir"),
    ],
)
def test_a_user_error_is_one_line_and_exit_code_2(tmp_path, capsys, mistake, expected):
    assert main([*SHORT, f"run_dir={tmp_path}", mistake]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nemo-dsa-train: error: ") and expected in err[0], err
    assert not (tmp_path / "checkpoints").exists()


def test_nothing_is_written_outside_run_dir_or_into_the_working_directory(tmp_path, monkeypatch, capsys):
    """``run_dir=`` (empty) and a ``logger.log_dir`` leaving run_dir are refused before anything is written."""
    monkeypatch.chdir(tmp_path)
    for mistake in ("run_dir=", "logger.log_dir=../outside", f"logger.log_dir={tmp_path / 'abs'}"):
        assert main([*SHORT, f"run_dir={tmp_path / 'run'}", "logger=tensorboard", mistake]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [], capsys.readouterr().err


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path, monkeypatch, capsys):
    from nemo_dsa.builder import config_dir

    configs = tmp_path / "configs"
    shutil.copytree(config_dir(), configs)
    (configs / "recipe" / "broken.yaml").write_text("defaults:\n  - default\n  - _self_\nseq_len: [32, 64\n")
    monkeypatch.setenv("NEMO_DSA_CONFIG_DIR", str(configs))
    assert main(["recipe=broken", f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"nemo-dsa-train: error: {configs / 'recipe' / 'broken.yaml'}, line 5, "
                                               "column 1: not valid YAML (expected ',' or ']'"), err


def test_the_traceback_is_shown_only_when_asked(tmp_path):
    def run(*extra, env=None):
        cmd = [sys.executable, "-m", "nemo_dsa.train", "recipe.max_stepz=5", f"run_dir={tmp_path}", *extra]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env={**os.environ, **(env or {})})

    quiet = run()
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr and "did you mean max_steps?" in quiet.stderr
    assert "Traceback" in run("--verbose").stderr
    assert "Traceback" in run(env={"HYDRA_FULL_ERROR": "1"}).stderr


def test_print_config_is_resolved_and_cfg_job_is_hydras(capsys):
    assert main(["--print-config", "scoring=v41", "recipe.max_steps=7"]) == 0
    out = capsys.readouterr().out
    assert "${" not in out and "run_dir: runs/tiny-v41-default" in out and "max_steps: 7" in out
    assert main(["--cfg", "job", "scoring=v41"]) == 0
    assert "run_dir: runs/${model.name}-${scoring.name}-${recipe.name}" in capsys.readouterr().out
    assert main(["--cfg", "job", "--resolve", "scoring=v41"]) == 0
    assert "run_dir: runs/tiny-v41-default" in capsys.readouterr().out
    assert main(["--cfg", "hydra"]) == 0
    assert "sweeper" in capsys.readouterr().out
    assert main(["--help"]) == 0
    assert "scoring={v4,v41}" in capsys.readouterr().out


def test_a_multirun_sweeps_a_config_group(tmp_path, capsys):
    assert main(["-m", "scoring=v4,v41", *SHORT, "recipe.max_steps=1", f"run_dir={tmp_path}/${{scoring.name}}"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2 and out[0].startswith(f"run_dir={tmp_path}/v4 step=1")
    for scoring in ("v4", "v41"):
        assert read_metrics(tmp_path / scoring / "metrics.jsonl")[0]["scoring"] == scoring


def test_a_run_says_when_it_resumes_and_ends_with_one_line(tmp_path, capsys):
    assert main([*SHORT, f"run_dir={tmp_path}", "recipe.stop_at_step=1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(f"run_dir={tmp_path} step=1 val_loss=") and "skipped_steps=0" in out[0]
    assert main([*SHORT, f"run_dir={tmp_path}"]) == 0
    captured = capsys.readouterr()
    assert "resuming from step 1" in captured.err
    assert len(captured.out.strip().splitlines()) == 1


def test_max_steps_not_past_warmup_warns(tmp_path, caplog):
    from nemo_dsa.recipe.schema import check_recipe
    from nemo_dsa.train import load_config

    with caplog.at_level(logging.WARNING, logger="nemo_dsa.recipe"):
        check_recipe(load_config([*SHORT, "recipe.warmup_steps=2"]).recipe)
    assert "recipe.max_steps=2 <= recipe.warmup_steps=2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nemo_dsa.recipe"):
        check_recipe(load_config([*SHORT, "recipe.warmup_steps=1"]).recipe)
    assert not caplog.text


@pytest.mark.slow
def test_the_same_seed_gives_bitwise_identical_losses_in_fresh_processes(tmp_path):
    """Two fresh interpreters (different hash seeds, default thread count): identical records."""
    losses = []
    for hash_seed in ("1", "2"):
        run_dir = tmp_path / hash_seed
        cmd = [sys.executable, "-m", "nemo_dsa.train", *[a for a in SHORT if "num_threads" not in a], "recipe.max_steps=3", "recipe.plot=false",
               f"run_dir={run_dir}"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180,
                              env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert proc.returncode == 0, proc.stderr[-2000:]
        losses.append([(r["step"], r.get("loss"), r.get("val_loss"), r.get("grad_norm"))
                       for r in read_metrics(run_dir / "metrics.jsonl") if "event" not in r])
    assert losses[0] == losses[1] and len(losses[0]) >= 3


def test_resuming_from_a_corrupt_checkpoint_is_one_line(tmp_path, capsys):
    assert main([*SHORT, f"run_dir={tmp_path}/first"]) == 0
    (checkpoint,) = sorted((tmp_path / "first" / "checkpoints").iterdir())
    state = checkpoint / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    capsys.readouterr()
    assert main([*SHORT, f"run_dir={tmp_path}/second", f"resume={checkpoint}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(checkpoint) in err[0] and "Traceback" not in err[0], err
