"""The nemo_dsa module config of a DeepSeek-V4.1 plugin model or attention layer.

One resolution for both entry points (``NemoDsaDeepseekV41ForCausalLM`` and a
``NemoDsaDeepseekV41Attention`` built on its own from the built-in's ``(config, layer_idx,
backend)``, ``config`` the V4.1 config or its text config): ``indexer_backend``,
``attention_backend`` and ``fused_topk`` come from constructor keywords, else config attributes of
the same name; ``backend.attn`` of ``tilelang`` / ``torch`` selects the indexer's and the
attention's kernels unless those are given.
"""

from __future__ import annotations

from typing import Any

from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig

__all__ = ["OPTIONS", "dsa_config_from_deepseek_v41", "resolve_dsa_config"]

OPTIONS = ("indexer_backend", "attention_backend", "fused_topk")
ATTN_TO_NEMO_DSA_BACKEND = {"tilelang": "tilelang", "torch": "torch"}


def dsa_config_from_deepseek_v41(config, **options: Any) -> DSAModelConfig | None:
    """nemo_dsa's module config for every attention layer of ``config`` (its ``text_config``;
    None when it has none: nothing runs nemo_dsa there).

    ``options`` are ``DSAModelConfig`` fields (``backend``, ``attention_backend``, ``fused_topk``);
    None leaves the default."""
    overrides = {k: v for k, v in options.items() if v is not None}
    return DSAModelConfig.from_hf_config_or_none(config, **overrides)


def resolve_dsa_config(config, backend: Any, kwargs: dict) -> DSAModelConfig | None:
    """``dsa_config_from_deepseek_v41`` with the options popped from ``kwargs`` (else the config's)
    and the kernels ``backend.attn`` names (see the module docstring)."""
    options = {name: kwargs.pop(name, None) for name in OPTIONS}
    options = {name: value if value is not None else getattr(config, name, None) for name, value in options.items()}
    attn = ATTN_TO_NEMO_DSA_BACKEND.get(getattr(backend, "attn", None))
    indexer_backend = options.pop("indexer_backend") or attn
    options["attention_backend"] = options["attention_backend"] or attn
    return dsa_config_from_deepseek_v41(config, backend=indexer_backend, **options)
