"""The nemo_dsa module config of a DeepSeek-V4 plugin model or attention layer.

One resolution for both entry points (``NemoDsaDeepseekV4ForCausalLM`` and a
``NemoDsaDeepseekV4Attention`` built on its own from the built-in's ``(config, layer_idx,
backend)``): nemo_dsa options come from constructor keywords, else config attributes of the same
name; ``backend.attn`` of ``tilelang`` / ``torch`` selects the indexer's and the attention's kernels
unless those are given.
"""

from __future__ import annotations

from typing import Any

from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig

__all__ = ["OPTION_DEFAULTS", "dsa_config_from_deepseek_v4", "resolve_dsa_config"]

# nemo_dsa options read from keywords or the config; None = DSAModelConfig's default, except the
# straight-through term, off so that default gradients are the built-in's.
OPTION_DEFAULTS = {
    "scoring": None,
    "indexer_kl_coef": None,
    "indexer_straight_through": False,
    "indexer_backend": None,
    "attention_backend": None,
    "fused_topk": None,
}
# nemo-automodel's BackendConfig.attn values that name nemo_dsa kernels; others ("sdpa", "eager")
# leave them on auto.
ATTN_TO_NEMO_DSA_BACKEND = {"tilelang": "tilelang", "torch": "torch"}


def dsa_config_from_deepseek_v4(config, **options: Any) -> DSAModelConfig | None:
    """nemo_dsa's module config for every attention layer of ``config``, MTP layers included
    (None when it has none: nothing runs nemo_dsa there).

    The layers are numbered as the built-in numbers them (MTP depth d is layer
    ``num_hidden_layers + d``, window-only unless ``compress_ratios`` lists it), so
    ``num_hidden_layers`` here counts both. ``options`` are ``DSAModelConfig`` fields
    (``scoring``, ``indexer_kl_coef`` ...); None leaves the default.
    """
    overrides = {k: v for k, v in options.items() if v is not None}
    return DSAModelConfig.from_hf_config_or_none(config, include_mtp_layers=True, **overrides)


def resolve_dsa_config(config, backend: Any, kwargs: dict) -> DSAModelConfig | None:
    """``dsa_config_from_deepseek_v4`` with the options popped from ``kwargs`` (else the config's)
    and the kernels ``backend.attn`` names (see the module docstring)."""
    options = {}
    for name, default in OPTION_DEFAULTS.items():
        value = kwargs.pop(name, None)
        options[name] = value if value is not None else getattr(config, name, default)
    attn = ATTN_TO_NEMO_DSA_BACKEND.get(getattr(backend, "attn", None))
    indexer_backend = options.pop("indexer_backend") or attn
    options["attention_backend"] = options["attention_backend"] or attn
    return dsa_config_from_deepseek_v4(config, backend=indexer_backend, **options)
