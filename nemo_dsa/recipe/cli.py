"""``nemo-dsa-train`` / ``python -m nemo_dsa.train``: flags, sweeps and one-line user errors.

A user error (a misspelt key, a bad value, an unknown config option, a busy run_dir) prints one
line naming the key, what was expected and the options or the closest key, and exits 2; the
traceback appears only with ``--verbose`` or ``HYDRA_FULL_ERROR=1``.
"""

from __future__ import annotations

import difflib
import itertools
import logging
import os
import re
import sys
from collections.abc import Sequence

PROG = "nemo-dsa-train"
EXIT_USAGE = 2

USAGE = f"""usage: {PROG} [--print-config | --cfg job|hydra|all [--resolve]] [-m] [--verbose] [OVERRIDE ...]

Trains a DSA model from the Hydra configs in configs/ (train.yaml and its groups).
Config groups: {{groups}}
Flags:
  --print-config      print the composed config, interpolations resolved, and exit
  --cfg job           print the composed config as Hydra does (add --resolve to resolve), and exit
  -m, --multirun      run every combination of comma-separated options, e.g. -m scoring=v4,v41
  --verbose           show the full traceback of an error (or set HYDRA_FULL_ERROR=1)
  -h, --help          this text
Examples:
  {PROG} scoring=v41 recipe.max_steps=20
  {PROG} device=cuda model=small recipe=h200 run_dir=runs/gpu
  {PROG} -m scoring=v4,v41 recipe=smoke
Config directory: $NEMO_DSA_CONFIG_DIR or <checkout>/configs."""


class UsageError(Exception):
    """A mistake on the command line or in the config: printed as one line, exit code 2."""


def _config_groups() -> dict[str, list[str]]:
    from nemo_dsa.builder import config_dir

    root = config_dir()
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(root.iterdir()) if d.is_dir()}


def _closest(word: str, options: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" (did you mean {match[0]}?)" if match else ""


def _keys_at(cfg, dotted: str) -> list[str]:
    """The keys of the node at ``dotted`` in the composed default config (for suggestions)."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, dotted) if dotted else cfg
    return list(node.keys()) if OmegaConf.is_dict(node) else []


def _explain_composition(error: BaseException, overrides: Sequence[str]) -> str:
    """Hydra's composition error as one line naming the key and the options."""
    from nemo_dsa.recipe.schema import load_config

    text = " ".join(str(e) for e in _chain(error))
    groups = _config_groups()
    missing = re.search(r"Could not (?:find|load) '([\w/]+)/([\w.-]+)'", text)
    if missing and missing.group(1) in groups:
        group, option = missing.groups()
        return (f"{group}={option}: no such option in config group '{group}'; options: "
                f"{', '.join(groups[group])}{_closest(option, groups[group])}")
    key = re.search(r"(?:Could not override|Could not append to config\. An item is already at) '([\w.]+)'", text) \
        or re.search(r"[Kk]ey '([\w.]+)' (?:is )?not in", text)
    if key:
        full = key.group(1)
        parent, _, leaf = full.rpartition(".")
        try:
            base = load_config([o for o in overrides if not o.lstrip("+~").startswith(full)])
            known = _keys_at(base, parent)
        except Exception:  # noqa: BLE001 - suggestions are best effort
            base, known = None, []
        value = re.search(r"[Vv]alue '([^']*)' (?:of type '(\w+)' )?could not be converted to (\w+)", text)
        if value and leaf in known:
            return f"{full}: expected {_article(value.group(3))}, got {value.group(1)!r}"
        if leaf not in known:
            where = parent or "the top level"
            hint = _same_name_elsewhere(base, full, leaf) or _closest(leaf, known)
            return f"{full}: no such key in {where}{hint}; keys: {', '.join(known)}"
    full_key = re.search(r"full_key: ([\w.]+)", text)
    value = re.search(r"[Vv]alue '([^']*)' (?:of type '\w+' )?could not be converted to (\w+)", text) \
        or re.search(r"[Vv]alue '([^']*)' is not a valid (\w+)", text)
    if value and full_key:
        return f"{full_key.group(1)}: expected {_article(value.group(2))}, got {value.group(1)!r}"
    not_list = re.search(r"Invalid value assigned: (\w+) is not a ListConfig", text)
    if not_list and full_key:
        return f"{full_key.group(1)}: expected a list such as [0.9, 0.95], got {_article(not_list.group(1))}"
    unquoted = _needs_quotes(overrides, text)
    if unquoted:
        return unquoted
    bad_override = re.search(r"Error parsing override '([^']*)'", text)
    if bad_override:
        return (f"{bad_override.group(1)}: an override is key=value (model=small, recipe.max_steps=20, "
                "+group.new_key=value); see Hydra's override grammar")
    return _first_line(error)


def _same_name_elsewhere(cfg, full: str, leaf: str) -> str:
    """`` (did you mean recipe.lr?)`` for ``lr``: the config's keys of that name at other depths."""
    from omegaconf import OmegaConf

    if cfg is None:
        return ""
    found = []

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if key == leaf and path != full:
                found.append(path)
            if isinstance(value, dict):
                walk(value, f"{path}.")

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return f" (did you mean {' or '.join(found[:3])}?)" if found else ""


def _needs_quotes(overrides: Sequence[str], text: str) -> str | None:
    """An override Hydra cannot parse because its value holds characters such as ``<``, ``>`` or
    ``|`` unquoted (the shell ate the quotes): the quoting that reaches Hydra intact."""
    if "LexerNoViableAltException" not in text and "Error parsing override" not in text:
        return None
    for override in overrides:
        key, eq, value = override.partition("=")
        if eq and value[:1] not in ("'", '"') and re.search(r"[<>|!#\s]|[^\x00-\x7f]", value) and override in text:
            what = "non-ASCII characters (such as " + repr(next(c for c in value if ord(c) > 127)) + ")" \
                if any(ord(c) > 127 for c in value) else "such characters"
            return (f"{override}: Hydra reads a value with {what} only quoted, and the shell removes "
                    f"one pair of quotes: write \"{key}='{value}'\"")
    return None


def _article(type_name: str) -> str:
    name = {"Integer": "an int", "Float": "a number", "Boolean": "a bool (true/false)", "bool": "a bool (true/false)",
            "String": "a string", "int": "an int", "float": "a number", "str": "a string"}
    return name.get(type_name, type_name)


def _chain(error: BaseException):
    """``error`` and its causes, as the traceback would show them."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def _first_line(error: BaseException) -> str:
    """The message that names the problem, on one line: Hydra's wrappers (InstantiationException
    around the builder's ValueError) are looked through."""
    chain = list(_chain(error))
    inner = next((e for e in chain if type(e).__module__ not in ("hydra.errors", "omegaconf.errors")), chain[-1])
    text = str(inner).strip() or type(inner).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def yaml_error_line(error: BaseException) -> str:
    """A YAML syntax error as one line naming the file, line and column (PyYAML's spans several)."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "a YAML file"
    problem = getattr(error, "problem", None) or _first_line(error)
    return f"{where}: not valid YAML ({problem})"


def _compose(overrides: Sequence[str]):
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from nemo_dsa.recipe.schema import load_config

    try:
        return load_config(overrides)
    except yaml.YAMLError as e:  # a config file of the config directory
        raise UsageError(yaml_error_line(e)) from e
    except (HydraException, OmegaConfBaseException) as e:
        syntax = next((c for c in _chain(e) if isinstance(c, yaml.YAMLError)), None)
        raise UsageError(yaml_error_line(syntax) if syntax else _explain_composition(e, overrides)) from e
    except ValueError as e:  # check_known_keys
        raise UsageError(_first_line(e)) from e


def _sweep(overrides: Sequence[str]) -> list[list[str]]:
    """Every combination of the comma-separated options in ``overrides`` (Hydra's basic sweeper's order)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise UsageError(_first_line(e)) from e
    axes = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override()
            else [o.input_line] for o in parsed]
    return [list(combo) for combo in itertools.product(*axes)]


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (which tests and wrappers may replace)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _log_warnings_to_stderr() -> None:
    log = logging.getLogger("nemo_dsa.recipe")
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(f"{PROG}: warning: %(message)s"))
        log.addHandler(handler)


def _run_one(overrides: Sequence[str]) -> int:
    from hydra.errors import InstantiationException

    from nemo_dsa.recipe.files import RunDirLocked, RunDirUnusable
    from nemo_dsa.recipe.state import CorruptCheckpoint
    from nemo_dsa.recipe.loop import train

    cfg = _compose(overrides)
    try:
        result = train(cfg)
    except (InstantiationException, RunDirLocked, RunDirUnusable, FileNotFoundError, CorruptCheckpoint) as e:
        raise UsageError(_first_line(e)) from e
    except (ValueError, TypeError) as e:
        if not _is_user_error(e):
            raise
        raise UsageError(_first_line(e)) from e
    if result.is_main:
        print(f"run_dir={result.run_dir} step={result.step} val_loss={result.val_loss} "
              f"skipped_steps={result.skipped_steps}")
    return 0


def _is_user_error(error: BaseException) -> bool:
    """Errors raised by the recipe's and the builder's checks name a config key or the run_dir."""
    text = str(error)
    return bool(re.search(r"\b(recipe|model|scoring|resume|init_from|run_dir|device|seed|data|tokenizer|logger)\b", text))


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``nemo-dsa-train`` / ``python -m nemo_dsa.train``).

    A rank of a multi-rank run does not return: it exits here (``parallel.exit_process``)."""
    from nemo_dsa.recipe.parallel import exit_process

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _reported(args)
    except Exception as e:
        exit_process(1, error=e)  # a multi-rank run's bug: its traceback, then exit 1
        raise
    exit_process(code)
    return code


def _reported(args: list[str]) -> int:
    """``_main``'s exit code, an expected error printed as one line (all of it with ``--verbose``)."""
    from nemo_dsa.recipe.parallel import RanksStopped, describe_error

    verbose = "--verbose" in args or os.environ.get("HYDRA_FULL_ERROR") == "1"
    _log_warnings_to_stderr()
    try:
        return _main(args)
    except UsageError as e:
        if verbose:
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (FloatingPointError, RanksStopped) as e:  # the non-finite step limit, a stalled or failed rank
        if verbose:
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the disk or a path failed mid-run (full, read-only, gone): not the code
        if verbose:
            raise
        print(f"{PROG}: error: {describe_error(e)}. Any checkpoint saved before is intact: fix the cause and run "
              "again to resume from the newest", file=sys.stderr)
        return 1


def _main(args: list[str]) -> int:
    from omegaconf import OmegaConf

    flags = {"--print-config", "--verbose", "--resolve", "-m", "--multirun", "-h", "--help", "--cfg", "-c"}
    if any(a in ("-h", "--help") for a in args):
        groups = " ".join(f"{g}={{{','.join(opts)}}}" for g, opts in _config_groups().items())
        print(USAGE.format(groups=groups))
        return 0
    cfg_what = None
    for flag in ("--cfg", "-c"):
        if flag in args:
            i = args.index(flag)
            if i + 1 >= len(args) or args[i + 1] not in ("job", "hydra", "all"):
                raise UsageError(f"{flag} expects one of job, hydra, all")
            cfg_what = args.pop(i + 1)
    unknown = [a for a in args if a.startswith("-") and a not in flags]
    if unknown:
        raise UsageError(f"unknown flag {unknown[0]}; flags: {', '.join(sorted(flags))}{_closest(unknown[0], flags)}")
    overrides = [a for a in args if a not in flags]
    resolve = "--resolve" in args
    if "--print-config" in args or cfg_what is not None:
        if cfg_what in ("hydra", "all"):
            return _print_with_hydra(overrides, cfg_what)
        print(OmegaConf.to_yaml(_compose(overrides), resolve=resolve or "--print-config" in args))
        return 0
    if "-m" in args or "--multirun" in args:
        runs = _sweep(overrides)
        for i, run in enumerate(runs):
            print(f"[{i + 1}/{len(runs)}] {' '.join(run)}", file=sys.stderr, flush=True)
            _run_one(run)
        return 0
    if any("," in o.split("=", 1)[-1] and not o.split("=", 1)[-1].startswith("[") for o in overrides):
        sweep_like = next(o for o in overrides if "," in o.split("=", 1)[-1])
        if len(_sweep([sweep_like])) > 1:
            raise UsageError(f"{sweep_like}: a list of options is a sweep; add -m to run each")
    return _run_one(overrides)


def _print_with_hydra(overrides: Sequence[str], what: str) -> int:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from nemo_dsa.builder import config_dir
    from nemo_dsa.recipe.schema import register_schemas

    register_schemas()
    with initialize_config_dir(version_base=None, config_dir=str(config_dir().resolve()), job_name="nemo_dsa_train"):
        cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
    print(OmegaConf.to_yaml(cfg.hydra if what == "hydra" else cfg))  # Hydra's own nodes resolve only in a Hydra job
    return 0
