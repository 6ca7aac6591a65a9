"""A trained run's checkpoint put to use: text generation and validation loss / perplexity.

``load_run`` reads what the recipe wrote into ``run_dir`` (``config.yaml`` for the tokenizer and
data, a verified ``checkpoints/step_*`` for the weights and the model config), so nothing about
the model has to be repeated on the command line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_dsa._checks import check_device
from nemo_dsa.recipe.parallel import Parallel
from nemo_dsa.recipe.state import STATE_FILE, CorruptCheckpoint, list_checkpoints, read_state


@dataclass
class LoadedRun:
    run_dir: Path
    checkpoint: Path
    step: int
    config: Any  # the run's config.yaml (OmegaConf, resolved)
    model: torch.nn.Module
    tokenizer: Any


def find_checkpoint(run_dir: Path, checkpoint: str | None = None) -> tuple[Path, dict]:
    """``checkpoint`` (a directory), or the newest intact checkpoint of ``run_dir``, with its verified state."""
    if checkpoint:
        return Path(checkpoint), read_state(Path(checkpoint))
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"run_dir={run_dir} holds no checkpoints/step_* (train first, or pass checkpoint=<dir>)")
    problems = []
    for path in reversed(found):
        try:
            return path, read_state(path)
        except CorruptCheckpoint as e:
            problems.append(str(e))
    raise CorruptCheckpoint(f"run_dir={run_dir}: no intact checkpoint ({'; '.join(problems)})")


def load_run(run_dir: str | Path, checkpoint: str | None = None, device: str = "cpu") -> LoadedRun:
    """The model (eval mode, on ``device``) and tokenizer of a run, from its newest intact checkpoint."""
    from omegaconf import OmegaConf

    from nemo_dsa.models.dsa_lm import DSAForCausalLM, DSAModelConfig, load_checkpoint
    from nemo_dsa.models.dsa_lm.checkpoint import CHECKPOINT_FILE, check_config_fits
    from nemo_dsa.recipe.data_sources import build_tokenizer

    device = check_device("device", device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda (or cuda:N), got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device}: no CUDA device is available here (torch {torch.__version__}); use device=cpu")
    run_dir = Path(run_dir)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise FileNotFoundError(f"run_dir={run_dir} has no config.yaml: not a directory written by nemo-dsa-train")
    cfg = OmegaConf.load(config_file)
    path, state = find_checkpoint(run_dir, checkpoint)
    where = f"checkpoint {path}: {STATE_FILE}'s model_config"
    fields = state.get("model_config")
    try:
        if not isinstance(fields, dict):
            raise TypeError(f"it is a {type(fields).__name__}, not a table of model config keys")
        config = DSAModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise CorruptCheckpoint(f"{where} is not a model config ({e})") from None
    # Its sizes against the weights' header before the model is built: a crafted state asks for nothing.
    check_config_fits(config, path / CHECKPOINT_FILE, where=f"{where} against the tensors")
    with torch.device(device):
        model = DSAForCausalLM(config)
    load_checkpoint(model, path, strict=True, where=f"checkpoint {path}")
    tokenizer = build_tokenizer(cfg.tokenizer) if "tokenizer" in cfg else _byte_tokenizer()
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer ({tokenizer.vocab_size} tokens) does not fit the checkpoint's "
                         f"model.config.vocab_size={model.config.vocab_size}")
    return LoadedRun(run_dir, path, int(state["step"]), cfg, model.eval(), tokenizer)


def _byte_tokenizer():
    from nemo_dsa.data import ByteTokenizer

    return ByteTokenizer()  # runs from before the tokenizer group


def filter_logits(logits: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits [V]`` with every token outside the top ``top_k`` (0: all) and outside the smallest
    set whose probability reaches ``top_p`` (1.0: all) set to -inf. The most likely token always stays."""
    logits = logits.clone()
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability mass strictly before each token
        logits[order[before >= top_p]] = float("-inf")
    return logits


@torch.no_grad()
def generate(model, tokenizer, prompt: str, *, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0) -> list[int]:
    """Token ids continuing ``prompt`` (the prompt's own ids not included), stopping at EOS.

    ``temperature`` 0 is greedy (ties to the smaller id); above 0 samples from
    ``softmax(logits / temperature)`` after the ``top_k`` / ``top_p`` filters, drawn from a
    generator seeded with ``seed`` (the same seed gives the same text). No KV cache: each step
    runs the whole sequence, which is what a small model on a CPU affords.
    """
    device = next(model.parameters()).device
    bos = [] if getattr(tokenizer, "bos_id", None) is None else [tokenizer.bos_id]
    ids = bos + tokenizer.encode(prompt, add_special=False)
    limit = model.config.max_position_embeddings
    if len(ids) >= limit:
        raise ValueError(f"prompt: {len(ids)} tokens, but the model holds at most max_position_embeddings={limit}"
                         " (prompt and generated tokens together)")
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    new: list[int] = []
    for _ in range(max_new_tokens):
        if len(ids) >= limit:
            break
        x = torch.tensor([ids], dtype=torch.long, device=device)
        logits = model(x, position_ids=torch.arange(len(ids), device=device)[None]).logits[0, -1].float().cpu()
        if temperature == 0:
            token = int(torch.argmax(logits))
        else:
            # Shifted by the maximum first: a tiny temperature makes the others -inf, never inf / NaN.
            scaled = (logits - logits.max()) / temperature
            probs = torch.softmax(filter_logits(scaled, top_k=top_k, top_p=top_p), dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        if token == tokenizer.eos_id:
            break
        ids.append(token)
        new.append(token)
    return new


@dataclass
class Evaluation:
    loss: float
    perplexity: float
    tokens: int
    batches: int


def evaluation_batches(run: LoadedRun, data, *, split: str = "validation", batches: int | None = None,
                       batch_size: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Packed batches of ``data`` (a data config node) with the run's seq_len, seed and split rule.

    ``validation``: the held-out documents (``recipe.val_percent``), ``batches`` of them (the run's
    ``recipe.val_batches`` by default: then the loss equals the run's own validation loss on its
    data); ``train``: the training documents; ``all``: every document. Without ``batches``, train
    and all make one pass over their documents (the last batch's rows are filled from the start).
    """
    from nemo_dsa.data import PackedBatches, fixed_batches, split_documents
    from nemo_dsa.recipe.data_sources import load_documents

    from nemo_dsa.recipe.schema import check_batch_memory

    recipe = run.config.recipe
    batch_size = batch_size or recipe.batch_size
    count = batches if batches is not None else (recipe.val_batches if split == "validation" else 1)
    check_batch_memory(batch_size, recipe.seq_len, max(count, 1), "cpu", keys="batches and batch_size")
    documents = load_documents(data)
    train_docs, val_docs = split_documents(documents, recipe.val_percent)
    chosen = {"validation": val_docs, "train": train_docs, "all": documents}[split]
    ids = [t for t in (run.tokenizer.encode(d.text) for d in chosen) if len(t) >= 2]
    if not ids:
        raise ValueError(f"split={split}: the data holds no {split} documents (recipe.val_percent={recipe.val_percent})")
    stream = PackedBatches(ids, seq_len=recipe.seq_len, batch_size=batch_size, shuffle=False,
                           min_piece=recipe.min_piece, pad_id=run.tokenizer.pad_id)
    if batches is None and split == "validation":
        batches = recipe.val_batches
        if batches == 0:
            raise ValueError("batches: the run was trained with recipe.val_batches=0; pass batches=N (N >= 1)")
    if batches is not None:
        return fixed_batches(stream, batches)
    out = []
    while stream.epoch == 0:
        out.append(next(stream))
    return out


def evaluate_run(run: LoadedRun, batches: list[dict[str, torch.Tensor]], *, progress: bool = False) -> Evaluation:
    """Token-weighted mean loss (nats per token) and its perplexity over ``batches``, as the recipe
    evaluates; ``progress``: a progress bar on stderr (a large evaluation takes minutes on a CPU)."""
    from tqdm.auto import tqdm

    from nemo_dsa.labels import IGNORE_INDEX
    from nemo_dsa.recipe.loop import evaluate

    device = next(run.model.parameters()).device
    shown = tqdm(batches, desc="evaluate", unit="batch", disable=not progress, dynamic_ncols=True)
    loss = evaluate(run.model, shown, recipe=run.config.recipe, device=device, par=Parallel(),
                    pad_id=run.tokenizer.pad_id)
    shown.close()
    tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in batches)
    return Evaluation(loss=loss, perplexity=math.exp(loss) if loss < 700 else float("inf"), tokens=tokens,
                      batches=len(batches))
