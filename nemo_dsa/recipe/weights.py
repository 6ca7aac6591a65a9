"""Trained weights in and out of a run: ``init_from=`` (a new run from trained weights) and the
HF-format export (``nemo-dsa-export``).

Weights come from a checkpoint directory (``checkpoints/step_*``, verified against its manifest),
a run directory (its newest intact checkpoint) or an HF-format folder (``config.json`` +
``model.safetensors``, as ``nemo-dsa-export`` writes). Only safetensors and JSON are read: never
``trainer_state.pt``, so a folder from someone else cannot run code here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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
    tensors: dict[str, torch.Tensor]

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
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{key}={path}: no such directory (a checkpoint, run_dir or HF-format folder)")
    if (path / MANIFEST_FILE).is_file():
        verify_checkpoint(path)  # CorruptCheckpoint names the bad file
        return path, "checkpoint"
    if (path / "checkpoints").is_dir():
        return _newest_intact(path, key), "checkpoint"
    if (path / "config.json").is_file():
        if not (path / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"{key}={path}: an HF-format folder without {WEIGHTS_FILE} "
                                    "(sharded weights are not read: export a single file)")
        return path, "hf"
    raise FileNotFoundError(f"{key}={path}: neither a checkpoint directory (with {MANIFEST_FILE}), a run_dir "
                            f"(with checkpoints/) nor an HF-format folder (config.json + {WEIGHTS_FILE})")


def read_weights(path: str | Path, key: str = "init_from") -> Weights:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    source, kind = locate(path, key)
    try:
        tensors = load_file(source / WEIGHTS_FILE)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{key}={path}: {source / WEIGHTS_FILE} does not load ({e})") from None
    return Weights(source, kind, tensors)


def checkpoint_model_config(source: Path, key: str = "run_dir"):
    """The ``DSAModelConfig`` a checkpoint's ``model.safetensors`` metadata records."""
    from safetensors import safe_open

    from nemo_dsa.models.dsa_lm import DSAModelConfig

    with safe_open(source / WEIGHTS_FILE, framework="pt") as f:
        text = (f.metadata() or {}).get(CONFIG_METADATA)
    if text is None:
        raise ValueError(f"{key}: {source / WEIGHTS_FILE} records no model config ({CONFIG_METADATA} metadata)")
    return DSAModelConfig(**json.loads(text))


def load_initial_weights(model: torch.nn.Module, path: str | Path) -> Weights:
    """Copy the weights at ``path`` into ``model`` (``init_from=``): every key the model has, each of
    its shape and finite; the first mismatch is a ValueError naming the key."""
    weights = read_weights(path)
    tied = {"head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    expected = {k: v for k, v in model.state_dict().items() if k not in tied}
    where = f"init_from={path}"
    missing = sorted(set(expected) - set(weights.tensors))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: the weights have no {missing[0]}{more}, which the model has: "
                         "init_from loads weights only, so model.config must match the one they were trained with")
    unexpected = sorted(set(weights.tensors) - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(f"{where}: the weights hold {unexpected[0]}{more}, which the model has not: "
                         "model.config must match the one they were trained with")
    for name, target in expected.items():
        value = weights.tensors[name]
        if value.shape != target.shape:
            raise ValueError(f"{where}: {name} has shape {list(value.shape)} there but {list(target.shape)} in the "
                             "model: model.config must match the one the weights were trained with")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{where}: {name} holds non-finite values")
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(weights.tensors[name].to(dtype=target.dtype, device=target.device))
    return weights


def export_run(run_dir: str | Path, out: str | Path, checkpoint: str | None = None) -> tuple[Path, Path]:
    """Write the newest intact checkpoint of ``run_dir`` (or ``checkpoint``) as an HF-format folder
    at ``out`` (new or empty); returns ``(checkpoint read, out)``."""
    from nemo_dsa.models.dsa_lm.hf_format import write_hf_folder

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"out={out}: exists and is not an empty directory; pick a new folder")
    if checkpoint:
        source = Path(checkpoint)
        if not (source / MANIFEST_FILE).is_file():
            raise FileNotFoundError(f"checkpoint={checkpoint}: not a checkpoint directory (no {MANIFEST_FILE})")
        verify_checkpoint(source)
    else:
        if not (Path(run_dir) / "checkpoints").is_dir():
            raise FileNotFoundError(f"run_dir={run_dir}: no checkpoints/ (not a directory written by nemo-dsa-train)")
        source = _newest_intact(Path(run_dir), "run_dir")
    weights = read_weights(source, "checkpoint" if checkpoint else "run_dir")
    config = checkpoint_model_config(source, "checkpoint" if checkpoint else "run_dir")
    write_hf_folder(weights.tensors, config, out)
    return source, out
