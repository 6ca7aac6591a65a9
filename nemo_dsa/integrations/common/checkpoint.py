"""Load a DeepSeek-V4 HF checkpoint (bf16, or FP8 with ``.scale`` tensors) into the plugin, strictly.

The files are read as written (``*.safetensors`` of a directory), converted by nemo-automodel's
own ``DeepSeekV4StateDictAdapter.from_hf`` (dequantisation, expert stacking, renames) and
checked before anything is copied (``strict_loading``): a missing, unexpected, misshapen or
wrongly typed (integer / bool for a float tensor, or the reverse) tensor, or a non-finite weight,
is a ``ValueError`` naming the checkpoint key and its file; an unreadable or truncated file is one
naming that file. Works for the built-in
``DeepseekV4ForCausalLM`` as well (same names), which is how the tests load both from one file set,
and for DeepSeek-V4.1 models (built-in or ``NemoDsaDeepseekV41ForCausalLM``), through their own
``DeepseekV41StateDictAdapter`` (32x32 e8m0-scaled FP8).

nemo-automodel's recipes load checkpoints through their own checkpointer (the same adapter);
this function is the strict, single-process path for tests, tools and notebooks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from nemo_dsa.integrations.common.strict_loading import (
    StrictCheckpointLoading,
    check_checkpoint_files,
    check_finite,
    checkpoint_files,
    read_safetensors_header,
    strict_names_for,
)

__all__ = ["load_hf_checkpoint", "read_hf_checkpoint"]


def read_hf_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path`` (a directory or one file)."""
    from safetensors.torch import load_file

    path = Path(path)
    files = checkpoint_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        read_safetensors_header(file)  # a damaged file is an error naming it
        try:
            content = load_file(str(file))
        except Exception as err:  # safetensors' own errors name no file
            raise ValueError(f"checkpoint file {file} could not be read: {err}") from err
        for key, value in content.items():
            if key in tensors:
                raise ValueError(f"checkpoint key {key} appears in more than one file of {path}")
            tensors[key] = value
    return tensors


def _adapter(model):
    adapter = getattr(model, "state_dict_adapter", None)
    if adapter is not None:
        return adapter
    from nemo_automodel.components.models.deepseek_v4.state_dict_adapter import DeepSeekV4StateDictAdapter

    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return DeepSeekV4StateDictAdapter(model.config, model.model.moe_config, model.backend, dtype=dtype)


def load_hf_checkpoint(model: torch.nn.Module, path: str | Path) -> None:
    """Load the HF-format DeepSeek-V4 checkpoint at ``path`` into ``model`` (see the module docstring)."""
    adapter = _adapter(model)
    if isinstance(model, StrictCheckpointLoading) and adapter is getattr(model, "state_dict_adapter", None):
        where = model.check_checkpoint_source(path)  # its adapter names files in its own checks
    else:
        where = check_checkpoint_files(model, adapter, path)
    hf = read_hf_checkpoint(path)
    expected = model.state_dict()
    # Which checkpoint key each model tensor comes from, for messages in checkpoint terms.
    hf_name = {}
    for key, value in expected.items():
        names = [k for k, _ in adapter.convert_single_tensor_to_hf(key, value)]
        hf_name[key] = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
    try:
        native = adapter.from_hf(dict(hf))
    except (RuntimeError, AssertionError) as err:  # e.g. a weight and its .scale do not fit
        raise ValueError(f"checkpoint {path} could not be converted: {err}") from err
    check_finite(native, strict_names_for(model, adapter, where))
    missing = sorted(expected.keys() - native.keys())
    if missing:
        raise ValueError(
            f"checkpoint {path} lacks {hf_name[missing[0]]} (model tensor {missing[0]})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    unexpected = sorted(native.keys() - expected.keys())
    if unexpected:
        source = [k for k, _ in adapter.convert_single_tensor_to_hf(unexpected[0], native[unexpected[0]])]
        raise ValueError(
            f"checkpoint {path} has {source[0] if source else unexpected[0]} (model name {unexpected[0]}), "
            "which the model does not have"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
        )
    for key, value in native.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"checkpoint {path}: {hf_name[key]} gives {key} the shape {tuple(value.shape)}, "
                f"the model has {tuple(expected[key].shape)}"
            )
    with torch.no_grad():
        model.load_state_dict(native, strict=True)
