"""Strict loading of HF-format checkpoints into the DeepSeek plugins, every error naming key and file.

nemo-automodel 0.7.0 installs a checkpoint with ``strict=False``: a tensor the files lack stays at
its initialisation, a tensor the model lacks is dropped, an integer tensor is cast into a float
parameter, NaN / inf weights load, and a truncated file is a ``SafetensorError`` naming no file.
The plugins refuse all of these, on every path that loads their weights:

- ``check_checkpoint_files(model, path)`` reads only the safetensors headers (no tensor data):
  each file must be complete (its header and data cover the file exactly), and the tensors must be
  exactly those the model's state-dict adapter writes (``convert_single_tensor_to_hf``), with
  their shapes, and floating where the model's tensor is floating (integer / bool where it is
  not). A tensor with a ``.scale`` beside it is quantised (FP8 / FP4, dequantised by the adapter),
  so its own dtype and shape are the quantised layout's. Casts between float dtypes (bf16 <-> fp32)
  are the adapter's and allowed.
- ``check_finite(tensors, name_of)`` refuses NaN / inf in converted (dequantised) weights.

``StrictCheckpointLoading`` gives a plugin class both on nemo-automodel's path
(``NeMoAutoModelForCausalLM.from_pretrained``): nemo-automodel reads the model's
``_checkpoint_conversion_mapping`` when it is about to load the base checkpoint, which is where the
files at ``config._name_or_path`` are checked, and the model's state-dict adapter checks the
tensors it converts. ``common.checkpoint.load_hf_checkpoint`` runs the same checks.
Other models are untouched: nothing here changes nemo-automodel.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any
from pathlib import Path

import torch

from nemo_dsa._untrusted import check_name, load_safetensors, open_regular, read_json
from nemo_dsa._untrusted import read_safetensors_header as read_header

__all__ = [
    "StrictCheckpointLoading",
    "check_checkpoint_files",
    "check_finite",
    "checkpoint_files",
    "expected_hf_tensors",
    "read_safetensors_header",
]

# nemo-automodel 0.7.0's single-process load renames the state-dict adapter's output once more with
# transformers' DeepSeek-V4 key mapping (".wq_a." -> ".q_a_proj.", ...) and installs it with
# strict=False, which leaves every attention projection at its initialisation (the built-in model
# too). A first-match identity rule for the model's own names stops that second renaming.
IDENTITY_KEY_MAPPING = {r"^((?:model|mtp|lm_head)\..*)$": r"\1"}


def _is_float_dtype_name(dtype: str) -> bool:
    # safetensors dtype names: F64 F32 F16 BF16 F8_E4M3 F8_E5M2 F8_E8M0 F4 ... (floating), I* U* BOOL.
    return dtype.startswith(("F", "BF"))


def read_safetensors_header(
    file: str | Path, *, root: str | Path | None = None
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{key: (dtype name, shape)}`` of one safetensors file, from its header only.

    A file that is not a regular file inside ``root`` (a symbolic link out of it, a FIFO, a
    device), cannot be read, whose header is not valid, or whose size is not exactly what the
    header describes (a truncated or padded file) is a ValueError naming the file
    (``nemo_dsa._untrusted``, where every read of a folder from someone else goes).
    """
    file = Path(file)
    return read_header(file, follow_links=True, root=file.parent if root is None else root).tensors


def link_root(path: str | Path) -> Path:
    """The folder whose files a checkpoint at ``path`` may link to: the checkpoint's own, or for a
    Hugging Face cache snapshot (``.../snapshots/<revision>``, files linked to ``../../blobs``)
    the model's cache folder."""
    path = Path(path)
    folder = path.parent if path.is_file() else path
    if folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir():
        return folder.parent.parent
    return folder


def checkpoint_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint (a directory or one file). Files named by a
    ``model.safetensors.index.json`` must all exist inside the folder, as regular files (a name
    holding ``..``, an absolute name, or a link out of the folder is refused before anyone opens it)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"checkpoint path {path} does not exist")
    root = link_root(path)
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if os.path.lexists(index):
        where = f"checkpoint index {index}"
        weight_map = read_json(index, follow_links=True, root=root, expect=dict).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{where} is not readable: its weight_map is not an object of key: file name")
        named = {check_name(name, f"{where} (weight_map[{key!r}])") for key, name in weight_map.items()}
        absent = sorted(name for name in named if not (path / name).is_file())
        if absent:
            raise ValueError(f"{where} names {absent[0]}, which is not in {path}")
        for name in sorted(named):
            os.close(open_regular(path / name, follow_links=True, root=root)[0])  # a link out is refused
    if not files:
        raise ValueError(f"checkpoint path {path} holds no .safetensors files")
    return files


def _is_adapter_tensor(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return ".lora_" in name or leaf.startswith("lora_")


def _whole_on_meta(value: torch.Tensor) -> torch.Tensor:
    """A plain meta tensor with ``value``'s global shape and dtype.

    Under expert parallelism or FSDP a rank's parameters are DTensors holding only its shard, and
    the adapter converts a DTensor's local experts only; the checkpoint holds the whole model, so
    the keys and shapes it must have are those the adapter writes for the unsharded tensor (every
    rank's experts, the full dimensions)."""
    return torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")


def expected_hf_tensors(model: torch.nn.Module, adapter) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """``{checkpoint key: (model tensor, shape, floating)}`` that ``adapter`` writes for the whole
    ``model`` (converted on the meta device from global shapes: names, shapes and dtypes only, the
    same on every rank however the model is sharded). Low-rank adapters added by PEFT are not part
    of a base checkpoint (nemo-automodel initialises them, or loads them from the adapter
    checkpoint)."""
    expected: dict[str, tuple[str, tuple[int, ...], bool]] = {}
    for name, value in model.state_dict().items():
        if name.endswith("_extra_state") or _is_adapter_tensor(name):
            continue
        for hf_key, hf_value in adapter.convert_single_tensor_to_hf(name, _whole_on_meta(value)):
            expected[hf_key] = (name, tuple(hf_value.shape), hf_value.is_floating_point())
    return expected


def check_checkpoint_files(model: torch.nn.Module, adapter, path: str | Path) -> dict[str, Path]:
    """Check the files at ``path`` against ``model`` (module docstring); ``{key: file}`` of every tensor."""
    where: dict[str, Path] = {}
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    root = link_root(path)
    for file in checkpoint_files(path):
        for key, entry in read_safetensors_header(file, root=root).items():
            if key in where:
                raise ValueError(f"checkpoint key {key} is in both {where[key]} and {file}")
            where[key], found[key] = file, entry
    expected = expected_hf_tensors(model, adapter)
    quantised = {key[: -len(".scale")] + ".weight" for key in found if key.endswith(".scale")}
    scales = {key for key in found if key.endswith(".scale") and key[: -len(".scale")] + ".weight" in expected}
    unexpected = sorted(k for k in found if k not in expected and k not in scales)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(
            f"checkpoint file {where[unexpected[0]]} has {unexpected[0]}, which the model "
            f"({type(model).__name__}) does not have{more}"
        )
    missing = sorted(k for k in expected if k not in found)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(
            f"checkpoint {path} lacks {missing[0]} (model tensor {expected[missing[0]][0]}){more}; "
            f"its files: {', '.join(f.name for f in sorted(set(where.values())))}"
        )
    for key, (native, shape, floating) in expected.items():
        if key in quantised:  # dequantised by the adapter from its quantised layout
            continue
        dtype, got_shape = found[key]
        if _is_float_dtype_name(dtype) != floating:
            kind = "floating" if floating else "integer / bool"
            raise ValueError(
                f"checkpoint file {where[key]}: {key} is {dtype}, but the model's {native} is {kind}; "
                "only floating tensors convert between float dtypes"
            )
        if got_shape != shape:
            raise ValueError(f"checkpoint file {where[key]}: {key} has shape {got_shape}, the model needs {shape}")
    return where


def check_finite(tensors: dict[str, torch.Tensor], name_of: Callable[[str], str]) -> None:
    """ValueError naming the first floating tensor of ``tensors`` holding NaN or inf, as ``name_of(key)``."""
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.device.type == "meta":
            continue
        local = value.to_local() if hasattr(value, "to_local") else value
        if not bool(torch.isfinite(local).all()):
            count = int((~torch.isfinite(local)).sum())
            raise ValueError(f"{name_of(key)} holds {count} non-finite value(s) (NaN / inf)")


def _local_checkpoint(name_or_path: str | os.PathLike | None) -> Path | None:
    """The local files of ``config._name_or_path``: a path, or a hub id already in the local cache."""
    if not name_or_path:
        return None
    path = Path(name_or_path)
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(name_or_path), local_files_only=True))
    except Exception:  # not a hub id, or not downloaded: nemo-automodel reports what it cannot read
        return None


class _StrictAdapter:
    """Mixed into a model's state-dict adapter class: converted tensors must be finite."""

    def from_hf(self, hf_state_dict, *args, **kwargs):
        native = super().from_hf(hf_state_dict, *args, **kwargs)
        check_finite(native, self._strict_names)
        return native


_STRICT_ADAPTER_CLASSES: dict[type, type] = {}


def strict_adapter(adapter, name_of: Callable[[str], str]):
    """A copy of ``adapter`` (same state) whose ``from_hf`` refuses non-finite weights, naming them
    with ``name_of``."""
    cls = type(adapter)
    if isinstance(adapter, _StrictAdapter):
        strict = adapter
    else:
        if cls not in _STRICT_ADAPTER_CLASSES:
            _STRICT_ADAPTER_CLASSES[cls] = type(f"Strict{cls.__name__}", (_StrictAdapter, cls), {"__module__": __name__})
        strict = object.__new__(_STRICT_ADAPTER_CLASSES[cls])
        strict.__dict__.update(adapter.__dict__)
    strict._strict_names = name_of
    return strict


class StrictCheckpointLoading:
    """Mixed into a plugin model class: nemo-automodel's checkpoint loads of it are strict.

    Call ``_refuse_oversized_config(config._name_or_path, *base_args)`` first in ``__init__``
    (before the base class allocates) and ``_init_strict_loading()`` at its end. ``_checkpoint_key_mapping`` is
    what nemo-automodel reads as the model's ``_checkpoint_conversion_mapping`` (None: none).
    """

    _checkpoint_key_mapping: dict[str, str] | None = None

    def _init_strict_loading(self) -> None:
        self._checked_checkpoint: tuple[tuple, dict[str, Path]] | None = None
        adapter = getattr(self, "state_dict_adapter", None)
        if adapter is not None:
            self.state_dict_adapter = strict_adapter(adapter, self._checkpoint_name_of)

    def _refuse_oversized_config(self, name_or_path, *args: Any, **kwargs: Any) -> None:
        """Call first in ``__init__`` with the arguments of the model class below this mixin: that
        class is built on the meta device (no memory) and refused (``refuse_oversized``) when its
        config asks for far more than the checkpoint at ``name_or_path`` holds. nemo-automodel's
        from_pretrained builds a model before it reads the checkpoint, each parameter allocated
        first (``init_empty_weights`` moves it to meta afterwards), so a config.json that does not
        describe its weights would allocate what it asks for before any check reads the files."""
        path = _local_checkpoint(name_or_path)
        if path is None or not (path.is_file() or any(path.glob("*.safetensors"))):
            return
        mro = type(self).__mro__
        base = mro[mro.index(StrictCheckpointLoading) + 1]
        with torch.device("meta"):
            skeleton = base(*args, **kwargs)
        adapter = getattr(skeleton, "state_dict_adapter", None)
        refuse_oversized(skeleton, adapter if adapter is not None else IdentityAdapter(skeleton), path)

    def _checkpoint_adapter(self):
        """The state-dict adapter the checks convert names with (the identity when there is none)."""
        adapter = getattr(self, "state_dict_adapter", None)
        return adapter if adapter is not None else IdentityAdapter(self)

    @property
    def _checkpoint_conversion_mapping(self) -> dict[str, str] | None:
        # Read by nemo-automodel when it is about to load the base checkpoint from the model's
        # source (``config._name_or_path`` under from_pretrained): the files are checked first.
        path = _local_checkpoint(getattr(self.config, "_name_or_path", None))
        # A source without safetensors files (a config-only directory, a DCP checkpoint) is not
        # a base checkpoint nemo-automodel reads here.
        if path is not None and (path.is_file() or any(path.glob("*.safetensors"))):
            self.check_checkpoint_source(path)
        return self._checkpoint_key_mapping

    def check_checkpoint_source(self, path: str | os.PathLike) -> dict[str, Path]:
        """Check the checkpoint at ``path`` against this model (module docstring); ``{key: file}``.

        Files unchanged since the last check (same paths, sizes and modification times) are not
        read again: nemo-automodel reads the model's mapping more than once per load."""
        adapter = self._checkpoint_adapter()
        files = checkpoint_files(path)
        signature = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
        checked = getattr(self, "_checked_checkpoint", None)
        if checked is None or checked[0] != signature:
            where = check_checkpoint_files(self, adapter, path)
            if getattr(self, "state_dict_adapter", None) is None:
                # No adapter's from_hf sees the tensors on their way in: their values are checked here.
                root = link_root(path)
                for file in files:
                    check_finite(load_safetensors(file, follow_links=True, root=root),
                                 lambda key, file=file: f"checkpoint tensor {key} (file {file})")
            self._checked_checkpoint = (signature, where)
        return self._checked_checkpoint[1]

    def _checkpoint_name_of(self, native: str) -> str:
        """A model tensor's name in checkpoint terms, with its file when known."""
        checked = getattr(self, "_checked_checkpoint", None)
        where = checked[1] if checked is not None else {}
        return strict_names_for(self, self.state_dict_adapter, where)(native)


class IdentityAdapter:
    """The names of a model whose state-dict keys are its checkpoint keys (nemo_dsa's own
    ``NemoDsaV4ForCausalLM``), for the checks above; a tied ``head.weight`` is not stored."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = getattr(model, "config", None)
        self._skip = {"head.weight"} if getattr(config, "tie_word_embeddings", False) else set()

    def convert_single_tensor_to_hf(self, name: str, value: torch.Tensor, **_: object):
        return [] if name in self._skip else [(name, value)]


# A model built on the meta device for a checkpoint is refused before it is materialised when its
# parameters would hold more than this many times the checkpoint's values (plus the slack): a
# config.json that does not describe its weights (vocab_size=2**30 beside a tiny model). The exact
# key / shape check follows when the checkpoint is read; a from_config run that grows a model
# past this is the only other case it refuses.
OVERSIZE_FACTOR = 4
OVERSIZE_SLACK = 2**28


def refuse_oversized(model: torch.nn.Module, adapter, path: str | Path) -> None:
    """ValueError naming the largest mismatching tensor when ``model`` (on the meta device) would
    hold far more than the checkpoint at ``path`` (its headers only); nothing is allocated."""
    params = [(name, p) for name, p in model.named_parameters() if p.device.type == "meta"]
    wanted = sum(p.numel() for _, p in params)
    if not params:
        return
    root = link_root(path)
    files = checkpoint_files(path)
    headers = {}
    for file in files:
        headers.update({key: (file, entry) for key, entry in read_safetensors_header(file, root=root).items()})
    held = sum(math.prod(shape) for _, (_, shape) in headers.values())
    if wanted <= OVERSIZE_FACTOR * held + OVERSIZE_SLACK:
        return
    name, largest = max(params, key=lambda item: item[1].numel())
    keys = [k for k, _ in adapter.convert_single_tensor_to_hf(name, _whole_on_meta(largest))] or [name]
    found = headers.get(keys[0])
    there = f"{found[0]} holds {list(found[1][1])}" if found else f"{path} has no {keys[0]}"
    raise ValueError(
        f"config of {path}: {type(model).__name__} would hold {wanted:,} parameters, but the checkpoint holds "
        f"{held:,} values; its config gives {keys[0]} the shape {list(largest.shape)} where {there} "
        "(config.json does not describe these weights: refused before allocating them)"
    )


def strict_names_for(model: torch.nn.Module, adapter, where: dict[str, Path]) -> Callable[[str], str]:
    """``name_of`` for ``check_finite`` on a model's converted tensors: checkpoint key and file."""
    state = model.state_dict()

    def name_of(native: str) -> str:
        value = state.get(native)
        keys = [] if value is None else [
            k for k, _ in adapter.convert_single_tensor_to_hf(native, _whole_on_meta(value))
        ]  # fmt: skip
        if not keys:
            return f"checkpoint tensor for {native}"
        files = sorted({str(where[k]) for k in keys if k in where})
        key = keys[0] if len(keys) == 1 else f"{keys[0]} .. {keys[-1]}"
        return f"checkpoint tensor {key} (model tensor {native}" + (f", file {files[0]})" if files else ")")

    return name_of
