"""The run: set-up, resume, the training step (non-finite gradients skipped), evaluation, checkpoints."""

from __future__ import annotations

import math
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nemo_dsa._checks import check_seed
from nemo_dsa.data import PAD_ID
from nemo_dsa.labels import IGNORE_INDEX
from nemo_dsa.recipe.files import RunDirLock, atomic_write, check_run_dir, path_under, remove_temporaries
from nemo_dsa.recipe.metrics import (
    MetricsLog,
    TensorBoardScalars,
    plot_losses,
    read_metrics,
    require_tensorboard,
    write_summary,
)
from nemo_dsa.recipe.optim import apply_recipe, build_optimizer
from nemo_dsa.recipe.parallel import (
    Parallel,
    PeerFailed,
    RanksStopped,
    abandon_parallel,
    all_reduce_sum,
    describe_error,
    dp_slice,
    drop_unreached_gradients,
    finish_parallel,
    is_collective_timeout,
    is_peer_lost,
    launch_rank,
    peer_lost,
    setup_parallel,
    shard_model,
    share_failure,
    stalled_collective,
)
from nemo_dsa.recipe.schema import check_batch_memory, check_memory, check_recipe, recipe_changes
from nemo_dsa.recipe.state import (
    ABANDONED_PREFIX,
    STATE_FILE,
    CorruptCheckpoint,
    abandon_newer,
    clean_failed_saves,
    list_checkpoints,
    read_state,
    restore,
    gather_full_state,
    save_checkpoint,
    set_aside,
)
from nemo_dsa.recipe.weights import load_initial_weights

# The batch fields handed to the model: exactly what nemo-automodel's THD collater emits
# (document-local positions, seq_lens / seq_lens_padded) plus the per-token document ids and mask.
MODEL_INPUTS = (
    "input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded", "packed_seq_ids", "attention_mask",
)
TIMEOUT_DIR = ".timeouts"  # under run_dir: one marker per rank whose collective timed out


def note(message: str) -> None:
    """A line for the user on stderr (the progress bar owns stdout's last line)."""
    print(f"nemo-dsa-train: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device, par: Parallel, ratios,
                 pad_id: int = PAD_ID) -> dict[str, Any]:
    batch = {k: batch[k] for k in MODEL_INPUTS if k in batch}
    if par.group is not None:
        from nemo_dsa.distributed import shard_batch

        batch = shard_batch(batch, par.group, compress_ratios=ratios, pad_token_id=pad_id)
    inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if par.group is not None:
        inputs["cp_group"] = par.group
    return inputs


def loss_terms(model, inputs: dict[str, Any], precision: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of token LM losses, this rank's share of the indexer loss, labelled-token count)."""
    count = (inputs["labels"] != IGNORE_INDEX).sum()
    with torch.autocast(inputs["input_ids"].device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = model(**inputs)
    if out.lm_loss is None:
        raise RuntimeError("the model returned no loss although labels were given")
    aux = out.aux_loss.float() if out.aux_loss is not None else torch.zeros((), device=count.device)
    return out.lm_loss.float() * count, aux, count


def train_step(model, optimizer, schedule, batch, *, recipe, device, par: Parallel, pad_id: int = PAD_ID) -> dict[str, Any]:
    """One optimizer step over one batch; returns loss, lr, grad norm, token count and ``skipped``.

    A step whose loss or gradient norm is not finite is skipped: the gradients are dropped and the
    weights and optimizer moments stay as they were (the schedule still advances, so the lr keeps
    following the step number). Every rank sees the same all-reduced gradients, so all skip together.
    """
    inputs = model_inputs(dp_slice(batch, par), device, par, model.config.compress_ratios, pad_id)
    loss_sum, aux, count = loss_terms(model, inputs, recipe.precision)
    total = all_reduce_sum(count.float(), par).clamp_min(1)
    # Normalise the LM loss by the global token count, so summing rank gradients gives the global
    # mean's; the indexer loss is already this rank's share of its CP group's (see the model), and
    # the data-parallel replicas' indexer losses are averaged.
    aux = aux / par.dp_size
    (loss_sum / total + aux).backward()
    if par.group is not None and not par.sharded:  # FSDP's reduce-scatter sums over every rank itself
        import torch.distributed as dist

        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=par.group)
    drop_unreached_gradients(model, par)
    max_norm = float("inf") if recipe.grad_clip is None else recipe.grad_clip  # inf: measure, do not clip
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
    loss = (all_reduce_sum(loss_sum.detach(), par) / total + all_reduce_sum(aux.detach(), par)).item()
    lr = optimizer.param_groups[0]["lr"]
    skipped = not (math.isfinite(grad_norm) and math.isfinite(loss))
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    schedule.step()
    return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": int(batch["attention_mask"].sum()),
            "skipped": skipped}


@torch.no_grad()
def evaluate(model, batches, *, recipe, device, par: Parallel, pad_id: int = PAD_ID) -> float:
    """Token-weighted mean LM loss over fixed validation batches."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device)
    count = torch.zeros((), device=device)
    for batch in batches:
        inputs = model_inputs(dp_slice(batch, par), device, par, model.config.compress_ratios, pad_id)
        s, _, n = loss_terms(model, inputs, recipe.precision)
        loss_sum += s
        count += n
    model.train(was_training)
    return (all_reduce_sum(loss_sum, par) / all_reduce_sum(count.float(), par).clamp_min(1)).item()


# ---------------------------------------------------------------------------------------------
# Resume
# ---------------------------------------------------------------------------------------------


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:13] + "...'"  # sha256 digests


def _compare(path: Path, state: dict, model_config: dict, recipe_now: dict) -> dict[str, tuple]:
    saved = state["model_config"]
    changed = sorted(k for k in set(saved) | set(model_config) if saved.get(k) != model_config.get(k))
    if changed:
        raise ValueError(f"resume: checkpoint {path} was trained with a different model config (keys {changed}); "
                         "use another run_dir to train the new config")
    if "recipe" not in state:
        return {}  # a checkpoint from before recipes were saved: nothing to compare with
    applied, refused = recipe_changes(state["recipe"], recipe_now)
    if refused:
        detail = ", ".join(f"{k}: {_short(state['recipe'].get(k))} -> {_short(recipe_now.get(k))}" for k in refused)
        raise ValueError(f"resume: checkpoint {path} cannot continue with a changed {', '.join(refused)} ({detail}); "
                         "these fix the data stream and the validation set: use another run_dir or resume=never")
    return applied


def resume(cfg, run_dir: Path, objects: tuple, model_config: dict, recipe_now: dict, par: Parallel):
    """Restore the checkpoint ``cfg.resume`` names; returns ``(path or None, state, applied changes, fallbacks)``.

    ``resume=auto`` takes the newest intact checkpoint: a corrupt or truncated newer one is reported
    by path, set aside as ``corrupt-step_*`` and the previous one is used.
    """
    fallbacks: list[str] = []
    if cfg.resume == "never":
        if list_checkpoints(run_dir):
            raise ValueError(f"resume=never but {run_dir} already holds checkpoints: pick another run_dir")
        return None, {}, {}, fallbacks
    if cfg.resume == "auto":
        candidates = list(reversed(list_checkpoints(run_dir)))
    else:
        path = Path(cfg.resume)
        if not (path / STATE_FILE).is_file():
            raise ValueError(f"resume must be 'auto', 'never' or a checkpoint directory, got {cfg.resume!r}")
        candidates = [path]
    for path in candidates:
        try:
            state = read_state(path)
        except CorruptCheckpoint as e:
            if cfg.resume != "auto":
                raise
            fallbacks.append(str(e))
            if par.is_main:
                note(f"{e}; set aside as {set_aside(path).name}, falling back to the previous checkpoint")
            continue
        applied = _compare(path, state, model_config, recipe_now)
        restore(path, state, *objects, sharded=par.sharded)
        return path, state, applied, fallbacks
    if fallbacks:  # checkpoints existed, none intact: say so rather than silently start from step 0
        raise CorruptCheckpoint(f"no intact checkpoint in {run_dir} ({len(fallbacks)} set aside as corrupt-step_*); "
                                "run again to start from step 0, or resume=<a checkpoint directory>")
    return None, {}, {}, fallbacks


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
    skipped_steps: int = 0
    is_main: bool = True


def resolve_vocab_size(cfg, tokenizer) -> None:
    """``model.config.vocab_size: tokenizer`` (set by ``tokenizer=hf``) becomes the tokenizer's
    vocabulary size in ``cfg``; a number must hold every token id the tokenizer emits."""
    size = cfg.model.config.vocab_size
    if size == "tokenizer":
        cfg.model.config.vocab_size = int(tokenizer.vocab_size)
    elif isinstance(size, int) and size < tokenizer.vocab_size:
        raise ValueError(f"model.config.vocab_size={size} is smaller than the tokenizer's vocabulary "
                         f"({tokenizer.vocab_size} tokens, tokenizer={cfg.tokenizer.name}): set "
                         f"model.config.vocab_size={tokenizer.vocab_size} (or vocab_size=tokenizer)")


def _build_model(cfg, device: torch.device):
    from hydra.utils import instantiate

    # First on the meta device (no memory): the config's own checks, the sequence length against
    # max_position_embeddings and the parameters' size against the free memory, each naming keys.
    skeleton = instantiate(cfg.model, device="meta")
    if skeleton.config.max_position_embeddings < cfg.recipe.seq_len:
        raise ValueError(f"recipe.seq_len={cfg.recipe.seq_len} is longer than model.config.max_position_embeddings="
                         f"{skeleton.config.max_position_embeddings}: a document could reach positions the model "
                         "does not hold; lower recipe.seq_len or raise model.config.max_position_embeddings")
    if cfg.model.get("device") != "meta":  # a shape preset is refused below, by name
        _check_parameter_memory(skeleton, device)
    del skeleton
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = instantiate(cfg.model)  # nemo_dsa.builder.build_model: fails here on a bad config
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(f"model {cfg.model.get('name')!r} is built on the meta device (a shape preset): "
                         "it cannot be trained; pick model=tiny or model=small")
    return model.to(device).train()


def _check_parameter_memory(skeleton, device: torch.device) -> None:
    """The model's parameters (built on the meta device) must fit the free memory of ``device``;
    else a ValueError naming the largest tensor and the model.config keys that size it."""
    params = list(skeleton.named_parameters())
    if not params:
        return
    dtype_bytes = next(p for _, p in params).element_size()
    needed = sum(p.numel() for _, p in params) * dtype_bytes
    name, largest = max(params, key=lambda item: item[1].numel())
    config = skeleton.config.to_dict()
    keys = [next((f"model.config.{k}={v}" for k, v in config.items() if type(v) is int and v == d), str(d))
            for d in largest.shape]
    check_memory(f"model.config: the parameters ({sum(p.numel() for _, p in params):,}; the largest, {name}, is "
                 f"{' x '.join(keys)})", needed, device)


def _device(cfg, recipe) -> torch.device:
    if not isinstance(cfg.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", cfg.device):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {cfg.device!r}")
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda was requested but no CUDA device is available")
    if recipe.precision == "bf16" and device.type != "cuda":
        raise ValueError("recipe.precision=bf16 runs on device=cuda only (CPU runs are fp32)")
    return device


def train(cfg) -> TrainResult:
    """Run the recipe described by a composed config (see ``load_config``)."""
    recipe = cfg.recipe
    check_recipe(recipe)
    check_seed(cfg.seed)
    if cfg.get("init_from") is not None and not str(cfg.init_from).strip():
        raise ValueError(f"init_from must name a checkpoint directory, a run_dir or an HF-format folder, got "
                         f"{cfg.init_from!r} (null: train from scratch)")
    device = _device(cfg, recipe)
    check_batch_memory(recipe.batch_size, recipe.seq_len, 1 + recipe.val_batches, device,
                       keys="recipe.batch_size, recipe.seq_len and recipe.val_batches")
    run_dir = check_run_dir(cfg.run_dir)
    path_under(run_dir, cfg.logger.log_dir, "logger.log_dir")
    if cfg.logger.tensorboard:
        require_tensorboard()  # before any work: the missing package is named at once
    created = _first_missing(run_dir)
    lock = RunDirLock(run_dir).acquire() if launch_rank() == 0 else None  # before anything is written
    try:
        return _run(cfg, recipe, device, run_dir)
    except BaseException:
        if lock is not None and created is not None:
            _remove_if_only_lock(run_dir, lock, created)
        raise
    finally:
        if lock is not None:
            lock.release()


def _first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist yet (None: ``path`` exists)."""
    if path.exists():
        return None
    while not path.parent.exists() and path.parent != path:
        path = path.parent
    return path


def _remove_if_only_lock(run_dir: Path, lock: RunDirLock, created: Path) -> None:
    """A run that failed before writing anything leaves no ``run_dir`` holding only its ``.lock``:
    the directories this run created are removed (while the lock is still held) if that is all."""
    try:
        if {p.name for p in run_dir.iterdir()} != {lock.path.name}:
            return
        lock.path.unlink()
        path = run_dir
        while True:
            path.rmdir()  # OSError if another process put something there meanwhile
            if path == created:
                break
            path = path.parent
    except OSError:
        pass


def _run(cfg, recipe, device: torch.device, run_dir: Path) -> TrainResult:
    if recipe.num_threads:
        torch.set_num_threads(int(recipe.num_threads))
    par = setup_parallel(recipe.cp_size, recipe.dist_timeout_s, recipe.dp_size, device.type)
    try:
        return _run_parallel(cfg, recipe, device, run_dir, par)
    except BaseException:
        abandon_parallel(par)  # no barrier: the other ranks may be gone or stopped
        raise


def _run_parallel(cfg, recipe, device: torch.device, run_dir: Path, par: Parallel) -> TrainResult:
    from omegaconf import OmegaConf
    from tqdm.auto import tqdm

    from nemo_dsa.data import corpus_fingerprint, pack_documents
    from nemo_dsa.recipe.data_sources import build_tokenizer, load_documents

    if device.type == "cuda" and par.size > 1:
        device = torch.device("cuda", torch.cuda.current_device())  # init_from_env chose LOCAL_RANK

    def tidy() -> None:  # rank 0's part
        removed, restored = clean_failed_saves(run_dir)
        for leftover in [*removed, *remove_temporaries(run_dir)]:
            note(f"removed {leftover}, the leftover of a write that did not finish")
        for path in restored:
            note(f"restored {path} from the copy a killed re-save had set aside")
        shutil.rmtree(run_dir / TIMEOUT_DIR, ignore_errors=True)  # markers of an earlier run

    # Rank 0's outcome leaves after its repairs, so every rank then lists the same checkpoints (and
    # resumes the same step), or learns that the repairs failed.
    _on_main_shared(par, run_dir / TIMEOUT_DIR, None, "tidying run_dir before training", tidy,
                    waiting="waiting for rank 0 to tidy run_dir before training")
    tokenizer = build_tokenizer(cfg.tokenizer)
    resolve_vocab_size(cfg, tokenizer)
    documents = load_documents(cfg.data)
    model = _build_model(cfg, device)
    # A new run's weights from a trained one (weights only: this run's data, optimizer and schedule);
    # a resumed run's checkpoint replaces them below.
    initial = load_initial_weights(model, cfg.init_from) if cfg.get("init_from") is not None else None
    model_config = model.config.to_dict()
    n_params = sum(p.numel() for p in model.parameters())
    model = shard_model(model, par)  # FSDP2 over every rank when recipe.dp_size > 1
    recipe_now = {**OmegaConf.to_container(recipe, resolve=True), "seed": cfg.seed}
    optimizer, schedule = build_optimizer(model, recipe)
    stream, val_batches = pack_documents(
        documents, tokenizer, seq_len=recipe.seq_len, batch_size=recipe.batch_size, seed=cfg.seed,
        val_percent=recipe.val_percent, val_batches=recipe.val_batches, min_piece=recipe.min_piece,
    )
    # What the checkpoint must have been trained on: the recipe, the seed and the corpus itself.
    recipe_now["corpus_sha256"] = corpus_fingerprint(stream.documents)
    data_sizes = split_sizes(documents, tokenizer, stream, val_batches, recipe.val_percent)
    path, saved, applied, fallbacks = resume(cfg, run_dir, (model, optimizer, schedule, stream), model_config,
                                             recipe_now, par)
    apply_recipe(optimizer, schedule, recipe)  # this run's lr, betas, weight decay (a no-op when fresh)
    resumed_from = None if path is None else int(saved["step"])
    start = resumed_from or 0
    _check_unfinished(run_dir, start, recipe, path)
    init_from = saved.get("init_from") if path is not None else (None if initial is None else initial.record())
    if path is not None and initial is not None and par.is_main:
        note(f"init_from={cfg.init_from} is ignored: resuming from step {start} ({path}), "
             "which holds this run's own weights")
    elif initial is not None and par.is_main:
        note(f"starting from the weights of {initial.source} (init_from; a new optimizer, schedule and data)")
    # Resuming from an older checkpoint replaces the run past it: its newer checkpoints are set
    # aside (never resumed by a later resume=auto, never pruned), and said so.
    abandoned = abandon_newer(run_dir, start) if par.is_main and path is not None else []
    metrics = _open_metrics(cfg, run_dir, par, saved, path, applied, fallbacks)
    if cfg.logger.tensorboard and par.is_main:
        metrics.tensorboard = TensorBoardScalars(path_under(run_dir, cfg.logger.log_dir, "logger.log_dir"),
                                                 purge_step=start + 1)
    for old in abandoned:
        note(f"set aside {old.name[len(ABANDONED_PREFIX):]} as {old} (newer than step {start}, which this run resumes from)")
        metrics.log({"step": start, "event": "checkpoint_abandoned", "path": str(old)})
    stop = recipe.stop_at_step or recipe.max_steps
    title = f"{cfg.model.name} / scoring {cfg.scoring.name} / {cfg.recipe.name}"
    result = TrainResult(run_dir=run_dir, step=start, resumed_from=resumed_from, is_main=par.is_main,
                         skipped_steps=int(saved.get("skipped_steps", 0)))
    bar = tqdm(total=stop, initial=start, disable=not (recipe.progress_bar and par.is_main), dynamic_ncols=True,
               desc="train")
    # Steps since the last logged record (restored on resume, so a window spanning a stop
    # averages exactly what an uninterrupted run does).
    window = saved.get("log_window") or {}
    window_losses: list[float] = list(window.get("losses", []))
    window_tokens, window_time = window.get("tokens", 0), window.get("time", 0.0)
    markers = run_dir / TIMEOUT_DIR
    first_logged = start > 0  # a resumed run's first step was logged before

    metrics.log({"step": start, "event": "resume" if resumed_from is not None else "start", "model": cfg.model.name,
                 "scoring": cfg.scoring.name, "params": n_params, "device": str(device), "cp_size": par.cp_size,
                 "dp_size": par.dp_size, "init_from": init_from})
    metrics.log({"step": start, "event": "data", **data_sizes})
    if par.is_main:
        note(describe_sizes(data_sizes))
    for step in range(start + 1, stop + 1):
        tic = time.perf_counter()
        val_loss = None
        with _stall_reported(par, markers, step):
            stats = train_step(model, optimizer, schedule, next(stream), recipe=recipe, device=device, par=par,
                               pad_id=tokenizer.pad_id)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            window_time += time.perf_counter() - tic  # step time only: not eval, checkpoints, plots
            if val_batches and (step % recipe.val_every == 0 or step == stop):
                val_loss = evaluate(model, val_batches, recipe=recipe, device=device, par=par, pad_id=tokenizer.pad_id)
        bar.update(1)
        if stats["skipped"]:
            _skip(step, stats, result, recipe, metrics, par)
        else:
            if not first_logged:  # the summary's first_loss: one step's loss, not a log_every window's mean
                metrics.log({"step": step, "event": "first_step", "step_loss": stats["loss"]})
                first_logged = True
            window_losses.append(stats["loss"])
            window_tokens += stats["tokens"]
            bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.2e}")
        if (step % recipe.log_every == 0 or step == recipe.max_steps) and window_losses:
            loss = sum(window_losses) / len(window_losses)
            metrics.log({"step": step, "loss": loss, "lr": stats["lr"], "grad_norm": _json_float(stats["grad_norm"]),
                         "tokens_per_s": window_tokens / max(window_time, 1e-9)})
            result.losses.append(loss)
            window_losses, window_tokens, window_time = [], 0, 0.0
        if val_loss is not None:
            result.val_loss = val_loss
            metrics.log({"step": step, "val_loss": val_loss})
            if par.is_main and recipe.progress_bar:
                bar.write(f"step {step}: validation loss {val_loss:.4f}")
        if step % recipe.ckpt_every == 0 or step == stop:
            def save() -> None:  # rank 0's part
                state = {"model_config": model_config, "recipe": recipe_now, "skipped_steps": result.skipped_steps,
                         "elapsed_s": metrics.elapsed(), "init_from": init_from,
                         "log_window": {"losses": window_losses, "tokens": window_tokens, "time": window_time}}
                save_checkpoint(run_dir, step, model, optimizer, schedule, stream, state, recipe.keep_checkpoints,
                                gathered=gathered)
                if recipe.plot:
                    plot_losses(metrics.path, run_dir / "loss.png", title)

            saving = f"saving the checkpoint of step {step}"
            with _stall_reported(par, markers, step, saving):
                gathered = gather_full_state(model, optimizer) if par.sharded else None  # every rank takes part
            _on_main_shared(par, markers, step, saving, save)  # every rank learns whether the save worked
        result.step = step
    bar.close()
    summing_up = f"writing the run's summary after step {result.step}"
    try:
        _on_main_shared(par, markers, result.step, summing_up,
                        lambda: _finish(run_dir, metrics.path, result, recipe, n_params, title, init_from,
                                        data_sizes))
    finally:
        metrics.close()
    with _stall_reported(par, markers, result.step, f"ending the run after step {result.step}"):
        finish_parallel(par)  # a barrier: no rank leaves before the others
    return result


def split_sizes(documents, tokenizer, stream, val_batches: list, val_percent: int) -> dict[str, int]:
    """How many documents and tokens the training stream and the validation split hold (documents
    of fewer than 2 tokens are dropped, as packing does), and how many tokens the fixed validation
    batches evaluate."""
    from nemo_dsa.data import split_documents

    _, val_docs = split_documents(documents, val_percent)
    val_lengths = [n for n in (len(tokenizer.encode(d.text)) for d in val_docs) if n >= 2]
    return {"train_documents": len(stream.documents), "train_tokens": sum(map(len, stream.documents)),
            "val_documents": len(val_lengths), "val_tokens": sum(val_lengths),
            "val_tokens_evaluated": sum(int(b["attention_mask"].sum()) for b in val_batches)}


def describe_sizes(sizes: dict[str, int]) -> str:
    return (f"data: {sizes['train_documents']:,} training documents ({sizes['train_tokens']:,} tokens), "
            f"{sizes['val_documents']:,} validation documents ({sizes['val_tokens']:,} tokens; "
            f"the validation batches evaluate {sizes['val_tokens_evaluated']:,})")


class RunFinished(ValueError):
    """The run in ``run_dir`` already reached the step this invocation would train to."""


def _check_unfinished(run_dir: Path, start: int, recipe, path: Path | None) -> None:
    """Refuse to "resume" a run with nothing left to train (say, a later command whose default
    run_dir names a finished run): it would train 0 steps and look like success."""
    if path is None:
        return
    if start >= recipe.max_steps:
        raise RunFinished(f"run_dir={run_dir} holds a finished run (step {start}, recipe.max_steps={recipe.max_steps}): "
                          f"nothing to train. Raise recipe.max_steps to continue it, or pick another run_dir")
    if recipe.stop_at_step is not None and start >= recipe.stop_at_step:
        raise RunFinished(f"run_dir={run_dir} is at step {start}, past recipe.stop_at_step={recipe.stop_at_step}: "
                          "nothing to train. Raise or drop recipe.stop_at_step")


@contextmanager
def _stall_reported(par: Parallel, markers: Path, step: int | None, during: str | None = None) -> Iterator[None]:
    """A collective inside that times out (multi-rank runs) becomes ``stalled_collective``'s one
    paragraph naming the step (or ``during``: what the ranks were doing) and ``recipe.dist_timeout_s``."""
    try:
        yield
    except RanksStopped:
        raise
    except RuntimeError as e:
        if par.size > 1 and is_collective_timeout(e):
            raise stalled_collective(e, par, step, _report_timeout(markers, par), during) from e
        if par.size > 1 and is_peer_lost(e):
            raise peer_lost(e, par, step, _report_timeout(markers, par), during) from e
        raise


def _on_main(par: Parallel, work: Callable[[], None]) -> Exception | None:
    """Run rank 0's own ``work`` (on rank 0 only); its error is returned, for ``share_failure``."""
    if not par.is_main:
        return None
    try:
        work()
    except Exception as e:  # noqa: BLE001 - re-raised by _stop_if_failed once every rank knows
        return e
    return None


def _on_main_shared(par: Parallel, markers: Path, step: int | None, during: str, work: Callable[[], None],
                    *, waiting: str | None = None) -> None:
    """Rank 0 does ``work`` (``during`` names it); every rank then learns the outcome in one
    broadcast (``waiting``: what the other ranks are doing meanwhile, for a stall message), and if
    it failed every rank stops together."""
    error = _on_main(par, work)
    with _stall_reported(par, markers, step, _and_failed(waiting or during, error)):
        failure = share_failure(par, error)
    _stop_if_failed(par, markers, error, failure, during)


def _and_failed(during: str, error: BaseException | None) -> str:
    """``during``, naming rank 0's own ``error`` if it had one (so a timeout after it still says why)."""
    return during if error is None else f"{during}, which failed on rank 0 ({describe_error(error)})"


_INTACT = "Any checkpoint saved before is intact: fix the cause and run again to resume from the newest"


def _stop_if_failed(par: Parallel, markers: Path, error: Exception | None, failure: str | None, during: str) -> None:
    """Stop every rank together after rank 0's work failed: rank 0 raises its own ``error``, the
    others a ``PeerFailed`` naming it; first the job ends together (as a finished one does)."""
    if error is None and failure is None:
        return
    with _stall_reported(par, markers, None, f"stopping together (rank 0 failed while {during}: {failure or describe_error(error)})"):
        finish_parallel(par)
    if isinstance(error, OSError):  # the disk or the path, not the code: one line, as on the other ranks
        raise RanksStopped(f"rank {par.rank}: {during} failed ({describe_error(error)}). {_INTACT}") from error
    if error is not None:
        raise error
    raise PeerFailed(f"rank {par.rank}: rank 0 failed while {during} ({failure}); every rank stops. {_INTACT}")


def _open_metrics(cfg, run_dir: Path, par: Parallel, saved: dict, path: Path | None, applied: dict,
                  fallbacks: list[str]) -> MetricsLog:
    """Write ``config.yaml``, start or trim ``metrics.jsonl`` and log how this run begins."""
    from omegaconf import OmegaConf

    resumed_from = None if path is None else int(saved["step"])
    start = resumed_from or 0
    metrics = MetricsLog(run_dir / "metrics.jsonl", enabled=par.is_main, elapsed_before=saved.get("elapsed_s", 0.0))

    def begin() -> None:  # rank 0's part
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        if resumed_from is None:
            metrics.start_fresh()
        else:
            metrics.keep_until(resumed_from)
            note(f"resuming from step {resumed_from} ({path})")

    _on_main_shared(par, run_dir / TIMEOUT_DIR, None, "writing config.yaml and metrics.jsonl before training", begin,
                    waiting="waiting for rank 0 to write config.yaml and metrics.jsonl before training")
    for reason in fallbacks:
        metrics.log({"step": start, "event": "checkpoint_fallback", "reason": reason})
    if applied:
        metrics.log({"step": start, "event": "recipe_change", "changed": {k: [a, b] for k, (a, b) in applied.items()}})
        if par.is_main:
            note(f"recipe changes taking effect from step {start + 1}: "
                 + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in applied.items()))
    return metrics


def _skip(step: int, stats: dict, result: TrainResult, recipe, metrics: MetricsLog, par: Parallel) -> None:
    """Count and log a skipped step; stop the run past ``recipe.max_skipped_steps``."""
    result.skipped_steps += 1
    metrics.log({"step": step, "event": "skipped", "reason": "non-finite loss or gradient",
                 "step_loss": _json_float(stats["loss"]), "step_grad_norm": _json_float(stats["grad_norm"]),
                 "skipped_steps": result.skipped_steps})
    if par.is_main:
        note(f"step {step}: non-finite loss {stats['loss']} or gradient norm {stats['grad_norm']}: "
             f"step skipped ({result.skipped_steps} so far, recipe.max_skipped_steps={recipe.max_skipped_steps})")
    if result.skipped_steps > recipe.max_skipped_steps:
        raise FloatingPointError(
            f"step {step}: {result.skipped_steps} steps had a non-finite loss or gradient, more than "
            f"recipe.max_skipped_steps={recipe.max_skipped_steps}; the run stops (the last checkpoint "
            "holds finite weights: lower recipe.lr or check the data)")


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # JSON has no nan/inf


def _report_timeout(markers: Path, par: Parallel) -> set[int]:
    """Leave this rank's timeout marker, give the other live ranks a moment to time out too (their
    waits began at about the same time), and return the ranks that did."""
    markers.mkdir(parents=True, exist_ok=True)
    atomic_write(markers / f"rank{par.rank}", "timed out\n")
    deadline = time.monotonic() + min(5.0, par.timeout_s or 5.0)
    while True:
        found = {int(p.name[4:]) for p in markers.glob("rank*") if p.name[4:].isdigit()}
        if len(found) == par.size or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _finish(run_dir: Path, metrics_path: Path, result: TrainResult, recipe, n_params: int, title: str,
            init_from: dict | None, data_sizes: dict) -> None:
    records = read_metrics(metrics_path)
    train_losses = [r["loss"] for r in records if "loss" in r and "event" not in r]
    if result.val_loss is None:  # nothing evaluated in this process (no validation step since the resume)
        result.val_loss = next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None)
    write_summary(run_dir / "summary.json", {
        "step": result.step, "max_steps": recipe.max_steps, "params": n_params,
        "first_loss": next((r["step_loss"] for r in records if r.get("event") == "first_step"),
                           train_losses[0] if train_losses else None),
        "last_loss": train_losses[-1] if train_losses else None,
        "val_loss": result.val_loss, "resumed_from": result.resumed_from, "skipped_steps": result.skipped_steps,
        "init_from": init_from, "data": data_sizes,
    })
    if recipe.plot:
        plot_losses(metrics_path, run_dir / "loss.png", title)
