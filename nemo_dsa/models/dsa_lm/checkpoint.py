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
    """The tensors of a safetensors checkpoint, by name."""
    from safetensors.torch import load_file

    target = _file(path)
    if not os.path.isfile(target):
        raise FileNotFoundError(f"path: no checkpoint file at {target}")
    return load_file(target)


def load_checkpoint(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Load a checkpoint written by :func:`save_checkpoint` (or by hand with the same names).

    Raises ValueError naming the keys when names are missing or unexpected (``strict``) or
    shapes differ. Tensors are cast to the parameters' dtype and device.
    """
    tensors = read_checkpoint(path)
    expected = {k: v for k, v in model.state_dict().items() if k not in _tied_keys(model)}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if strict and (missing or unexpected):
        raise ValueError(f"checkpoint keys do not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    wrong = [
        f"{k}: checkpoint {list(tensors[k].shape)} vs model {list(v.shape)}"
        for k, v in expected.items()
        if k in tensors and tensors[k].shape != v.shape
    ]
    if wrong:
        raise ValueError("checkpoint shapes do not match the model: " + "; ".join(wrong[:8]))
    with torch.no_grad():
        for key, target in expected.items():
            if key in tensors:
                target.copy_(tensors[key].to(dtype=target.dtype, device=target.device))
    return model
