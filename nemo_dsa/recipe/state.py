"""Train state and checkpoints: atomic, checksummed, verified on resume.

``checkpoints/step_XXXXXXX/`` holds ``model.safetensors`` (DeepSeek-V4 key names),
``trainer_state.pt`` (optimizer, scheduler, RNG states, data position, step, recipe, logging window,
skipped-step count) and ``manifest.json`` (sha256 and size of each file), written last. A save goes
to ``.tmp-step_XXXXXXX/``, every file fsynced, then one rename: a directory named ``step_*``
is complete by construction, and its manifest proves its bytes are the ones written.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from nemo_dsa._untrusted import UntrustedFile, file_digest, open_regular, read_json
from nemo_dsa.recipe.files import TMP_PREFIX, atomic_write, fsync_dir, fsync_file

CHECKPOINT_PREFIX = "step_"
# A step saved again is first renamed to this name, then the new one renamed in, then this deleted:
# a kill at any moment leaves one intact ``step_*`` or this intact copy, which the next run renames back.
REPLACED_PREFIX = ".replaced-"
ABANDONED_PREFIX = "abandoned-"
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


def clean_failed_saves(run_dir: Path) -> tuple[list[Path], list[Path]]:
    """Finish what a killed save left: ``(removed, restored)``.

    ``.tmp-step*`` (a save that never got its final name) is removed. ``.replaced-step_N`` is the
    previous copy of a step being saved again: if ``step_N`` is missing (killed between the two
    renames) it is renamed back, otherwise (killed before deleting it) it is removed.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return [], []
    removed, restored = sorted(root.glob(f"{TMP_PREFIX}{CHECKPOINT_PREFIX}*")), []
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    for old in sorted(root.glob(f"{REPLACED_PREFIX}{CHECKPOINT_PREFIX}*")):
        final = root / old.name[len(REPLACED_PREFIX):]
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
        else:
            os.rename(old, final)
            restored.append(final)
    if restored:
        fsync_dir(root)
    return removed, restored


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest_files(path: Path) -> dict[str, dict]:
    """The ``files`` mapping of ``path``'s manifest, its structure checked (``CorruptCheckpoint`` naming the file).

    The manifest is read as a file of a folder from someone else (``nemo_dsa._untrusted``): a
    regular file (no symbolic link, FIFO or device), at most ``JSON_LIMIT`` bytes, no nesting
    deeper than JSON is read."""
    manifest_path = path / MANIFEST_FILE
    try:
        manifest = read_json(manifest_path)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {path} has no {MANIFEST_FILE} (an unfinished or pre-manifest save)") from None
    except (OSError, ValueError) as e:  # UntrustedFile is a ValueError
        raise CorruptCheckpoint(f"checkpoint {path}: {manifest_path} is unreadable ({e})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise CorruptCheckpoint(f"checkpoint {path}: {manifest_path} is not a manifest (expected an object whose "
                                "'files' maps file names to {'sha256': ..., 'size': ...})")
    for name, entry in files.items():
        # A plain name: the manifest is read from the checkpoint, so it may not point outside it.
        if name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
            raise CorruptCheckpoint(f"checkpoint {path}: {manifest_path} names {name!r}, not a file of the checkpoint")
        size, digest = (entry.get("size"), entry.get("sha256")) if isinstance(entry, dict) else (None, None)
        if type(size) is not int or not isinstance(digest, str):
            raise CorruptCheckpoint(f"checkpoint {path}: {manifest_path} entry {name!r} is not "
                                    "{'sha256': <hex digest>, 'size': <bytes>}")
    if STATE_FILE not in files:
        raise CorruptCheckpoint(f"checkpoint {path}: {manifest_path} does not list {STATE_FILE}")
    return files


def verify_checkpoint(path: Path) -> None:
    """Raise ``CorruptCheckpoint`` naming ``path`` and the bad file, unless every file matches the manifest.

    Each file is opened without following a symbolic link and without blocking, and must be a
    regular file (a link to ``/dev/zero`` or a FIFO is refused, never read); exactly the bytes
    ``fstat`` counts are hashed."""
    for name, entry in _manifest_files(path).items():
        file = path / name
        try:  # FileNotFoundError: the file vanished meanwhile (another rank set the checkpoint aside)
            size, digest = file_digest(file, entry["size"])
        except UntrustedFile as e:
            raise CorruptCheckpoint(f"checkpoint {path}: {e}") from None
        except OSError:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} is missing") from None
        if size != entry["size"]:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} has {size} bytes, the manifest says {entry['size']} (truncated?)")
        if digest != entry["sha256"]:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} does not match its sha256 in {MANIFEST_FILE} (corrupted)")


def weights_are_finite(model: torch.nn.Module, tensors: dict[str, torch.Tensor] | None = None) -> bool:
    values = model.parameters() if tensors is None else tensors.values()
    return all(bool(torch.isfinite(p).all()) for p in values)


class _GatheredWeights:
    """What ``save_weights`` reads of a model (``state_dict()``, ``config``), for gathered full tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], config) -> None:
        self._tensors, self.config = tensors, config

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._tensors


def _parameter_order(model, optimizer) -> list[str]:
    """Parameter names in the optimizer's order: the integer ids of ``Optimizer.state_dict()``."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def gather_full_state(model, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """The full (unsharded) weights and optimizer state of an FSDP2 model, on CPU, in the formats a
    single process saves (the optimizer's keyed by integer ids), so a checkpoint resumes on any
    number of ranks. A collective: every rank calls it; only rank 0's return values hold data."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    by_name = get_optimizer_state_dict(model, optimizer, options=options)
    if not weights:
        return {}, {}
    index = {name: i for i, name in enumerate(_parameter_order(model, optimizer))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]]
    return weights, {"state": {index[n]: v for n, v in by_name["state"].items()}, "param_groups": groups}


def write_state_file(path: Path, state: dict) -> None:
    """``state`` in ``torch.save``'s format, serialised in memory and then written: a full disk is
    then the OSError of the write (``torch.save``'s own file writer reports it as a RuntimeError
    that does not name the cause)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())


def save_checkpoint(run_dir: Path, step: int, model, optimizer, schedule, stream, state: dict, keep: int, *,
                    gathered: tuple[dict, dict] | None = None) -> Path:
    """Write ``checkpoints/step_<step>/`` atomically with its manifest and prune to the newest ``keep``.

    ``state``: the rest of the train state (``model_config``, ``recipe``, ``log_window``,
    ``skipped_steps``). ``gathered``: ``gather_full_state``'s weights and optimizer state of a
    sharded model. Non-finite weights are never saved (``FloatingPointError``).
    """
    from nemo_dsa.models.dsa_lm.checkpoint import save_checkpoint as save_weights

    if gathered is not None:
        model, optimizer_state = _GatheredWeights(gathered[0], model.config), gathered[1]
    else:
        optimizer_state = optimizer.state_dict() if optimizer is not None else None
    if not weights_are_finite(model, gathered[0] if gathered is not None else None):
        raise FloatingPointError(f"step {step}: the model holds non-finite weights; not checkpointing them")
    root = Path(run_dir) / "checkpoints"
    final = root / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = root / f"{TMP_PREFIX}{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_weights(model, tmp)  # model.safetensors with the DeepSeek-V4 key names
        write_state_file(tmp / STATE_FILE, {"step": step, "optimizer": optimizer_state, "scheduler": schedule.state_dict(),
                                            "rng": rng_state(), "data": stream.state_dict(), **state})
        files = {}
        for file in sorted(tmp.iterdir()):
            fsync_file(file)
            files[file.name] = {"sha256": _sha256(file), "size": file.stat().st_size}
        atomic_write(tmp / MANIFEST_FILE, json.dumps({"step": step, "files": files}, indent=1) + "\n")
        replaced = root / f"{REPLACED_PREFIX}{final.name}"
        if final.exists():  # a step saved again: set the old copy aside until the new one is in place
            if replaced.exists():  # a stale copy (clean_failed_saves removes these at start)
                shutil.rmtree(replaced)
            os.rename(final, replaced)
            fsync_dir(root)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed save (disk full, kill) leaves nothing behind
        if (root / f"{REPLACED_PREFIX}{final.name}").exists() and not final.exists():
            os.rename(root / f"{REPLACED_PREFIX}{final.name}", final)
        raise
    if replaced.exists():
        shutil.rmtree(replaced)  # only now: the new copy is durable under its name
    older = [p for p in list_checkpoints(run_dir) if p != final]
    for old in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old)
    return final


def set_aside(path: Path, prefix: str = "corrupt-") -> Path:
    """Rename a checkpoint to ``<prefix>step_*`` (kept for inspection, never resumed or pruned).

    An earlier one of the same name is kept too: the new name gets a ``.2``, ``.3``, ... suffix.
    """
    target = path.with_name(f"{prefix}{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{prefix}{path.name}.{n}")
    os.rename(path, target)
    fsync_dir(path.parent)
    return target


def abandon_newer(run_dir: Path, step: int) -> list[Path]:
    """Set aside the checkpoints of ``run_dir`` newer than ``step`` as ``abandoned-step_*``.

    Called after resuming from an older checkpoint: those belong to the run being replaced, and
    a later ``resume=auto`` must not pick them over the new run's own. Returns the new names.
    """
    return [set_aside(p, ABANDONED_PREFIX) for p in list_checkpoints(run_dir) if checkpoint_step(p) > step]


def read_state(path: Path) -> dict:
    """The verified train state of checkpoint ``path`` (``CorruptCheckpoint`` if it is not intact).

    Loaded with ``weights_only=True``: tensors and plain data only (what ``save_checkpoint``
    writes), so a run directory from someone else cannot run code here. Its manifest proves
    nothing against that: a sha256 is recomputed as easily as the file is edited.
    """
    verify_checkpoint(path)
    try:
        fd, _ = open_regular(path / STATE_FILE)  # the file verified: regular, no link
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"checkpoint {path}: {STATE_FILE} cannot be read ({e})") from None
    try:
        with os.fdopen(fd, "rb") as f:
            state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CorruptCheckpoint(f"checkpoint {path}: {STATE_FILE} holds objects other than tensors and plain data; "
                                "refused (loading them could run code)") from None
    except Exception as e:  # noqa: BLE001 - intact bytes that do not load are still a bad checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CorruptCheckpoint(f"checkpoint {path}: {STATE_FILE} does not load ({type(e).__name__}: {first})") from None
    if not isinstance(state, dict):
        raise CorruptCheckpoint(f"checkpoint {path}: {STATE_FILE} holds a {type(state).__name__}, not a train state")
    return state


def restore(path: Path, state: dict, model, optimizer, schedule, stream, *, sharded: bool = False) -> None:
    """Load what ``save_checkpoint`` wrote into the live objects (``state`` from ``read_state``).

    ``sharded``: the model is FSDP2-sharded; every rank reads the full checkpoint and keeps its shard
    (whatever number of ranks wrote it).
    """
    from nemo_dsa.models.dsa_lm.checkpoint import load_checkpoint as load_weights

    if sharded:
        _restore_sharded(path, state["optimizer"], model, optimizer)
    else:
        load_weights(model, path, strict=True)
        optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["scheduler"])
    stream.load_state_dict(state["data"])
    set_rng_state(state["rng"])


def _restore_sharded(path: Path, optimizer_state: dict, model, optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    from nemo_dsa.models.dsa_lm.checkpoint import read_checkpoint

    tensors = read_checkpoint(path)
    tied = {"head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
    expected = set(model.state_dict()) - tied
    if set(tensors) != expected:
        raise ValueError(f"checkpoint {path} keys do not match the model: missing {sorted(expected - set(tensors))[:8]}, "
                         f"unexpected {sorted(set(tensors) - expected)[:8]}")
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, tensors, options=options)
    order = _parameter_order(model, optimizer)
    by_name = {"state": {order[i]: v for i, v in optimizer_state["state"].items()},
               "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in optimizer_state["param_groups"]]}
    # Not strict: a parameter no loss term reaches has no optimizer state, as in one process.
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True, strict=False))
