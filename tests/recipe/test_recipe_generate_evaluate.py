"""``nemo-dsa-generate`` and ``nemo-dsa-evaluate`` on a tiny model trained a few steps."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_dsa.evaluate import main as evaluate_main
from nemo_dsa.generate import main as generate_main
from nemo_dsa.recipe.inference import filter_logits, generate, load_run
from nemo_dsa.train import load_config, read_metrics, train

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=3", "recipe.ckpt_every=3",
         "recipe.val_every=3", "recipe.val_batches=2", "recipe.warmup_steps=1", "recipe.num_threads=1",
         "recipe.plot=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trained")
    train(load_config([*SHORT, f"run_dir={path}"]))
    return path


def _reference_greedy(model, tokenizer, prompt: str, n: int) -> list[int]:
    """Greedy decoding written out plainly: argmax of the full forward at every step."""
    ids = [tokenizer.bos_id, *tokenizer.encode(prompt, add_special=False)]
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        token = int(logits.argmax())
        if token == tokenizer.eos_id:
            break
        ids.append(token)
        out.append(token)
    return out


def test_greedy_generation_is_the_argmax_and_sampling_is_seeded(run_dir):
    run = load_run(run_dir)
    assert run.step == 3 and run.checkpoint.name == "step_0000003"
    greedy = generate(run.model, run.tokenizer, "json.", max_new_tokens=12)
    assert greedy == _reference_greedy(run.model, run.tokenizer, "json.", 12) and greedy
    a = generate(run.model, run.tokenizer, "json.", max_new_tokens=12, temperature=1.0, top_k=20, seed=5)
    b = generate(run.model, run.tokenizer, "json.", max_new_tokens=12, temperature=1.0, top_k=20, seed=5)
    c = generate(run.model, run.tokenizer, "json.", max_new_tokens=12, temperature=1.0, top_k=20, seed=6)
    assert a == b and a != c  # 3 training steps: a nearly flat distribution, two seeds differ
    assert generate(run.model, run.tokenizer, "json.", max_new_tokens=12, temperature=1e-4, seed=9) == greedy
    assert all(t < 256 for t in a)  # bytes only: BOS/PAD are never emitted before EOS stops it


def test_filter_logits_keeps_top_k_and_the_nucleus():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(50, generator=g) * 3
        k = int(torch.randint(1, 50, (1,), generator=g))
        kept = torch.isfinite(filter_logits(logits, top_k=k))
        assert kept.sum() == k and set(kept.nonzero().flatten().tolist()) == set(logits.topk(k).indices.tolist())
        p = float(torch.rand((), generator=g)) * 0.98 + 0.01
        kept = torch.isfinite(filter_logits(logits, top_p=p))
        probs = torch.softmax(logits, -1)
        order = probs.argsort(descending=True)
        mass = probs[order].cumsum(0)
        n = int((mass < p).sum()) + 1  # the smallest prefix whose mass reaches p
        assert set(kept.nonzero().flatten().tolist()) == set(order[:n].tolist())


def test_the_generate_command(run_dir, capsys):
    assert generate_main([f"run_dir={run_dir}", "prompt=json.", "max_new_tokens=10"]) == 0
    out = capsys.readouterr().out
    run = load_run(run_dir)
    assert out == "json." + run.tokenizer.decode(generate(run.model, run.tokenizer, "json.", max_new_tokens=10)) + "\n"
    assert generate_main([f"run_dir={run_dir}", "prompt=a", "max_new_tokens=5", "temperature=0.9", "top_p=0.9",
                          "num_samples=2", "seed=1"]) == 0
    assert capsys.readouterr().out.count("--- sample") == 2


@pytest.mark.parametrize("args,expected", [
    (["prompt=x"], "run_dir=... is required"),
    (["run_dir=/nonexistent"], "run_dir=/nonexistent: no such directory"),
    (["run_dir=.", "max_new_tokenz=3"], "max_new_tokenz: no such key (did you mean max_new_tokens?)"),
    (["run_dir=.", "max_new_tokens=abc"], "max_new_tokens: expected an int, got 'abc'"),
    (["run_dir=.", "top_p=0"], "top_p must be in (0, 1], got 0.0"),
    (["run_dir=.", "temperature=-1"], "temperature must be >= 0"),
    (["run_dir=."], "run_dir=. has no config.yaml: not a directory written by nemo-dsa-train"),
    (["run_dir=.", f"seed={2**70}"], f"seed must be an int in [0, 2**63 - num_samples), got {2**70}"),
    (["run_dir=.", "seed=-3"], "seed must be an int in [0, 2**63 - num_samples), got -3"),
])
def test_generate_mistakes_are_one_line(capsys, args, expected):
    assert generate_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nemo-dsa-generate: error: ") and expected in err[0], err


def test_evaluate_reproduces_the_runs_validation_loss(run_dir, capsys):
    val = [r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r][-1]
    assert evaluate_main([f"run_dir={run_dir}"]) == 0
    line = capsys.readouterr().out.strip()
    fields = dict(kv.split("=", 1) for kv in line.split())
    assert fields["split"] == "validation" and fields["batches"] == "2" and fields["checkpoint"] == "step_0000003"
    assert float(fields["loss"]) == pytest.approx(val, abs=5e-5)  # printed with 4 decimals
    assert float(fields["perplexity"]) == pytest.approx(math.exp(val), rel=1e-3)


def test_a_prompt_past_the_models_positions_and_a_run_without_validation_are_named(run_dir, tmp_path, capsys):
    limit = load_run(run_dir).model.config.max_position_embeddings
    assert generate_main([f"run_dir={run_dir}", f"prompt={'a' * limit}", "max_new_tokens=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the checkpoint it read, then the error
    assert err[-1].startswith("nemo-dsa-generate: error: prompt: ") and f"max_position_embeddings={limit}" in err[-1], err
    no_val = tmp_path / "no-val"
    train(load_config([*SHORT, "recipe.val_batches=0", f"run_dir={no_val}"]))
    assert evaluate_main([f"run_dir={no_val}"]) == 2  # not a loss of 0 over no batches
    assert "recipe.val_batches=0; pass batches=N" in capsys.readouterr().err
    assert evaluate_main([f"run_dir={no_val}", "batches=1"]) == 0
    assert 0 < float(dict(kv.split("=", 1) for kv in capsys.readouterr().out.split())["loss"]) < 10


def test_evaluate_on_another_data_config(run_dir, tmp_path, capsys):
    texts = ["def f(x):\n    return x + 1\n", "The sparse attention indexer selects the top-k keys.", "a" * 300]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    args = [f"run_dir={run_dir}", "split=all", "data=jsonl", f"data.paths=[{tmp_path / 'eval.jsonl'}]",
            "data.text_key=body"]
    assert evaluate_main(args) == 0
    fields = dict(kv.split("=", 1) for kv in capsys.readouterr().out.split())
    tokens = sum(len(t.encode()) + 1 for t in texts)  # every byte and EOS is a target once, BOS none
    assert fields["split"] == "all" and int(fields["tokens"]) >= tokens and 0 < float(fields["loss"]) < 10
    assert evaluate_main([*args, "data.text_kee=body"]) == 2
    assert "data.text_kee: no such key in data (did you mean text_key?)" in capsys.readouterr().err
    assert evaluate_main([f"run_dir={run_dir}", "split=valid"]) == 2
    assert "split must be one of validation, train, all, got 'valid' (did you mean validation?)" in capsys.readouterr().err


def test_the_commands_run_as_modules(run_dir):
    for module, extra in (("nemo_dsa.generate", ["prompt=os.", "max_new_tokens=4"]), ("nemo_dsa.evaluate", [])):
        proc = subprocess.run([sys.executable, "-m", module, f"run_dir={run_dir}", *extra], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip()


def test_a_device_that_is_no_device_and_a_broken_config_yaml_are_one_line(run_dir, tmp_path, capsys):
    for main in (generate_main, evaluate_main):
        assert main([f"run_dir={run_dir}", "device=nonsense"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "device must name a device such as 'cpu', 'cuda' or 'cuda:0', got 'nonsense'" in err[0]
    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    (broken / "config.yaml").write_text("recipe:\n  seq_len: [32,\n")
    for main in (generate_main, evaluate_main):
        assert main([f"run_dir={broken}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{broken / 'config.yaml'}, line 3, column 1: not valid YAML" in err[0], err
