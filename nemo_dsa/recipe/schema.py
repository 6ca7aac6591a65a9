"""The recipe's config schema, its composition from ``configs/`` and the rules its values obey.

``RecipeConfig`` is registered in Hydra's ConfigStore as ``recipe/schema``; every
``configs/recipe/*.yaml`` extends it (``defaults: [schema, _self_]``), so Hydra itself rejects an
unknown key (``recipe.max_stepz=5``, also with ``+``) or a value of the wrong type. The values live
in the YAML files; the schema holds only the types. ``check_recipe`` adds the rules a type cannot say.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import List, Optional  # noqa: UP035 - OmegaConf reads these annotations at runtime

from omegaconf import MISSING

from nemo_dsa._checks import is_positive_int

PRECISIONS = ("fp32", "bf16")
# Warnings go through logging, not the warnings module: patching warnings.showwarning would change
# the embedded corpus, which is built from the standard library's own functions (warnings included).
log = logging.getLogger("nemo_dsa.recipe")


@dataclass
class RecipeConfig:
    """The ``recipe`` node (``configs/recipe/default.yaml`` documents each key)."""

    name: str = MISSING
    seq_len: int = MISSING
    batch_size: int = MISSING
    max_steps: int = MISSING
    lr: float = MISSING
    min_lr_ratio: float = MISSING
    warmup_steps: int = MISSING
    weight_decay: float = MISSING
    betas: List[float] = MISSING  # noqa: UP006
    grad_clip: Optional[float] = MISSING  # noqa: UP045
    precision: str = MISSING
    log_every: int = MISSING
    val_every: int = MISSING
    val_batches: int = MISSING
    val_percent: int = MISSING
    min_piece: int = MISSING
    ckpt_every: int = MISSING
    keep_checkpoints: int = MISSING
    stop_at_step: Optional[int] = MISSING  # noqa: UP045
    num_threads: Optional[int] = MISSING  # noqa: UP045
    cp_size: int = MISSING
    dp_size: int = MISSING
    max_skipped_steps: int = MISSING
    dist_timeout_s: float = MISSING
    progress_bar: bool = MISSING
    plot: bool = MISSING


@dataclass
class DataConfig:
    """The ``data`` node: where the documents come from (``nemo_dsa.recipe.data_sources``)."""

    name: str = MISSING
    source: str = MISSING  # stdlib | text | jsonl | hf
    paths: List[str] = field(default_factory=list)  # noqa: UP006 - text / jsonl: files, directories, globs
    text_key: str = "text"  # jsonl / hf: the field holding each document's text
    separator: Optional[str] = None  # noqa: UP045 - text: split each file into documents here (null: one per file)
    dataset: Optional[str] = None  # noqa: UP045 - hf: a save_to_disk directory or a dataset in the local cache
    dataset_config: Optional[str] = None  # noqa: UP045 - hf: the dataset's configuration name, if it has several
    split: str = "train"  # hf: the split to read


@dataclass
class TokenizerConfig:
    """The ``tokenizer`` node: ``byte`` (built in) or ``hf`` (a ``tokenizers`` file at ``path``)."""

    name: str = MISSING
    kind: str = MISSING  # byte | hf
    path: Optional[str] = None  # noqa: UP045 - hf: tokenizer.json or a directory holding one
    bos_token: Optional[str] = None  # noqa: UP045 - null: the directory's tokenizer_config.json (or none)
    eos_token: Optional[str] = None  # noqa: UP045
    pad_token: Optional[str] = None  # noqa: UP045 - null: tokenizer_config.json, else EOS


@dataclass
class LoggerConfig:
    """The ``logger`` node: ``metrics.jsonl`` always; TensorBoard scalars too with ``logger=tensorboard``."""

    name: str = MISSING
    tensorboard: bool = False
    log_dir: str = "tensorboard"  # under run_dir


RECIPE_KEYS = tuple(f.name for f in fields(RecipeConfig))
SCHEMAS = {"recipe": RecipeConfig, "data": DataConfig, "tokenizer": TokenizerConfig, "logger": LoggerConfig}

# Keys a resumed run may change: they take effect from the resumed step on (and are logged).
# Changing any other key (seq_len, batch_size, val_percent, min_piece: the data stream and the
# validation set) cannot take effect on a checkpoint and is refused, naming the keys.
RESUME_APPLIES = frozenset({
    "name", "max_steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "betas", "grad_clip", "precision",
    "log_every", "val_every", "val_batches", "ckpt_every", "keep_checkpoints", "stop_at_step", "num_threads",
    "cp_size", "dp_size", "max_skipped_steps", "dist_timeout_s", "progress_bar", "plot",
})


# How this invocation runs, not what it trains: not reported as changes on resume.
RESUME_IGNORES = frozenset({"stop_at_step", "progress_bar"})


def register_schemas() -> None:
    """Put the schemas in Hydra's ConfigStore (idempotent; ``load_config`` calls it)."""
    from hydra.core.config_store import ConfigStore

    for group, node in SCHEMAS.items():
        ConfigStore.instance().store(group=group, name="schema", node=node)


def load_config(overrides: Sequence[str] = (), config_dir: str | os.PathLike | None = None):
    """Compose ``train.yaml`` with Hydra overrides such as ``["scoring=v41", "recipe.max_steps=20"]``."""
    from hydra import compose, initialize_config_dir

    from nemo_dsa.builder import config_dir as default_config_dir

    register_schemas()
    path = Path(config_dir) if config_dir is not None else default_config_dir()
    with initialize_config_dir(version_base=None, config_dir=str(path.resolve()), job_name="nemo_dsa_train"):
        cfg = compose(config_name="train", overrides=list(overrides))
    for group in SCHEMAS:
        check_known_keys(cfg[group], group)
    return cfg


def check_known_keys(node, group: str = "recipe") -> None:
    """Refuse keys the schema does not have: Hydra's ``+recipe.key=...`` adds them past the schema."""
    import difflib

    known = tuple(f.name for f in fields(SCHEMAS[group]))
    for key in node.keys():
        if key not in known:
            match = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
            hint = f" (did you mean {match[0]}?)" if match else ""
            raise ValueError(f"{group}.{key}: no such key in {group}{hint}; keys: {', '.join(known)}")


def check_recipe(recipe) -> None:
    """Fail before any work, naming the key: the rules the schema's types do not express."""
    problems = []
    positive = (
        "batch_size", "max_steps", "log_every", "val_every", "ckpt_every", "keep_checkpoints", "cp_size", "dp_size",
    )
    problems += [f"recipe.{k} must be an int >= 1, got {recipe[k]!r}" for k in positive if not is_positive_int(recipe[k])]
    problems += [f"recipe.{k} must be an int >= 0, got {recipe[k]!r}"
                 for k in ("warmup_steps", "val_batches", "max_skipped_steps") if not is_positive_int(recipe[k], minimum=0)]
    if not is_positive_int(recipe.seq_len, minimum=2):
        problems.append(f"recipe.seq_len must be an int >= 2 (a token and the next one it predicts), got {recipe.seq_len!r}")
    elif not is_positive_int(recipe.min_piece, minimum=2) or recipe.min_piece > recipe.seq_len:
        problems.append(f"recipe.min_piece must be an int in [2, recipe.seq_len={recipe.seq_len}] (the shortest document "
                        f"piece a row starts), got {recipe.min_piece!r}: lower recipe.min_piece or raise recipe.seq_len")
    if recipe.val_percent == 0 and is_positive_int(recipe.val_batches):
        problems.append(f"recipe.val_percent=0 holds out no validation documents, but recipe.val_batches="
                        f"{recipe.val_batches} evaluates on them: set recipe.val_percent (e.g. 5) or recipe.val_batches=0")
    if not recipe.lr > 0:
        problems.append(f"recipe.lr must be > 0, got {recipe.lr}")
    if not 0 <= recipe.min_lr_ratio <= 1:
        problems.append(f"recipe.min_lr_ratio must be in [0, 1], got {recipe.min_lr_ratio}")
    if not 0 <= recipe.val_percent < 100:
        problems.append(f"recipe.val_percent must be in [0, 100), got {recipe.val_percent}")
    if len(recipe.betas) != 2 or not all(0 <= b < 1 for b in recipe.betas):
        problems.append(f"recipe.betas must be two numbers in [0, 1), got {list(recipe.betas)}")
    if recipe.precision not in PRECISIONS:
        problems.append(f"recipe.precision must be one of {PRECISIONS}, got {recipe.precision!r}")
    if recipe.grad_clip is not None and not recipe.grad_clip > 0:
        problems.append(f"recipe.grad_clip must be > 0 (null = no clipping), got {recipe.grad_clip}")
    if recipe.stop_at_step is not None and not 1 <= recipe.stop_at_step <= recipe.max_steps:
        problems.append(f"recipe.stop_at_step must be in [1, recipe.max_steps], got {recipe.stop_at_step}")
    if not recipe.dist_timeout_s > 0:
        problems.append(f"recipe.dist_timeout_s must be > 0 seconds, got {recipe.dist_timeout_s}")
    if recipe.num_threads is not None and not is_positive_int(recipe.num_threads):
        problems.append(f"recipe.num_threads must be an int >= 1 or null, got {recipe.num_threads!r}")
    if is_positive_int(recipe.dp_size) and is_positive_int(recipe.batch_size) and recipe.batch_size % recipe.dp_size:
        problems.append(f"recipe.batch_size={recipe.batch_size} must be a multiple of recipe.dp_size={recipe.dp_size} "
                        "(each data-parallel rank trains on batch_size / dp_size rows)")
    if problems:
        raise ValueError("; ".join(problems))
    if recipe.max_steps <= recipe.warmup_steps:
        log.warning(
            "recipe.max_steps=%s <= recipe.warmup_steps=%s: the learning rate never reaches its cosine decay",
            recipe.max_steps, recipe.warmup_steps,
        )


def recipe_changes(saved: dict, current: dict) -> tuple[dict[str, tuple], list[str]]:
    """Compare a checkpoint's recipe with this run's: ``(applied {key: (old, new)}, refused keys)``."""
    changed = {k: (saved.get(k), current.get(k)) for k in sorted(set(saved) | set(current))
               if saved.get(k) != current.get(k) and k not in RESUME_IGNORES}
    refused = [k for k in changed if k not in RESUME_APPLIES]
    return {k: v for k, v in changed.items() if k in RESUME_APPLIES}, refused


# Bytes a batch row's token takes in the int64 tensors packing and the model inputs hold
# (input_ids, labels, position_ids, packed_seq_ids, attention_mask, ...).
BATCH_BYTES_PER_TOKEN = 8 * 8


def available_memory(device) -> int | None:
    """Free bytes on ``device`` (a CUDA device's, or the host's MemAvailable); None if unknown."""
    import torch

    if getattr(device, "type", device) == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_memory(what: str, needed: int, device) -> None:
    """ValueError naming ``what`` (the keys that size it) when ``needed`` bytes exceed the free
    memory of ``device``: said before anything is allocated, not an allocator's message later."""
    free = available_memory(device)
    if free is not None and needed > free:
        raise ValueError(f"{what} need {gib(needed)} of memory, more than the {gib(free)} free on {device}")


def check_batch_memory(batch_size: int, seq_len: int, batches: int, device, *, keys: str) -> None:
    """``batches`` packed batches of ``batch_size`` x ``seq_len`` tokens must fit in memory (``keys``: the keys)."""
    check_memory(f"{keys} ({batches:,} batches of {batch_size:,} x {seq_len:,} tokens)",
                 BATCH_BYTES_PER_TOKEN * batch_size * seq_len * batches, "cpu")
