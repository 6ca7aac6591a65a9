"""A folder from someone else cannot hang, exhaust or read beyond: every command refuses it on
one line (exit 2) within seconds and under 1 GiB, before allocating what its files ask for.

The crafted folders are built here from a real trained run: a state file linked to ``/dev/zero``
or replaced by a FIFO (its manifest entry made to match), a train state whose model config asks
for a 6 GB embedding, a checkpoint whose safetensors metadata disagrees with its tensors, a
manifest nested 100,000 deep. Each command runs in a child process (``bounded``), so a command
that would hang is killed and fails its test instead of stalling the suite.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _support.bounded import assert_refused_on_one_line, run_command
from nemo_dsa.recipe.state import CorruptCheckpoint, list_checkpoints, verify_checkpoint
from nemo_dsa.train import load_config, train

SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=2", "recipe.ckpt_every=2",
         "recipe.val_every=2", "recipe.warmup_steps=1", "recipe.num_threads=1", "recipe.plot=false"]
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run with one checkpoint (copied by each test that alters it)."""
    path = tmp_path_factory.mktemp("trained") / "run"
    train(load_config([*SHORT, f"run_dir={path}"]))
    return path


def _copy(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    return run_dir, list_checkpoints(run_dir)[-1]


def _write_manifest(checkpoint: Path, entries: dict | None = None) -> None:
    """Recompute the manifest as anyone editing a checkpoint can; ``entries`` replace computed ones."""
    files = {}
    for p in sorted(checkpoint.iterdir()):
        if p.name != "manifest.json" and p.is_file() and not p.is_symlink():
            files[p.name] = {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "size": p.stat().st_size}
    files.update(entries or {})
    (checkpoint / "manifest.json").write_text(json.dumps({"step": 2, "files": files}))


def _state_replaced_by(checkpoint: Path, kind: str) -> None:
    """trainer_state.pt becomes a link to /dev/zero or a FIFO; the manifest says 0 bytes, the empty sha256."""
    state = checkpoint / "trainer_state.pt"
    state.unlink()
    if kind == "dev_zero":
        state.symlink_to("/dev/zero")
    else:
        os.mkfifo(state)
    _write_manifest(checkpoint, {"trainer_state.pt": {"sha256": EMPTY_SHA256, "size": 0}})


# --- 1: a link to /dev/zero or a FIFO never hangs a command -------------------------------------

COMMANDS = {
    "init_from": lambda run, ckpt, tmp: ("nemo_dsa.train", [*SHORT, f"run_dir={tmp / 'new'}", f"init_from={ckpt}"]),
    "export": lambda run, ckpt, tmp: ("nemo_dsa.export", [f"run_dir={run}", f"checkpoint={ckpt}", f"out={tmp / 'hf'}"]),
    "evaluate": lambda run, ckpt, tmp: ("nemo_dsa.evaluate", [f"run_dir={run}", f"checkpoint={ckpt}"]),
    "generate": lambda run, ckpt, tmp: ("nemo_dsa.generate", [f"run_dir={run}", f"checkpoint={ckpt}", "prompt=x"]),
}


@pytest.mark.parametrize("kind", ["dev_zero", "fifo"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_state_file_that_is_a_device_or_a_fifo_is_refused_at_once(trained, tmp_path, kind, command):
    run_dir, checkpoint = _copy(trained, tmp_path)
    _state_replaced_by(checkpoint, kind)
    module, args = COMMANDS[command](run_dir, checkpoint, tmp_path)
    line = assert_refused_on_one_line(run_command(module, args), "trainer_state.pt", str(checkpoint))
    assert ("symbolic link" if kind == "dev_zero" else "a FIFO, not a regular file") in line
    assert not (tmp_path / "hf").exists()


def test_a_weights_file_linked_outside_the_checkpoint_is_refused(trained, tmp_path):
    run_dir, checkpoint = _copy(trained, tmp_path)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(checkpoint / "model.safetensors", outside)
    (checkpoint / "model.safetensors").symlink_to(outside)  # same bytes: the manifest still matches
    with pytest.raises(CorruptCheckpoint, match="model.safetensors is a symbolic link"):
        verify_checkpoint(checkpoint)


def test_a_data_path_that_is_a_fifo_or_a_device_is_refused(tmp_path):
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), ("/dev/zero", "a character device")):
        args = [*SHORT, f"run_dir={tmp_path / 'run'}", "data=text", f"data.paths=[{path}]"]
        assert_refused_on_one_line(run_command("nemo_dsa.train", args), "data.paths", kind)


# --- 2: a train state's model config is checked against the weights before it is built -----------

@pytest.mark.parametrize("command", ["generate", "evaluate"])
@pytest.mark.parametrize("vocab_size", [6_000_000, 2**42])
def test_a_state_asking_for_a_huge_model_is_refused_before_allocating_it(trained, tmp_path, command, vocab_size):
    run_dir, checkpoint = _copy(trained, tmp_path)
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    state["model_config"]["vocab_size"] = vocab_size
    torch.save(state, checkpoint / "trainer_state.pt")
    _write_manifest(checkpoint)
    module, args = COMMANDS[command](run_dir, checkpoint, tmp_path)
    line = assert_refused_on_one_line(run_command(module, args), "trainer_state.pt's model_config", "vocab_size")
    if vocab_size == 6_000_000:
        assert "embed.weight" in line and "[259, 128]" in line


# --- 5: an empty init_from or out is refused, not read as "none" or "here" ------------------------

def test_an_empty_init_from_is_refused(tmp_path):
    outcome = run_command("nemo_dsa.train", [*SHORT, f"run_dir={tmp_path / 'run'}", "init_from="])
    assert_refused_on_one_line(outcome, "init_from must name")
    assert not (tmp_path / "run").exists()


def test_an_empty_out_writes_nothing_here(trained, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    assert_refused_on_one_line(run_command("nemo_dsa.export", [f"run_dir={trained}", "out="], cwd=cwd), "out=")
    assert list(cwd.iterdir()) == []


# --- 7: export refuses a stored config that disagrees with the tensors ------------------------------

@pytest.mark.parametrize("change", [{"vocab_size": 300}, {"num_hidden_layers": 3, "compress_ratios": [0, 4, 16]}])
def test_export_refuses_a_config_that_does_not_describe_the_tensors(trained, tmp_path, change):
    run_dir, checkpoint = _copy(trained, tmp_path)
    weights = checkpoint / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        metadata = dict(f.metadata())
    config = {**json.loads(metadata["nemo_dsa_config"]), **change}
    save_file(load_file(str(weights)), str(weights), metadata={**metadata, "nemo_dsa_config": json.dumps(config)})
    _write_manifest(checkpoint)
    outcome = run_command("nemo_dsa.export", [f"run_dir={run_dir}", f"out={tmp_path / 'hf'}"])
    assert_refused_on_one_line(outcome, "nemo_dsa_config metadata", str(weights))
    assert not (tmp_path / "hf").exists()


# --- 8: max_position_embeddings bounds the training sequence --------------------------------------

def test_a_sequence_longer_than_max_position_embeddings_is_refused(tmp_path):
    args = [*SHORT, f"run_dir={tmp_path / 'run'}", "model.config.max_position_embeddings=8"]
    assert_refused_on_one_line(run_command("nemo_dsa.train", args), "recipe.seq_len=32",
                               "model.config.max_position_embeddings=8")


# --- 11: export's OSErrors are one line ------------------------------------------------------------

@pytest.mark.parametrize("target", ["under_a_file", "long_name", "proc"])
def test_export_to_an_unusable_out_is_one_line(trained, tmp_path, target):
    (tmp_path / "file").write_text("x")
    out = {"under_a_file": tmp_path / "file" / "sub", "long_name": tmp_path / ("n" * 300),
           "proc": Path("/proc/nemo-dsa-export")}[target]
    assert_refused_on_one_line(run_command("nemo_dsa.export", [f"run_dir={trained}", f"out={out}"]), str(out))


# --- 12: a manifest nested 100,000 deep is a corrupt checkpoint -------------------------------------

def test_a_deeply_nested_manifest_is_one_line(trained, tmp_path):
    run_dir, checkpoint = _copy(trained, tmp_path)
    (checkpoint / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CorruptCheckpoint, match="nests JSON deeper"):
        verify_checkpoint(checkpoint)
    outcome = run_command("nemo_dsa.evaluate", [f"run_dir={run_dir}", f"checkpoint={checkpoint}"])
    assert_refused_on_one_line(outcome, "manifest.json", "nests JSON deeper")


# --- 13: absurd values and devices are one line at once --------------------------------------------

@pytest.mark.parametrize("command, args, needles", [
    ("nemo_dsa.generate", ["prompt=x", "device=cuda"], ["device=cuda", "no CUDA device"]),
    ("nemo_dsa.evaluate", ["device=meta"], ["device must be cpu or cuda"]),
    ("nemo_dsa.evaluate", ["batch_size=1000000000"], ["batches and batch_size"]),
    ("nemo_dsa.evaluate", ["batches=1000000000000000000000000000000"], ["batches and batch_size"]),
    ("nemo_dsa.train", ["model.config.hidden_size=1000000000"], ["model.config.hidden_size=1000000000"]),
    ("nemo_dsa.train", ["model.config.vocab_size=1099511627776"], ["vocab_size must be <="]),
    ("nemo_dsa.train", ["recipe.batch_size=1000000000"], ["recipe.batch_size"]),
    ("nemo_dsa.train", ["recipe.seq_len=1000000000", "recipe.min_piece=2"], ["recipe.seq_len"]),
], ids=["generate-cuda", "evaluate-meta", "evaluate-batch_size", "evaluate-batches", "train-hidden_size",
        "train-vocab_size", "train-batch_size", "train-seq_len"])
def test_absurd_values_are_refused_on_one_line_at_once(trained, tmp_path, command, args, needles):
    if command == "nemo_dsa.train":
        args = [*SHORT, f"run_dir={tmp_path / 'run'}", *args]
    else:
        args = [f"run_dir={trained}", *args]
    assert_refused_on_one_line(run_command(command, args), *needles)


def test_a_tiny_temperature_samples_the_most_likely_token(trained):
    outcome = run_command("nemo_dsa.generate", [f"run_dir={trained}", "prompt=def ", "max_new_tokens=4",
                                                "temperature=1e-45", "seed=1"])
    greedy = run_command("nemo_dsa.generate", [f"run_dir={trained}", "prompt=def ", "max_new_tokens=4"])
    assert outcome.returncode == greedy.returncode == 0, outcome.stderr[-2000:]
    assert outcome.stdout == greedy.stdout


# --- 15: messages name the right thing; the export is world-readable --------------------------------

def test_num_samples_out_of_range_names_num_samples(trained):
    outcome = run_command("nemo_dsa.generate", [f"run_dir={trained}", "prompt=x", f"num_samples={10**30}"])
    line = assert_refused_on_one_line(outcome, "num_samples must be in")
    assert "seed" not in line


def test_device_meta_names_the_device(trained):
    outcome = run_command("nemo_dsa.generate", [f"run_dir={trained}", "prompt=x", "device=meta"])
    line = assert_refused_on_one_line(outcome, "device")
    assert "position_ids" not in line


def test_a_non_ascii_value_says_how_to_quote_it(tmp_path):
    outcome = run_command("nemo_dsa.train", [*SHORT, f"run_dir={tmp_path / 'run'}", "data.text_key=clé"])
    assert_refused_on_one_line(outcome, "non-ASCII", "\"data.text_key='clé'\"")


def test_the_exported_weights_are_as_readable_as_the_config(trained, tmp_path):
    old = os.umask(0o022)
    try:
        from nemo_dsa.export import main as export_main

        assert export_main([f"run_dir={trained}", f"out={tmp_path / 'hf'}"]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644}
