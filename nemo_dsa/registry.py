"""Name -> model builder registry.

Two kinds of names are registered:
- presets ``dsa-{v4,v41}-{tiny,small,flash}``: a model YAML of ``configs/model/`` combined with a
  scoring YAML of ``configs/scoring/``, built through ``nemo_dsa.builder`` exactly as the
  Hydra recipe builds them;
- the architecture names nemo-automodel knows the models by, ``NemoDsaV4ForCausalLM`` and
  ``NemoDsaV41ForCausalLM``: the tiny preset's fields with that scoring, any field overridable.

Every builder has the signature ``builder(*, device="cpu", **config_overrides) -> nn.Module``,
where ``config_overrides`` replace single ``DSAModelConfig`` fields.

    >>> import nemo_dsa.registry as registry
    >>> registry.list()[:2]
    ['NemoDsaV41ForCausalLM', 'NemoDsaV4ForCausalLM']
    >>> model = registry.get("dsa-v41-tiny")(device="meta")
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

import torch

Builder = Callable[..., torch.nn.Module]
_REGISTRY: dict[str, Builder] = {}


def register(name: str, *, exist_ok: bool = False) -> Callable[[Builder], Builder]:
    """Decorator registering ``builder`` under ``name`` (``exist_ok`` allows replacing)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")

    def decorate(builder: Builder) -> Builder:
        if not callable(builder):
            raise TypeError(f"builder registered as {name!r} must be callable, got {type(builder).__name__}")
        if name in _REGISTRY and not exist_ok:
            raise ValueError(f"name {name!r} is already registered (pass exist_ok=True to replace it)")
        _REGISTRY[name] = builder
        return builder

    return decorate


def get(name: str) -> Builder:
    """The builder registered under ``name``."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"name {name!r} is not registered; registered names: {list()}") from None


def list() -> builtins.list[str]:  # noqa: A001 - the registry's public verb
    """Registered names, sorted."""
    return sorted(_REGISTRY)


def build(name: str, **kwargs: Any) -> torch.nn.Module:
    """Shorthand for ``get(name)(**kwargs)``."""
    return get(name)(**kwargs)


def _preset_builder(model_option: str, scoring_option: str) -> Builder:
    def build_preset(*, device: str | torch.device | None = None, seed: int | None = 0, **overrides: Any):
        from nemo_dsa.builder import build_model, load_config_node

        node = load_config_node("model", model_option)
        config = {**node["config"], **overrides}
        scoring = load_config_node("scoring", scoring_option)
        return build_model(
            config, scoring, device=device or node.get("device", "cpu"), dtype=node.get("dtype"),
            seed=seed, name=node.get("name", model_option),
        )

    build_preset.__doc__ = (
        f"configs/model/{model_option}.yaml with configs/scoring/{scoring_option}.yaml "
        "(kwargs: device, seed, DSAModelConfig field overrides)."
    )
    return build_preset


_PRESETS = {"tiny": "tiny", "small": "small", "flash": "v4_flash"}
for _scoring in ("v4", "v41"):
    for _short, _option in _PRESETS.items():
        register(f"dsa-{_scoring}-{_short}")(_preset_builder(_option, _scoring))

# The architecture names of nemo_dsa.integrations.automodel (see pyproject's entry points).
register("NemoDsaV4ForCausalLM")(_preset_builder("tiny", "v4"))
register("NemoDsaV41ForCausalLM")(_preset_builder("tiny", "v41"))
