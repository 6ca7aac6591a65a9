"""safetensors checkpoints with DeepSeek-V4 key names.

The model's ``state_dict()`` keys already are the DeepSeek-V4 names (``embed.weight``,
``layers.{i}.attn.wq_a.weight``, ``layers.{i}.attn.compressor.ape``, ``layers.{i}.ffn.w1.weight``,
``norm.weight``, ``head.weight`` ...), so a checkpoint is the state dict as written. With tied
embeddings ``head.weight`` is the same tensor as ``embed.weight`` and is stored once. The model
config is kept in the file's metadata (``nemo_dsa_config``, JSON) for reference.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from nemo_dsa._untrusted import SafetensorsHeader, load_safetensors, read_safetensors_header

CHECKPOINT_FILE = "model.safetensors"
_CONFIG_KEY = "nemo_dsa_config"


def _file(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    return os.path.join(path, CHECKPOINT_FILE) if os.path.isdir(path) else path


def _tied_keys(model: nn.Module) -> set[str]:
    config = getattr(model, "config", None)
    return {"head.weight"} if getattr(config, "tie_word_embeddings", False) else set()


def save_checkpoint(model: nn.Module, path: str | os.PathLike) -> str:
    """Write ``model``'s parameters to ``path`` (a ``.safetensors`` file, or a directory that
    receives ``model.safetensors``); returns the file written."""
    from safetensors.torch import save

    target = _file(path)
    tied = _tied_keys(model)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in tied}
    metadata = {}
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        metadata[_CONFIG_KEY] = json.dumps(config.to_dict(), default=str)
    # Serialised in memory, then written: a full disk is then the OSError of the write (safetensors'
    # own writer raises a SafetensorError that no caller can tell from a bad tensor).
    data = save(tensors, metadata=metadata)
    with open(target, "wb") as f:
        f.write(data)
    return target


def read_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors checkpoint, by name (a regular file only: ``nemo_dsa._untrusted``)."""
    target = _file(path)
    if not os.path.lexists(target):
        raise FileNotFoundError(f"path: no checkpoint file at {target}")
    return load_safetensors(target)


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """The header of a checkpoint's safetensors file: every key's dtype and shape, no data read."""
    target = _file(path)
    if not os.path.lexists(target):
        raise FileNotFoundError(f"path: no checkpoint file at {target}")
    return read_safetensors_header(target)


def expected_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of ``model`` holds, by name (a tied ``head.weight`` left out)."""
    return {k: v for k, v in model.state_dict().items() if k not in _tied_keys(model)}


def _is_float_dtype_name(dtype: str) -> bool:
    return dtype.startswith(("F", "BF"))  # F64 F32 F16 BF16 F8_*: floating; I* U* BOOL: not


def check_header(expected: dict[str, torch.Tensor], header: SafetensorsHeader, *, strict: bool = True,
                 where: str = "checkpoint") -> None:
    """Compare a checkpoint's header with the tensors a model expects (``expected_tensors``):
    every key present (``strict``), of the model's shape, floating where the model's tensor is.
    The first mismatch is a ValueError naming ``where``, the file and the key; no data is read."""
    file = header.file
    missing = sorted(set(expected) - set(header.tensors))
    unexpected = sorted(set(header.tensors) - set(expected))
    if strict and missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: {file} has no {missing[0]}{more}, which the model has "
                         f"(checkpoint keys do not match the model)")
    if strict and unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(f"{where}: {file} holds {unexpected[0]}{more}, which the model has not "
                         f"(checkpoint keys do not match the model)")
    for key, target in expected.items():
        if key not in header.tensors:
            continue
        dtype, shape = header.tensors[key]
        if tuple(shape) != tuple(target.shape):
            raise ValueError(f"{where}: {file}: {key} has shape {list(shape)} there but {list(target.shape)} in the "
                             "model (checkpoint shapes do not match the model)")
        if _is_float_dtype_name(dtype) != target.is_floating_point():
            kind = "floating" if target.is_floating_point() else "integer / bool"
            raise ValueError(f"{where}: {file}: {key} is {dtype}, but the model's tensor is {kind}; "
                             "only floating tensors convert between float dtypes")


def check_config_fits(config, path: str | os.PathLike, *, where: str = "checkpoint") -> SafetensorsHeader:
    """Check a ``DSAModelConfig`` (read from a file: ``config.json``, a train state) against the
    header of the checkpoint at ``path`` before any model is built: the embedding and the layer
    count straight from the header, then every key and shape of the model built on the meta
    device (no memory). A mismatch is a ValueError naming ``where``, the file and the key."""
    from nemo_dsa.models.dsa_lm.modeling import DSAForCausalLM

    header = read_header(path)
    embed = header.tensors.get("embed.weight")
    if embed is not None and tuple(embed[1]) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"{where}: vocab_size={config.vocab_size}, hidden_size={config.hidden_size} give embed.weight "
                         f"the shape {[config.vocab_size, config.hidden_size]}, but {header.file} holds {list(embed[1])}")
    layers = {k.split(".")[1] for k in header.tensors if k.startswith("layers.")}
    if len(layers) != config.num_hidden_layers:
        raise ValueError(f"{where}: num_hidden_layers={config.num_hidden_layers}, but {header.file} holds the weights "
                         f"of {len(layers)} layers")
    with torch.device("meta"):
        skeleton = DSAForCausalLM(config)
    check_header(expected_tensors(skeleton), header, where=where)
    return header


def load_checkpoint(model: nn.Module, path: str | os.PathLike, *, strict: bool = True,
                    where: str = "checkpoint") -> nn.Module:
    """Load a checkpoint written by :func:`save_checkpoint` (or by hand with the same names).

    The header is compared with the model first (``check_header``: names with ``strict``,
    shapes, integer / bool tensors for floating ones), then the tensors must be finite; each
    failure is a ValueError naming the file and key, and the model is left untouched. Tensors
    are cast to the parameters' dtype and device (float8 ones too).
    """
    expected = expected_tensors(model)
    header = read_header(path)
    check_header(expected, header, strict=strict, where=where)
    tensors = read_checkpoint(path)
    for key in expected:
        value = tensors.get(key)
        if value is not None and value.is_floating_point():
            finite = torch.isfinite(value.float() if value.element_size() == 1 else value)
            if not bool(finite.all()):
                raise ValueError(f"{where}: {header.file}: {key} holds {int((~finite).sum())} non-finite value(s) "
                                 "(NaN / inf)")
    with torch.no_grad():
        for key, target in expected.items():
            if key in tensors:
                value = tensors[key]
                value = value.float() if value.element_size() == 1 and value.is_floating_point() else value
                target.copy_(value.to(dtype=target.dtype, device=target.device))
    return model
