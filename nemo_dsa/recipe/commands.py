"""``nemo-dsa-generate`` and ``nemo-dsa-evaluate`` (``python -m nemo_dsa.generate`` / ``nemo_dsa.evaluate``).

Both take ``key=value`` arguments like the training command and read the model, tokenizer and
data settings from the run directory ``nemo-dsa-train`` wrote. A mistake is one line naming the
key (with the closest key or the options) and exit code 2, as in training; ``--verbose`` shows
the traceback.

    nemo-dsa-generate run_dir=runs/tiny-v4-default prompt="json.dumps(" max_new_tokens=80
    nemo-dsa-generate run_dir=... prompt=... temperature=0.8 top_k=40 top_p=0.95 seed=3
    nemo-dsa-evaluate run_dir=runs/tiny-v4-default                     # the run's validation set
    nemo-dsa-evaluate run_dir=... split=all data=jsonl 'data.paths=[eval.jsonl]' data.text_key=content
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Optional  # noqa: UP035 - OmegaConf reads these annotations at runtime

from omegaconf import MISSING

from nemo_dsa.recipe.cli import EXIT_USAGE, UsageError, _article, _closest, _first_line, yaml_error_line


@dataclass
class GenerateArgs:
    run_dir: str = MISSING
    prompt: str = ""
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int = 0
    num_samples: int = 1
    checkpoint: Optional[str] = None  # noqa: UP045 - null: the newest intact checkpoint of run_dir
    device: str = "cpu"


@dataclass
class EvaluateArgs:
    run_dir: str = MISSING
    split: str = "validation"  # validation | train | all
    batches: Optional[int] = None  # noqa: UP045 - null: recipe.val_batches (validation) or one pass
    batch_size: Optional[int] = None  # noqa: UP045 - null: the run's recipe.batch_size
    checkpoint: Optional[str] = None  # noqa: UP045
    device: str = "cpu"


@dataclass
class ExportArgs:
    run_dir: str = MISSING
    out: str = MISSING
    checkpoint: Optional[str] = None  # noqa: UP045 - null: the newest intact checkpoint of run_dir


SPLITS = ("validation", "train", "all")
MAX_SAMPLES = 10_000  # continuations one command prints at most

# What each key means, for --help (the defaults come from the dataclasses above).
KEY_HELP = {
    "run_dir": "a directory written by nemo-dsa-train",
    "prompt": "the text to continue",
    "max_new_tokens": "tokens to generate at most (stops earlier at EOS)",
    "temperature": "0 = greedy; > 0 samples from softmax(logits / temperature)",
    "top_k": "sample among the k most likely tokens (0 = all)",
    "top_p": "sample within the smallest set of tokens whose probability reaches p (1.0 = all)",
    "seed": "the sampling seed (sample i uses seed + i)",
    "num_samples": "continuations to print",
    "checkpoint": "a checkpoints/step_* directory (null = the newest intact one of run_dir)",
    "device": "cpu or cuda",
    "split": "validation (the run's validation documents) | train | all",
    "batches": "batches to evaluate (null = recipe.val_batches for validation, else one pass)",
    "batch_size": "rows per batch (null = the run's recipe.batch_size)",
    "out": "the new (or empty) folder to write config.json and model.safetensors into",
}
COMMANDS = {
    "nemo-dsa-generate": ("prints continuations of prompt from a run's checkpoint", GenerateArgs,
                          'nemo-dsa-generate run_dir=runs/tiny-v4-default prompt="json.dumps(" max_new_tokens=80'),
    "nemo-dsa-evaluate": ("loss and perplexity of a run's checkpoint (data=<option> and data.<key>=... pick "
                          "other data)", EvaluateArgs,
                          "nemo-dsa-evaluate run_dir=runs/tiny-v4-default split=all data=jsonl "
                          "'data.paths=[eval.jsonl]'"),
    "nemo-dsa-export": ("writes a run's checkpoint as an HF-format folder (config.json + model.safetensors) for "
                        "init_from=, transformers and nemo-automodel", ExportArgs,
                        "nemo-dsa-export run_dir=runs/tiny-v4-default out=exports/tiny-v4"),
}


def parse_args(schema, argv: Sequence[str], *, extra_prefixes: tuple[str, ...] = ()) -> tuple[object, list[str]]:
    """``key=value`` arguments into ``schema`` (typed, every key checked); arguments starting with
    one of ``extra_prefixes`` (``data=``, ``data.``) are handed back untouched."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    known = [f.name for f in fields(schema)]
    values, extra = {}, []
    for arg in argv:
        if any(arg.startswith(p) for p in extra_prefixes):
            extra.append(arg)
            continue
        key, eq, value = arg.partition("=")
        if not eq:
            raise UsageError(f"{arg}: an argument is key=value; keys: {', '.join(known)}")
        if key not in known:
            raise UsageError(f"{key}: no such key{_closest(key, known)}; keys: {', '.join(known)}")
        values[key] = value
    node = OmegaConf.structured(schema)
    for key, value in values.items():
        try:
            node[key] = _parse_value(value)
        except OmegaConfBaseException:
            kind = next(f.type for f in fields(schema) if f.name == key)
            kind = getattr(kind, "__name__", str(kind)).replace("typing.", "")
            raise UsageError(f"{key}: expected {_article(kind) if kind in ('int', 'float', 'str') else kind}, "
                             f"got {value!r}") from None
    missing = [k for k in known if OmegaConf.is_missing(node, k)]
    if missing:
        example = {"out": "exports/tiny-v4"}.get(missing[0], "runs/tiny-v4-default")
        raise UsageError(f"{missing[0]}=... is required (e.g. {missing[0]}={example})")
    return node, extra


def _parse_value(text: str):
    """``null`` -> None; everything else as written (OmegaConf converts to the key's type)."""
    return None if text in ("null", "None", "~") else text


def _check_run_dir(run_dir: str) -> None:
    if not os.path.isdir(run_dir):
        raise UsageError(f"run_dir={run_dir}: no such directory")


def _run_command(prog: str, body, argv: Sequence[str] | None) -> int:
    import yaml

    from nemo_dsa.recipe.state import CorruptCheckpoint

    args = list(sys.argv[1:] if argv is None else argv)
    verbose = "--verbose" in args or os.environ.get("HYDRA_FULL_ERROR") == "1"
    args = [a for a in args if a != "--verbose"]
    if any(a in ("-h", "--help") for a in args):
        print(usage(prog))
        return 0
    try:
        return body(args)
    except (UsageError, ValueError, TypeError, FileNotFoundError, FileExistsError, CorruptCheckpoint,
            yaml.YAMLError) as e:
        if verbose:
            raise
        line = yaml_error_line(e) if isinstance(e, yaml.YAMLError) else _first_line(e)
        print(f"{prog}: error: {line}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # a path that cannot be read or written (permissions, a full or read-only disk)
        if verbose:
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"{prog}: error: {e.strerror or type(e).__name__}{where}", file=sys.stderr)
        return EXIT_USAGE


def usage(prog: str) -> str:
    """``--help``: what the command does, every key with its default, an example."""
    what, schema, example = COMMANDS[prog]
    lines = [f"usage: {prog} run_dir=<dir> [key=value ...] [--verbose]", "", f"{prog} {what}.", "", "keys:"]
    for f in fields(schema):
        default = "required" if f.default is MISSING else f"default {f.default!r}".replace("None", "null")
        lines.append(f"  {f.name:<15} {KEY_HELP[f.name]} ({default})")
    if schema is EvaluateArgs:
        lines.append(f"  {'data=, data.*':<15} the data config (default: the run's own; e.g. data=jsonl "
                     "'data.paths=[eval.jsonl]')")
    lines += ["", "example:", f"  {example}"]
    return "\n".join(lines)


def generate_main(argv: Sequence[str] | None = None) -> int:
    """``nemo-dsa-generate``: print continuations of ``prompt`` from a run's checkpoint."""
    return _run_command("nemo-dsa-generate", _generate, argv)


def _generate(argv: list[str]) -> int:
    from nemo_dsa.recipe.inference import generate, load_run

    args, _ = parse_args(GenerateArgs, argv)
    problems = []
    if args.max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if not 0 <= args.temperature < float("inf"):
        problems.append(f"temperature must be >= 0 and finite (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        problems.append(f"top_k must be >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {args.top_p}")
    if not 1 <= args.num_samples <= MAX_SAMPLES:
        problems.append(f"num_samples must be in [1, {MAX_SAMPLES}], got {args.num_samples}")
    elif not 0 <= args.seed < 2**63 - args.num_samples:  # sample i draws with seed + i
        problems.append(f"seed must be an int in [0, 2**63 - num_samples), got {args.seed}")
    if problems:
        raise UsageError("; ".join(problems))
    _check_run_dir(args.run_dir)
    run = load_run(args.run_dir, args.checkpoint, args.device)
    print(f"# {run.checkpoint} (step {run.step})", file=sys.stderr)
    for i in range(args.num_samples):
        ids = generate(run.model, run.tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed + i)
        if args.num_samples > 1:
            print(f"--- sample {i + 1} (seed {args.seed + i})")
        print(args.prompt + run.tokenizer.decode(ids))
    return 0


def evaluate_main(argv: Sequence[str] | None = None) -> int:
    """``nemo-dsa-evaluate``: loss and perplexity of a run's checkpoint on a data config."""
    return _run_command("nemo-dsa-evaluate", _evaluate, argv)


def _evaluate(argv: list[str]) -> int:
    from omegaconf import OmegaConf

    from nemo_dsa.recipe.inference import evaluate_run, evaluation_batches, load_run
    from nemo_dsa.recipe.schema import check_known_keys

    args, data_args = parse_args(EvaluateArgs, argv, extra_prefixes=("data=", "data.", "+data."))
    if args.split not in SPLITS:
        raise UsageError(f"split must be one of {', '.join(SPLITS)}, got {args.split!r}{_closest(args.split, SPLITS)}")
    for key in ("batches", "batch_size"):
        if args[key] is not None and args[key] < 1:
            raise UsageError(f"{key} must be >= 1 or null, got {args[key]}")
    _check_run_dir(args.run_dir)
    run = load_run(args.run_dir, args.checkpoint, args.device)
    data = _data_config(run.config, data_args)
    check_known_keys(data, "data")
    batches = evaluation_batches(run, data, split=args.split, batches=args.batches, batch_size=args.batch_size)
    result = evaluate_run(run, batches, progress=True)
    source = data.source if data.source == "stdlib" else f"{data.source}:{OmegaConf.to_container(data.paths) or data.dataset}"
    print(f"run_dir={run.run_dir} checkpoint={run.checkpoint.name} data={source} split={args.split} "
          f"batches={result.batches} tokens={result.tokens} loss={result.loss:.4f} perplexity={result.perplexity:.3f}")
    return 0


def _data_config(run_cfg, data_args: list[str]):
    """The run's own data config, or the ``data=<option>`` group option, with ``data.*`` overrides."""
    from omegaconf import OmegaConf

    from nemo_dsa.recipe.cli import _compose

    option = [a for a in data_args if a.startswith("data=")]
    dotted = [a.lstrip("+") for a in data_args if not a.startswith("data=")]
    if option:
        return _compose([option[-1], *dotted]).data
    data = OmegaConf.create(OmegaConf.to_container(run_cfg.get("data") or {"name": "stdlib", "source": "stdlib"}))
    from nemo_dsa.recipe.schema import DataConfig

    node = OmegaConf.merge(OmegaConf.structured(DataConfig), data)
    for arg in dotted:
        key, _, value = arg.partition("=")
        leaf = key[len("data."):]
        known = [f.name for f in fields(DataConfig)]
        if leaf not in known:
            raise UsageError(f"{key}: no such key in data{_closest(leaf, known)}; keys: {', '.join(known)}")
        try:
            node[leaf] = OmegaConf.from_dotlist([f"v={value}"]).v
        except Exception as e:  # noqa: BLE001 - a type mismatch
            raise UsageError(f"{key}: {_first_line(e)}") from None
    return node


def export_main(argv: Sequence[str] | None = None) -> int:
    """``nemo-dsa-export``: a run's checkpoint as an HF-format folder."""
    return _run_command("nemo-dsa-export", _export, argv)


def _export(argv: list[str]) -> int:
    from nemo_dsa.recipe.weights import export_run

    args, _ = parse_args(ExportArgs, argv)
    if not args.out.strip():
        raise UsageError("out=... must name a new or empty folder for the export (e.g. out=exports/tiny-v4)")
    _check_run_dir(args.run_dir)
    source, out = export_run(args.run_dir, args.out, args.checkpoint)
    print(f"run_dir={args.run_dir} checkpoint={source.name} out={out}")
    return 0
