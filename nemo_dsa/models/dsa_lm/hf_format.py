"""nemo_dsa's own causal LM as an HF-format folder: ``config.json`` + ``model.safetensors``.

The folder is what transformers and nemo-automodel read: ``config.json`` names the model type
(``nemo_dsa_v4`` / ``nemo_dsa_v41``) and architecture (``NemoDsaV4ForCausalLM`` /
``NemoDsaV41ForCausalLM``) that ``nemo_dsa.integrations.automodel`` registers, with every
``DSAModelConfig`` field under the transformers config's name (``HF_FIELD_NAMES``);
``model.safetensors`` holds the weights under their DeepSeek-V4 names, with the ``format: pt``
metadata transformers' loader asks for. Only JSON and safetensors are read back: nothing in the
folder can run code.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# DSAModelConfig names stored under another name in the transformers config: nemo-automodel moves a
# ``from_config`` kwarg named like a config key onto the config (its own ``backend`` kwarg would
# land on the indexer's), and PretrainedConfig turns ``rope_scaling`` into a property of its own.
HF_FIELD_NAMES = {"backend": "indexer_backend", "rope_scaling": "compress_rope_scaling"}
# scoring -> (model_type, architecture) of the registered transformers classes.
HF_ARCHITECTURES = {"v4": ("nemo_dsa_v4", "NemoDsaV4ForCausalLM"), "v41": ("nemo_dsa_v41", "NemoDsaV41ForCausalLM")}


def hf_config_dict(config: DSAModelConfig) -> dict[str, Any]:
    """``config.json``'s contents for ``config`` (what ``AutoConfig.from_pretrained`` reads back)."""
    model_type, architecture = HF_ARCHITECTURES[config.scoring]
    values = {}
    for f in dataclasses.fields(DSAModelConfig):
        if f.name == "scoring":  # fixed by the model type
            continue
        value = getattr(config, f.name)
        values[HF_FIELD_NAMES.get(f.name, f.name)] = list(value) if isinstance(value, tuple) else value
    return {"architectures": [architecture], "model_type": model_type, "dtype": "float32", **values}


def write_hf_folder(tensors: dict, config: DSAModelConfig, out: str | os.PathLike) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into the new or empty directory ``out``.

    ``tensors``: the model's state dict by DeepSeek-V4 names (a tied ``head.weight`` left out).
    Each file is written under a temporary name and renamed, so a failure leaves no partial file.
    """
    from safetensors.torch import save

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights_tmp = out / f".tmp-{WEIGHTS_FILE}"
    config_tmp = out / f".tmp-{CONFIG_FILE}"
    try:
        # Serialised in memory and written as any file (mode 0666 less the umask, as config.json):
        # safetensors' own writer creates its file 0600.
        data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata={"format": "pt"})
        weights_tmp.write_bytes(data)
        config_tmp.write_text(json.dumps(hf_config_dict(config), indent=2, sort_keys=True) + "\n")
        os.replace(weights_tmp, out / WEIGHTS_FILE)
        os.replace(config_tmp, out / CONFIG_FILE)
    finally:
        weights_tmp.unlink(missing_ok=True)
        config_tmp.unlink(missing_ok=True)
    return out
