"""Trained weights in and out of a run: ``init_from=`` (a new run from trained weights) and the
HF-format export (``nemo-dsa-export``).

Weights come from a checkpoint directory (``checkpoints/step_*``, verified against its manifest),
a run directory (its newest intact checkpoint) or an HF-format folder (``config.json`` +
``model.safetensors``, as ``nemo-dsa-export`` writes). Only safetensors and JSON are read: never
``trainer_state.pt``, so a folder from someone else cannot run code here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nemo_dsa.recipe.state import MANIFEST_FILE, CorruptCheckpoint, list_checkpoints, verify_checkpoint

WEIGHTS_FILE = "model.safetensors"
CONFIG_METADATA = "nemo_dsa_config"  # the model config a checkpoint's safetensors metadata carries


@dataclass
class Weights:
    """Where a run's weights came from and what they hold."""

    source: Path  # the checkpoint directory or HF-format folder read
    kind: str  # "checkpoint" | "hf"
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # empty once copied into a model

    def record(self) -> dict:
        """What ``config.yaml``'s neighbours (metrics, summary, checkpoints) say of the source."""
        return {"path": str(self.source.resolve()), "kind": self.kind}


def _newest_intact(run_dir: Path, key: str) -> Path:
    problems = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
            return path
        except CorruptCheckpoint as e:
            problems.append(str(e))
    if problems:
        raise CorruptCheckpoint(f"{key}={run_dir}: no intact checkpoint ({'; '.join(problems)})")
    raise FileNotFoundError(f"{key}={run_dir}: the run holds no checkpoints/step_* yet")


def locate(path: str | Path, key: str = "init_from") -> tuple[Path, str]:
    """``(directory holding model.safetensors, kind)`` for a checkpoint, a run or an HF-format folder."""
    if not isinstance(path, str | os.PathLike) or not str(path).strip():
        raise ValueError(f"{key} must name a checkpoint directory, a run_dir or an HF-format folder, got {path!r} "
                         f"(null: no {key})")
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{key}={path}: no such directory (a checkpoint, run_dir or HF-format folder)")
    if os.path.lexists(path / MANIFEST_FILE):
        verify_checkpoint(path)  # CorruptCheckpoint names the bad file
        return path, "checkpoint"
    if (path / "checkpoints").is_dir():
        return _newest_intact(path, key), "checkpoint"
    if os.path.lexists(path / "config.json"):
        if not os.path.lexists(path / WEIGHTS_FILE):
            raise FileNotFoundError(f"{key}={path}: an HF-format folder without {WEIGHTS_FILE} "
                                    "(sharded weights are not read: export a single file)")
        return path, "hf"
    raise FileNotFoundError(f"{key}={path}: neither a checkpoint directory (with {MANIFEST_FILE}), a run_dir "
                            f"(with checkpoints/) nor an HF-format folder (config.json + {WEIGHTS_FILE})")


def read_weights(path: str | Path, key: str = "init_from") -> Weights:
    """The weights at ``path`` (``locate``), read as a file of a folder from someone else."""
    from nemo_dsa.models.dsa_lm.checkpoint import read_checkpoint

    source, kind = locate(path, key)
    return Weights(source, kind, read_checkpoint(source / WEIGHTS_FILE))


def checkpoint_model_config(source: Path, key: str = "run_dir"):
    """The ``DSAModelConfig`` a checkpoint's ``model.safetensors`` metadata records, checked against
    the tensors' shapes in the same file (a config that disagrees with them is a ValueError)."""
    from nemo_dsa._untrusted import parse_json
    from nemo_dsa.models.dsa_lm import DSAModelConfig
    from nemo_dsa.models.dsa_lm.checkpoint import check_config_fits, read_header

    file = source / WEIGHTS_FILE
    where = f"{key}: {file}'s {CONFIG_METADATA} metadata"
    text = read_header(file).metadata.get(CONFIG_METADATA)
    if text is None:
        raise ValueError(f"{key}: {file} records no model config ({CONFIG_METADATA} metadata)")
    fields = parse_json(text, where)
    if not isinstance(fields, dict):
        raise ValueError(f"{where} is not an object of model config keys")
    try:
        config = DSAModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    check_config_fits(config, file, where=f"{where} against the tensors")
    return config


MISMATCH_HINT = "init_from loads weights only, so model.config must match the one they were trained with"


def load_initial_weights(model: torch.nn.Module, path: str | Path) -> Weights:
    """Copy the weights at ``path`` into ``model`` (``init_from=``): every key the model has, each of
    its shape, floating where the model's is, and finite; the first mismatch is a ValueError naming
    the file and key, before any tensor data is read (``models.dsa_lm.checkpoint.load_checkpoint``)."""
    from nemo_dsa.models.dsa_lm.checkpoint import load_checkpoint

    source, kind = locate(path)
    try:
        load_checkpoint(model, source / WEIGHTS_FILE, where=f"init_from={path}")
    except ValueError as e:
        mismatch = "do not match the model" in str(e)
        raise ValueError(f"{e}{': ' + MISMATCH_HINT if mismatch else ''}") from None
    return Weights(source, kind, {})


def export_run(run_dir: str | Path, out: str | Path, checkpoint: str | None = None) -> tuple[Path, Path]:
    """Write the newest intact checkpoint of ``run_dir`` (or ``checkpoint``) as an HF-format folder
    at ``out`` (new or empty); returns ``(checkpoint read, out)``."""
    from nemo_dsa.models.dsa_lm.hf_format import write_hf_folder

    if not isinstance(out, str | os.PathLike) or not str(out).strip():
        raise ValueError(f"out must name a new or empty folder for the export, got {out!r}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"out={out}: exists and is not an empty directory; pick a new folder")
    if checkpoint:
        source = Path(checkpoint)
        if not os.path.lexists(source / MANIFEST_FILE):
            raise FileNotFoundError(f"checkpoint={checkpoint}: not a checkpoint directory (no {MANIFEST_FILE})")
        verify_checkpoint(source)
    else:
        if not (Path(run_dir) / "checkpoints").is_dir():
            raise FileNotFoundError(f"run_dir={run_dir}: no checkpoints/ (not a directory written by nemo-dsa-train)")
        source = _newest_intact(Path(run_dir), "run_dir")
    key = "checkpoint" if checkpoint else "run_dir"
    config = checkpoint_model_config(source, key)  # checked against the tensors' header first
    weights = read_weights(source, key)
    try:
        write_hf_folder(weights.tensors, config, out)
    except OSError as e:
        raise ExportTargetError(f"out={out}: cannot write the folder there ({e.strerror or e}"
                                f"{': ' + str(e.filename) if e.filename else ''})") from None
    return source, out


class ExportTargetError(ValueError):
    """``out`` cannot hold the exported folder (read-only, not a directory, a name too long ...)."""
