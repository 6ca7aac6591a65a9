"""Train state and checkpoints: atomic, checksummed, verified on resume.

``checkpoints/step_XXXXXXX/`` holds ``model.safetensors`` (DeepSeek-V4 key names),
``trainer_state.pt`` (optimizer, scheduler, RNG states, data position, step, recipe, logging window,
skipped-step count) and ``manifest.json`` (sha256 and size of each file), written last. A save goes
to ``.tmp-step_XXXXXXX/``, every file fsynced, then one rename: a directory named ``step_*``
is complete by construction, and its manifest proves its bytes are the ones written.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from nemo_dsa.recipe.files import TMP_PREFIX, atomic_write, fsync_dir, fsync_file

CHECKPOINT_PREFIX = "step_"
STATE_FILE = "trainer_state.pt"
MANIFEST_FILE = "manifest.json"


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files are missing, truncated or altered (named in the message)."""


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_step(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX):])


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Every ``step_*`` directory, oldest first (complete or not: ``verify_checkpoint`` says)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir() and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=checkpoint_step)


def clean_failed_saves(run_dir: Path) -> list[Path]:
    """Remove the ``.tmp-step*`` leftovers of saves that did not finish; returns what was removed."""
    root = Path(run_dir) / "checkpoints"
    leftovers = sorted(root.glob(f"{TMP_PREFIX}{CHECKPOINT_PREFIX}*")) if root.is_dir() else []
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(path: Path) -> None:
    """Raise ``CorruptCheckpoint`` naming ``path`` and the bad file, unless every file matches the manifest."""
    manifest_path = path / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {path} has no {MANIFEST_FILE} (an unfinished or pre-manifest save)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"checkpoint {path}: unreadable {MANIFEST_FILE} ({e})") from None
    if not isinstance(files, dict) or not files:
        raise CorruptCheckpoint(f"checkpoint {path}: {MANIFEST_FILE} lists no files")
    for name, entry in files.items():
        file = path / name
        try:  # OSError: the file vanished meanwhile (another rank set the checkpoint aside)
            size = file.stat().st_size
            digest = _sha256(file) if size == entry["size"] else None
        except OSError:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} is missing") from None
        if size != entry["size"]:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} has {size} bytes, the manifest says {entry['size']} (truncated?)")
        if digest != entry["sha256"]:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} does not match its sha256 in {MANIFEST_FILE} (corrupted)")


def weights_are_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def save_checkpoint(run_dir: Path, step: int, model, optimizer, schedule, stream, state: dict, keep: int) -> Path:
    """Write ``checkpoints/step_<step>/`` atomically with its manifest and prune to the newest ``keep``.

    ``state``: the rest of the train state (``model_config``, ``recipe``, ``log_window``,
    ``skipped_steps``). Non-finite weights are never saved (``FloatingPointError``).
    """
    from nemo_dsa.models.dsa_lm.checkpoint import save_checkpoint as save_weights

    if not weights_are_finite(model):
        raise FloatingPointError(f"step {step}: the model holds non-finite weights; not checkpointing them")
    root = Path(run_dir) / "checkpoints"
    final = root / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = root / f"{TMP_PREFIX}{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_weights(model, tmp)  # model.safetensors with the DeepSeek-V4 key names
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": schedule.state_dict(),
                    "rng": rng_state(), "data": stream.state_dict(), **state}, tmp / STATE_FILE)
        files = {}
        for file in sorted(tmp.iterdir()):
            fsync_file(file)
            files[file.name] = {"sha256": _sha256(file), "size": file.stat().st_size}
        atomic_write(tmp / MANIFEST_FILE, json.dumps({"step": step, "files": files}, indent=1) + "\n")
        if final.exists():  # a rerun of a step already saved (e.g. after a fallback)
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed save (disk full, kill) leaves nothing behind
        raise
    older = [p for p in list_checkpoints(run_dir) if p != final]
    for old in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old)
    return final


def set_aside(path: Path) -> Path:
    """Rename a bad checkpoint to ``corrupt-step_*`` (kept for inspection, never resumed or pruned)."""
    target = path.with_name(f"corrupt-{path.name}")
    shutil.rmtree(target, ignore_errors=True)
    path.rename(target)
    return target


def read_state(path: Path) -> dict:
    """The verified train state of checkpoint ``path`` (``CorruptCheckpoint`` if it is not intact)."""
    verify_checkpoint(path)
    try:
        return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - intact bytes that do not load are still a bad checkpoint
        raise CorruptCheckpoint(f"checkpoint {path}: {STATE_FILE} does not load ({type(e).__name__}: {e})") from None


def restore(path: Path, state: dict, model, optimizer, schedule, stream) -> None:
    """Load what ``save_checkpoint`` wrote into the live objects (``state`` from ``read_state``)."""
    from nemo_dsa.models.dsa_lm.checkpoint import load_checkpoint as load_weights

    load_weights(model, path, strict=True)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["scheduler"])
    stream.load_state_dict(state["data"])
    set_rng_state(state["rng"])
