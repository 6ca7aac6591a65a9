"""The path a new user takes: train, fine-tune from those weights on other data (``init_from``),
evaluate, export; a finished run is not silently "resumed"; what a run reports and the messages
met on the way."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nemo_dsa.data import split_documents
from nemo_dsa.evaluate import main as evaluate_main
from nemo_dsa.export import main as export_main
from nemo_dsa.generate import main as generate_main
from nemo_dsa.recipe.commands import EvaluateArgs, ExportArgs, GenerateArgs
from nemo_dsa.recipe.inference import load_run
from nemo_dsa.recipe.weights import read_weights
from nemo_dsa.train import load_config, main, read_metrics, train

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=2", "recipe.ckpt_every=2",
         "recipe.val_every=2", "recipe.warmup_steps=1", "recipe.num_threads=1", "recipe.plot=false"]
# Other data than the embedded corpus: a few text files, one document each.
TEXTS = {f"note{i}.txt": f"Note {i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(40 + 9 * i)) for i in range(12)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trained") / "run"
    train(load_config([*SHORT, f"run_dir={path}"]))
    return path


@pytest.fixture(scope="module")
def notes(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("notes")
    for name, text in TEXTS.items():
        (root / name).write_text(text)
    return root


def _other_data(notes: Path) -> list[str]:
    return ["data=text", f"data.paths=[{notes}]", "recipe.val_batches=1", "recipe.val_percent=30"]


def _first_step_loss(cfg, model) -> float:
    """The loss step 1 of a run of ``cfg`` computes with ``model``'s weights: its first training batch
    rebuilt from the data config, scored as the recipe scores it."""
    from nemo_dsa.data import pack_documents
    from nemo_dsa.recipe.data_sources import build_tokenizer, load_documents
    from nemo_dsa.recipe.loop import loss_terms, model_inputs
    from nemo_dsa.recipe.parallel import Parallel

    r = cfg.recipe
    tokenizer = build_tokenizer(cfg.tokenizer)
    stream, _ = pack_documents(load_documents(cfg.data), tokenizer, seq_len=r.seq_len, batch_size=r.batch_size,
                               seed=cfg.seed, val_percent=r.val_percent, val_batches=r.val_batches,
                               min_piece=r.min_piece)
    inputs = model_inputs(next(stream), torch.device("cpu"), Parallel(), model.config.compress_ratios, tokenizer.pad_id)
    with torch.no_grad():
        loss_sum, aux, count = loss_terms(model.train(), inputs, "fp32")
    return float(loss_sum / count + aux)


def _first_step_record(run_dir: Path) -> dict:
    (record,) = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("event") == "first_step"]
    return record


# -- 7: init_from and the export --


def test_init_from_starts_a_new_run_on_other_data_from_the_trained_weights(trained, notes, tmp_path, capsys):
    from nemo_dsa.recipe.loop import _build_model

    args = [*SHORT, *_other_data(notes), f"run_dir={tmp_path / 'ft'}", f"init_from={trained}"]
    assert main(args) == 0
    assert "starting from the weights of" in capsys.readouterr().err
    summary = json.loads((tmp_path / "ft" / "summary.json").read_text())
    source = trained / "checkpoints" / "step_0000002"
    assert summary["init_from"] == {"path": str(source.resolve()), "kind": "checkpoint"}
    assert summary["resumed_from"] is None and summary["step"] == 2
    assert f"init_from: {trained}" in (tmp_path / "ft" / "config.yaml").read_text()
    # step 1 ran on the trained weights (and the new data), with a fresh schedule: the warmup's lr
    cfg = load_config(args)
    expected = _first_step_loss(cfg, load_run(trained).model)
    assert _first_step_record(tmp_path / "ft")["step_loss"] == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert summary["first_loss"] == _first_step_record(tmp_path / "ft")["step_loss"]
    def lrs(run_dir):
        return [r["lr"] for r in read_metrics(run_dir / "metrics.jsonl") if "lr" in r]

    assert lrs(tmp_path / "ft") == lrs(trained)  # a fresh schedule, from its warmup
    fresh = _first_step_loss(cfg, _build_model(cfg, torch.device("cpu")))
    assert abs(fresh - expected) > 1e-3  # the trained weights, not a fresh init, gave step 1's loss

    # Rerun with more steps: the run resumes its own checkpoint and says init_from is ignored.
    assert main([*args, "recipe.max_steps=3"]) == 0
    err = capsys.readouterr().err
    assert "is ignored: resuming from step 2" in err
    summary = json.loads((tmp_path / "ft" / "summary.json").read_text())
    assert summary["resumed_from"] == 2 and summary["init_from"]["path"] == str(source.resolve())


def test_init_from_a_mismatched_model_is_one_line_naming_the_key(trained, tmp_path, capsys):
    assert main([*SHORT, f"run_dir={tmp_path / 'wide'}", f"init_from={trained}", "model.config.hidden_size=64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "init_from=" in err[0] and "embed.weight" in err[0] and "[259, 128]" in err[0], err
    assert main([*SHORT, f"run_dir={tmp_path / 'v41'}", f"init_from={trained}", "scoring=v41"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "init_from=" in err[0] and "layers." in err[0], err
    assert main([*SHORT, f"run_dir={tmp_path / 'none'}", f"init_from={tmp_path / 'nowhere'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such directory" in err[0], err
    assert not any((tmp_path / name).exists() for name in ("wide", "v41", "none"))


def test_export_writes_an_hf_folder_that_init_from_reads_back(trained, notes, tmp_path, capsys):
    out = tmp_path / "export"
    assert export_main([f"run_dir={trained}", f"out={out}"]) == 0
    assert capsys.readouterr().out.strip() == f"run_dir={trained} checkpoint=step_0000002 out={out}"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["NemoDsaV4ForCausalLM"] and config["model_type"] == "nemo_dsa_v4"
    exported, saved = read_weights(out).tensors, read_weights(trained).tensors
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    # init_from the folder or from the run: the same first step
    for name, source in (("from_hf", out), ("from_run", trained)):
        assert main([*SHORT, *_other_data(notes), "recipe.max_steps=1", "recipe.warmup_steps=0", f"run_dir={tmp_path / name}",
                     f"init_from={source}"]) == 0
    assert _first_step_record(tmp_path / "from_hf")["step_loss"] == _first_step_record(tmp_path / "from_run")["step_loss"]
    assert json.loads((tmp_path / "from_hf" / "summary.json").read_text())["init_from"]["kind"] == "hf"
    # an existing folder is never overwritten
    capsys.readouterr()
    assert export_main([f"run_dir={trained}", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists and is not an empty directory" in err[0], err
    assert export_main([f"run_dir={trained}"]) == 2
    assert "out=... is required" in capsys.readouterr().err


def test_python_m_nemo_dsa_export_and_the_console_script(trained, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nemo_dsa.export", f"run_dir={trained}", f"out={tmp_path / 'x'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "x" / "model.safetensors").is_file()
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["nemo-dsa-export"] == "nemo_dsa.export:main"


# -- 8: a finished run --


def test_a_finished_run_is_not_resumed_unless_max_steps_is_raised(trained, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main([*SHORT, f"run_dir={run_dir}"]) == 0
    before = (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main([*SHORT, f"run_dir={run_dir}"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "finished run (step 2, recipe.max_steps=2)" in err[0] and "recipe.max_steps" in err[0]
    assert not captured.out and (run_dir / "metrics.jsonl").read_bytes() == before
    assert main([*SHORT, f"run_dir={run_dir}", "recipe.max_steps=3"]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["step"] == 3


# -- 9: what a run reports, and the messages on the way --


def test_a_run_reports_its_training_and_validation_documents_and_tokens(notes, tmp_path, capsys):
    from nemo_dsa.data import ByteTokenizer
    from nemo_dsa.recipe.data_sources import load_documents

    args = [*SHORT, *_other_data(notes), f"run_dir={tmp_path}"]
    assert main(args) == 0
    err = capsys.readouterr().err
    data = json.loads((tmp_path / "summary.json").read_text())["data"]
    docs = load_documents(load_config(args).data)
    train_docs, val_docs = split_documents(docs, 30)
    lengths = [len(ByteTokenizer().encode(d.text)) for d in train_docs], [len(ByteTokenizer().encode(d.text)) for d in val_docs]
    assert train_docs and val_docs
    assert data["train_documents"] == len(train_docs) and data["train_tokens"] == sum(lengths[0])
    assert data["val_documents"] == len(val_docs) and data["val_tokens"] == sum(lengths[1])
    assert 0 < data["val_tokens_evaluated"] <= min(data["val_tokens"], 2 * 32)
    assert (f"data: {len(train_docs)} training documents ({sum(lengths[0]):,} tokens), {len(val_docs)} validation "
            f"documents ({sum(lengths[1]):,} tokens") in err
    (record,) = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "data"]
    assert {k: record[k] for k in data} == data


def test_first_loss_is_step_ones(tmp_path):
    from nemo_dsa.recipe.loop import _build_model

    args = [*SHORT, "recipe.log_every=2", f"run_dir={tmp_path}"]
    train(load_config(args))
    cfg = load_config(args)
    expected = _first_step_loss(cfg, _build_model(cfg, torch.device("cpu")))
    summary = json.loads((tmp_path / "summary.json").read_text())
    window = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r and "event" not in r][0]
    assert window["step"] == 2 and window["loss"] != summary["first_loss"]  # the mean of steps 1 and 2
    assert summary["first_loss"] == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_evaluate_shows_a_progress_bar(trained, capsys):
    assert evaluate_main([f"run_dir={trained}", "batches=2"]) == 0
    captured = capsys.readouterr()
    assert "evaluate" in captured.err and "2/2" in captured.err and "loss=" in captured.out


@pytest.mark.parametrize("command,schema", [(generate_main, GenerateArgs), (evaluate_main, EvaluateArgs),
                                            (export_main, ExportArgs)])
def test_help_lists_every_key(command, schema, capsys):
    assert command(["--help"]) == 0
    out = capsys.readouterr().out
    for name in schema.__dataclass_fields__:
        assert f"\n  {name} " in out, name


@pytest.mark.parametrize("mistake,expected", [
    ("lr=0.1", "lr: no such key in the top level (did you mean recipe.lr?)"),
    ("max_steps=3", "(did you mean recipe.max_steps?)"),
    ("index_topk=3", "(did you mean model.config.index_topk?)"),
    ("seeed=3", "(did you mean seed?)"),
])
def test_a_mistyped_key_suggests_the_nested_key(mistake, expected, tmp_path, capsys):
    assert main([*SHORT, f"run_dir={tmp_path}", mistake]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_a_special_token_hint_shows_quoting_that_survives_the_shell(tmp_path, capsys):
    # What bash hands over for tokenizer.eos_token='</s>' (its quotes removed):
    (unquoted,) = shlex.split("tokenizer.eos_token='</s>'")
    assert main([*SHORT, f"run_dir={tmp_path}", "tokenizer=hf", unquoted]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    suggested = err[0].rsplit("write ", 1)[1]
    (as_typed,) = shlex.split(suggested)  # the suggestion, through the shell
    assert load_config(["tokenizer=hf", as_typed]).tokenizer.eos_token == "</s>"


def test_the_tokenizer_hint_quotes_for_the_shell(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from nemo_dsa.recipe.data_sources import HFTokenizer

    tok = Tokenizer(models.WordLevel({"a": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError) as error:
        HFTokenizer(str(tmp_path / "tokenizer.json"))
    suggested = str(error.value).rsplit(": ", 1)[1]
    (as_typed,) = shlex.split(suggested)
    assert as_typed == "tokenizer.eos_token='</s>'"
    assert load_config(["tokenizer=hf", as_typed]).tokenizer.eos_token == "</s>"


def test_a_failed_run_leaves_no_directory_holding_only_its_lock(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "failed"
    assert main([*SHORT, f"run_dir={run_dir}", "model.config.index_topk=0"]) == 2
    assert "index_topk must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    kept = tmp_path / "mine"
    kept.mkdir()
    assert main([*SHORT, f"run_dir={kept}", "model.config.index_topk=0"]) == 2
    assert kept.is_dir()  # a directory the run did not create stays


def test_each_train_ft_cpu_run_gets_its_own_folder(tmp_path):
    spec = importlib.util.spec_from_file_location("train_ft_cpu", ROOT / "examples" / "automodel" / "train_ft_cpu.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    config = tmp_path / "ft.yaml"
    config.write_text(f"checkpoint:\n  enabled: false\n  checkpoint_dir: {tmp_path / 'ft'}\n")
    first = script.own_checkpoint_dir(["--config", str(config)])
    second = script.own_checkpoint_dir(["--config", str(config)])
    assert first[:2] == ["--config", str(config)] and first[2] == "--checkpoint.checkpoint_dir"
    assert Path(first[3]).parent == tmp_path / "ft" and first[3] != second[3]
    given = ["--config", str(config), "--checkpoint.checkpoint_dir", "/elsewhere"]
    assert script.own_checkpoint_dir(given) == given


def test_a_separator_typed_on_the_command_line_splits_paragraphs(tmp_path):
    from nemo_dsa.recipe.data_sources import load_documents

    (tmp_path / "a.md").write_text("first part\n\nsecond part\nstill second\n\n\nthird\tpart")
    data = load_config(["data=text", f"data.paths=[{tmp_path}]", 'data.separator="\\n\\n"']).data
    assert data.separator == "\\n\\n"  # Hydra keeps the two characters
    assert [d.text for d in load_documents(data)] == ["first part", "second part\nstill second", "\nthird\tpart"]
