"""The nemo_dsa training recipe: Hydra-composed configs, offline corpus, exact resume.

    python -m nemo_dsa.train                        # tiny model, V4 scoring, CPU, 200 steps
    nemo-dsa-train scoring=v41 recipe.max_steps=20  # any Hydra override
    nemo-dsa-train device=cuda model=small recipe=h200
    nemo-dsa-train --print-config scoring=v41       # show the composed config and exit

Configs are composed from ``configs/`` (``$NEMO_DSA_CONFIG_DIR`` or the checkout root, see
``nemo_dsa.builder.config_dir``). A run writes into ``run_dir``:
``metrics.jsonl`` (train loss, lr, grad norm, tokens/s; validation loss), ``loss.png``,
``config.yaml``, ``summary.json`` and ``checkpoints/step_XXXXXXX/`` (model weights, optimizer,
scheduler, RNG states, data position, step). Restarting with the same ``run_dir`` continues from
the newest checkpoint and reproduces the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nemo_dsa._checks import is_positive_int
from nemo_dsa.labels import IGNORE_INDEX

# The batch fields handed to the model: exactly what nemo-automodel's THD collater emits
# (document-local positions, seq_lens / seq_lens_padded) plus the per-token document ids and mask.
MODEL_INPUTS = (
    "input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded", "packed_seq_ids", "attention_mask",
)
CHECKPOINT_PREFIX = "step_"
STATE_FILE = "trainer_state.pt"


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def load_config(overrides: Sequence[str] = (), config_dir: str | os.PathLike | None = None):
    """Compose ``train.yaml`` with Hydra overrides such as ``["scoring=v41", "recipe.max_steps=20"]``."""
    from hydra import compose, initialize_config_dir

    from nemo_dsa.builder import config_dir as default_config_dir

    path = Path(config_dir) if config_dir is not None else default_config_dir()
    with initialize_config_dir(version_base=None, config_dir=str(path.resolve()), job_name="nemo_dsa_train"):
        return compose(config_name="train", overrides=list(overrides))


def _check_recipe(recipe, known_keys=None) -> None:
    """Fail before any work, naming the recipe key.

    ``known_keys``: the keys of the default recipe; anything else is a typo (Hydra would accept a
    misspelt ``+recipe.max_step=2`` and the run would silently ignore it).
    """
    if known_keys is not None:
        unknown = sorted(set(recipe.keys()) - set(known_keys))
        if unknown:
            raise ValueError(f"recipe has unknown key(s) {unknown}; known keys: {sorted(known_keys)}")
    positive = (
        "seq_len", "batch_size", "max_steps", "log_every", "val_every", "ckpt_every", "keep_checkpoints", "cp_size",
    )
    for key in positive:
        value = recipe[key]
        if not is_positive_int(value):
            raise ValueError(f"recipe.{key} must be an int >= 1, got {value!r}")
    for key in ("warmup_steps", "val_batches"):
        if not is_positive_int(recipe[key], minimum=0):
            raise ValueError(f"recipe.{key} must be an int >= 0, got {recipe[key]!r}")
    if not recipe.lr > 0:
        raise ValueError(f"recipe.lr must be > 0, got {recipe.lr}")
    if not 0 <= recipe.min_lr_ratio <= 1:
        raise ValueError(f"recipe.min_lr_ratio must be in [0, 1], got {recipe.min_lr_ratio}")
    if recipe.precision not in ("fp32", "bf16"):
        raise ValueError(f"recipe.precision must be 'fp32' or 'bf16', got {recipe.precision!r}")
    if recipe.grad_clip is not None and not recipe.grad_clip > 0:
        raise ValueError(f"recipe.grad_clip must be > 0 (null = no clipping), got {recipe.grad_clip}")
    if recipe.stop_at_step is not None and not 1 <= recipe.stop_at_step <= recipe.max_steps:
        raise ValueError(f"recipe.stop_at_step must be in [1, recipe.max_steps], got {recipe.stop_at_step}")


def _default_recipe_keys() -> set[str] | None:
    """Keys of ``configs/recipe/default.yaml`` (every recipe extends it); None if it is absent."""
    from omegaconf import OmegaConf

    from nemo_dsa.builder import config_dir

    path = config_dir() / "recipe" / "default.yaml"
    return set(OmegaConf.load(path).keys()) if path.is_file() else None


# ---------------------------------------------------------------------------------------------
# Optimisation
# ---------------------------------------------------------------------------------------------


def warmup_cosine(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier for optimizer step ``step`` (0-based): linear warmup, then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, recipe) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with weight decay on matrices only, and the warmup+cosine schedule."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr, betas=tuple(recipe.betas),
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: warmup_cosine(
            s, warmup_steps=recipe.warmup_steps, max_steps=recipe.max_steps, min_lr_ratio=recipe.min_lr_ratio
        ),
    )
    return optimizer, schedule


# ---------------------------------------------------------------------------------------------
# Context parallelism hook
# ---------------------------------------------------------------------------------------------


@dataclass
class Parallel:
    """Where this process sits: CP rank/size and the group handed to the model (None = no CP)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_parallel(cp_size: int) -> Parallel:
    """cp_size 1: nothing. cp_size > 1: join the torchrun job; every rank is one CP shard.

    The recipe has no data parallelism: the world is one CP group of ``cp_size`` ranks, each
    holding a contiguous sequence shard of every row (``nemo_dsa.distributed.shard_batch``); the
    model's attention reaches the other ranks through the ``cp_group`` passed to its forward.
    """
    if cp_size == 1:
        return Parallel()
    if "WORLD_SIZE" not in os.environ:
        raise ValueError(
            f"recipe.cp_size={cp_size} needs a torchrun launch: "
            f"torchrun --nproc-per-node={cp_size} -m nemo_dsa.train recipe.cp_size={cp_size} ..."
        )
    from nemo_dsa.distributed import init_from_env

    world = int(os.environ["WORLD_SIZE"])
    if world != cp_size:
        raise ValueError(f"recipe.cp_size={cp_size} must equal the torchrun world size {world} (no data parallelism)")
    env = init_from_env(cp_size)
    return Parallel(rank=env.cp_rank, size=env.cp_size, group=env.cp_group)


# ---------------------------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------------------------


def _model_inputs(batch: dict[str, torch.Tensor], device: torch.device, par: Parallel, ratios) -> dict[str, Any]:
    batch = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    if par.group is not None:
        from nemo_dsa.data import PAD_ID
        from nemo_dsa.distributed import shard_batch

        batch = shard_batch(batch, par.group, compress_ratios=ratios, pad_token_id=PAD_ID)
    inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if par.group is not None:
        inputs["cp_group"] = par.group
    return inputs


def _loss_terms(model, inputs: dict[str, Any], precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of token LM losses, this rank's share of the indexer loss, labelled-token count)."""
    count = (inputs["labels"] != IGNORE_INDEX).sum()
    with torch.autocast(inputs["input_ids"].device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = model(**inputs)
    if out.lm_loss is None:
        raise RuntimeError("the model returned no loss although labels were given")
    aux = out.aux_loss.float() if out.aux_loss is not None else torch.zeros((), device=count.device)
    return out.lm_loss.float() * count, aux, count


def _global(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    if par.group is None:
        return x
    import torch.distributed as dist

    x = x.detach().clone()
    dist.all_reduce(x, group=par.group)
    return x


def train_step(model, optimizer, schedule, batch, *, recipe, device, par: Parallel) -> dict[str, float]:
    """One optimizer step over one batch; returns loss, lr, grad norm and token count."""
    inputs = _model_inputs(batch, device, par, model.config.compress_ratios)
    loss_sum, aux, count = _loss_terms(model, inputs, recipe.precision)
    total = _global(count.float(), par).clamp_min(1)
    # Normalise the LM loss by the global token count, so summing rank gradients gives the global
    # mean's; the indexer loss is already this rank's share of the global one (see the model).
    (loss_sum / total + aux).backward()
    if par.group is not None:
        import torch.distributed as dist

        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=par.group)
    max_norm = float("inf") if recipe.grad_clip is None else recipe.grad_clip  # inf: measure, do not clip
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    schedule.step()
    loss = _global(loss_sum.detach(), par) / total + _global(aux.detach(), par)
    return {"loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(), "tokens": int(batch["attention_mask"].sum())}


@torch.no_grad()
def evaluate(model, batches, *, recipe, device, par: Parallel) -> float:
    """Token-weighted mean LM loss over fixed validation batches."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for batch in batches:
        inputs = _model_inputs(batch, device, par, model.config.compress_ratios)
        s, _, n = _loss_terms(model, inputs, recipe.precision)
        loss_sum += s
        count += n
    model.train(was_training)
    return (_global(loss_sum, par) / _global(count.float(), par).clamp_min(1)).item()


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints (the state file is written last), oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.glob(f"{CHECKPOINT_PREFIX}*") if (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]))


def save_checkpoint(
    run_dir: Path, step: int, model, optimizer, schedule, stream, model_config: dict, keep: int,
    log_window: dict | None = None,
) -> Path:
    """Write ``checkpoints/step_<step>/`` atomically (temp dir + rename) and prune old ones.

    ``log_window`` holds the steps since the last logged metrics record, so a run stopped
    mid-window logs the same averages after resuming as an uninterrupted one.
    """
    from nemo_dsa.models.dsa_lm.checkpoint import save_checkpoint as save_weights

    root = run_dir / "checkpoints"
    final = root / f"{CHECKPOINT_PREFIX}{step:07d}"
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_weights(model, tmp)  # model.safetensors with the DeepSeek-V4 key names
    torch.save(
        {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "scheduler": schedule.state_dict(),
            "rng": _rng_state(),
            "data": stream.state_dict(),
            "model_config": model_config,
            "log_window": log_window or {},
        },
        tmp / STATE_FILE,
    )
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in _checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


def load_checkpoint(path: Path, model, optimizer, schedule, stream, model_config: dict) -> tuple[int, dict]:
    """Restore everything ``save_checkpoint`` wrote; returns the step to continue from and the
    logging window it saved."""
    from nemo_dsa.models.dsa_lm.checkpoint import load_checkpoint as load_weights

    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    saved = state["model_config"]
    changed = sorted(k for k in set(saved) | set(model_config) if saved.get(k) != model_config.get(k))
    if changed:
        raise ValueError(f"resume: checkpoint {path} was trained with a different model config (keys {changed})")
    load_weights(model, path, strict=True)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["scheduler"])
    stream.load_state_dict(state["data"])
    _set_rng_state(state["rng"])
    return int(state["step"]), dict(state.get("log_window", {}))


# ---------------------------------------------------------------------------------------------
# Logging
# ---------------------------------------------------------------------------------------------


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records after ``step`` (written after the checkpoint we resume from)."""
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def plot_losses(metrics_path: Path, out_path: Path, title: str) -> None:
    """Train (and validation) loss against step, as a PNG (matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    resumed_from: int | None
    losses: list[float] = field(default_factory=list)  # the train losses logged by this process
    val_loss: float | None = None


def train(cfg) -> TrainResult:
    """Run the recipe described by a composed config (see ``load_config``)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from tqdm.auto import tqdm

    from nemo_dsa.data import VOCAB_SIZE, build_streams

    recipe = cfg.recipe
    _check_recipe(recipe, _default_recipe_keys())
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda was requested but no CUDA device is available")
    if recipe.precision == "bf16" and device.type != "cuda":
        raise ValueError("recipe.precision=bf16 runs on device=cuda only (CPU runs are fp32)")
    if recipe.num_threads:
        torch.set_num_threads(int(recipe.num_threads))
    par = setup_parallel(recipe.cp_size)
    if device.type == "cuda" and par.size > 1:
        device = torch.device("cuda", torch.cuda.current_device())  # init_from_env chose LOCAL_RANK
    run_dir = Path(cfg.run_dir)
    metrics_path = run_dir / "metrics.jsonl"

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)  # nemo_dsa.builder.build_model: fails here on a bad config
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(f"model {cfg.model.get('name')!r} is built on the meta device (a shape preset): "
                         "it cannot be trained; pick model=tiny or model=small")
    if model.config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"model.config.vocab_size must be >= {VOCAB_SIZE} (the byte tokenizer's vocabulary), "
                         f"got {model.config.vocab_size}")
    model_config = model.config.to_dict()
    model.to(device).train()
    optimizer, schedule = build_optimizer(model, recipe)
    stream, val_batches = build_streams(
        seq_len=recipe.seq_len, batch_size=recipe.batch_size, seed=cfg.seed,
        val_percent=recipe.val_percent, val_batches=recipe.val_batches, min_piece=recipe.min_piece,
    )

    start, resumed_from, saved_window = 0, None, {}
    existing = _checkpoints(run_dir)
    if cfg.resume == "never":
        if existing:
            raise ValueError(f"resume=never but {run_dir} already holds checkpoints: pick another run_dir")
    elif cfg.resume == "auto":
        if existing:
            resumed_from, saved_window = load_checkpoint(existing[-1], model, optimizer, schedule, stream, model_config)
    else:
        path = Path(cfg.resume)
        if not (path / STATE_FILE).is_file():
            raise ValueError(f"resume must be 'auto', 'never' or a checkpoint directory, got {cfg.resume!r}")
        resumed_from, saved_window = load_checkpoint(path, model, optimizer, schedule, stream, model_config)
    if resumed_from is not None:
        start = resumed_from
    if par.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if resumed_from is None:
            metrics_path.write_text("")
        else:
            _truncate_metrics(metrics_path, resumed_from)

    stop = recipe.stop_at_step or recipe.max_steps
    title = f"{cfg.model.name} / scoring {cfg.scoring.name} / {cfg.recipe.name}"
    result = TrainResult(run_dir=run_dir, step=start, resumed_from=resumed_from)
    n_params = sum(p.numel() for p in model.parameters())
    show_bar = recipe.progress_bar and par.is_main
    bar = tqdm(total=stop, initial=start, disable=not show_bar, dynamic_ncols=True, desc="train")
    # Steps since the last logged record (restored on resume, so a window spanning a stop
    # averages exactly what an uninterrupted run does).
    window_losses: list[float] = list(saved_window.get("losses", []))
    window_tokens, window_time = saved_window.get("tokens", 0), saved_window.get("time", 0.0)

    def log(record: dict) -> None:
        if par.is_main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    log({"step": start, "event": "resume" if resumed_from is not None else "start", "model": cfg.model.name,
         "scoring": cfg.scoring.name, "params": n_params, "device": str(device), "cp_size": par.size})
    for step in range(start + 1, stop + 1):
        tic = time.perf_counter()
        stats = train_step(model, optimizer, schedule, next(stream), recipe=recipe, device=device, par=par)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        window_time += time.perf_counter() - tic  # step time only: not eval, checkpoints, plots
        if not math.isfinite(stats["loss"]):
            raise FloatingPointError(f"non-finite training loss {stats['loss']} at step {step}")
        window_losses.append(stats["loss"])
        window_tokens += stats["tokens"]
        bar.update(1)
        bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.2e}")
        if step % recipe.log_every == 0 or step == recipe.max_steps:
            loss = sum(window_losses) / len(window_losses)
            log({"step": step, "loss": loss, "lr": stats["lr"], "grad_norm": stats["grad_norm"],
                 "tokens_per_s": window_tokens / max(window_time, 1e-9)})
            result.losses.append(loss)
            window_losses, window_tokens, window_time = [], 0, 0.0
        if val_batches and (step % recipe.val_every == 0 or step == stop):
            result.val_loss = evaluate(model, val_batches, recipe=recipe, device=device, par=par)
            log({"step": step, "val_loss": result.val_loss})
            if par.is_main and recipe.progress_bar:
                bar.write(f"step {step}: validation loss {result.val_loss:.4f}")
        if par.is_main and (step % recipe.ckpt_every == 0 or step == stop):
            window = {"losses": window_losses, "tokens": window_tokens, "time": window_time}
            save_checkpoint(run_dir, step, model, optimizer, schedule, stream, model_config, recipe.keep_checkpoints, window)
            if recipe.plot:
                plot_losses(metrics_path, run_dir / "loss.png", title)
        result.step = step
    bar.close()
    if par.is_main:
        records = read_metrics(metrics_path)
        train_losses = [r["loss"] for r in records if "loss" in r]
        if result.val_loss is None:  # nothing evaluated in this process (e.g. a finished run resumed)
            result.val_loss = next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None)
        summary = {
            "step": result.step, "max_steps": recipe.max_steps, "params": n_params,
            "first_loss": train_losses[0] if train_losses else None,
            "last_loss": train_losses[-1] if train_losses else None,
            "val_loss": result.val_loss, "resumed_from": resumed_from,
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if recipe.plot:
            plot_losses(metrics_path, run_dir / "loss.png", title)
    return result


USAGE = """usage: nemo-dsa-train [--print-config] [HYDRA_OVERRIDE ...]

Config groups (configs/): model={tiny,small,v4_flash} scoring={v4,v41} recipe={default,smoke,h200}
Examples:
  nemo-dsa-train scoring=v41 recipe.max_steps=20
  nemo-dsa-train device=cuda model=small recipe=h200 run_dir=runs/gpu
Config directory: $NEMO_DSA_CONFIG_DIR or <checkout>/configs."""


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``nemo-dsa-train`` / ``python -m nemo_dsa.train``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    print_only = "--print-config" in args
    args = [a for a in args if a != "--print-config"]
    cfg = load_config(args)
    if print_only:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg))
        return 0
    result = train(cfg)
    print(f"run_dir={result.run_dir} step={result.step} val_loss={result.val_loss}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
