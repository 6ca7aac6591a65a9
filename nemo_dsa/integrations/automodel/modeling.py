"""nemo-automodel integration: transformers config classes and registry-ready model classes.

nemo-automodel finds ``NemoDsaV4ForCausalLM`` / ``NemoDsaV41ForCausalLM`` through the
``nemo_automodel.architectures`` entry points declared in ``pyproject.toml`` and imports this
module lazily (``import nemo_dsa`` never does). Importing it registers the two config classes with
transformers' ``AutoConfig`` (model types ``nemo_dsa_v4`` / ``nemo_dsa_v41``), because
nemo-automodel has no entry point for plugin configs.

How nemo-automodel builds a custom model (``_transformers/model_init.py`` in 0.7.0, read to
match it): the class comes from ``config.architectures[0]``; ``supports_config`` may decline; the
constructor is called as ``cls(config, **kwargs)`` with ``backend`` turned into a
``BackendConfig``; the model is usually built with its parameters on the meta device, materialised
with ``torch.empty_like`` (parameters, and buffers left on meta), then
``initialize_weights(dtype=...)`` is called. So ``initialize_weights`` here rewrites every
parameter and every buffer.

``NeMoAutoModelForCausalLM.from_pretrained`` on a checkpoint the recipe saved reads its
``config.json`` through ``AutoConfig`` *before* the registry imports this module: import
``nemo_dsa.integrations.automodel`` first (a recipe whose config node targets one of the config
classes below does so by itself).

The model classes subclass nemo_dsa's own ``DSAForCausalLM``, so state-dict keys stay the
DeepSeek-V4 checkpoint names; ``self.config`` is swapped for the transformers config, which
carries every ``DSAModelConfig`` field under the same name (plus the transformers ones).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import AutoConfig, PretrainedConfig

from nemo_dsa.integrations.common.aux_loss import attach_indexer_loss
from nemo_dsa.integrations.common.strict_loading import StrictCheckpointLoading
from nemo_dsa.layers.fp32_parameters import fp32_parameter_names
from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig
from nemo_dsa.models.dsa_lm.hf_format import HF_FIELD_NAMES
from nemo_dsa.models.dsa_lm.modeling import DSAForCausalLM

__all__ = [
    "NemoDsaV4Config",
    "NemoDsaV41Config",
    "NemoDsaV4ForCausalLM",
    "NemoDsaV41ForCausalLM",
    "register_with_transformers",
]

# DSAModelConfig fields the transformers config carries; ``scoring`` is fixed by the class.
_DSA_FIELDS = tuple(f for f in dataclasses.fields(DSAModelConfig) if f.name != "scoring")
# DSAModelConfig.backend (the indexer kernels) is stored as ``indexer_backend``: nemo-automodel
# moves any ``from_config`` kwarg whose name is a config key onto the config, and its own
# ``backend`` kwarg (a BackendConfig) would land on it. ``config.backend`` stays readable.
# DSAModelConfig.rope_scaling is stored as ``compress_rope_scaling``: transformers' PretrainedConfig
# turns ``rope_scaling`` into a property over its own ``rope_parameters`` (rewriting the dict).
# The same table writes the recipe's exported config.json (models.dsa_lm.hf_format).
_HF_NAMES = HF_FIELD_NAMES
# Tuple-typed fields (compress_ratios, layer-id lists): JSON round trips turn them into lists.
_TUPLE_FIELDS = frozenset(f.name for f in _DSA_FIELDS if "tuple" in str(f.type))
# nemo-automodel's BackendConfig.attn values that name nemo_dsa kernels (indexer and attention).
_ATTN_TO_NEMO_DSA_BACKEND = {"tilelang": "tilelang", "torch": "torch"}


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


class _NemoDsaConfigBase(PretrainedConfig):
    """Shared body of the two config classes; ``scoring`` is set by the subclass.

    Every ``DSAModelConfig`` field is an attribute of the same name (``backend`` is a read-only
    alias of ``indexer_backend``, see ``_HF_NAMES``); values are validated by building the
    ``DSAModelConfig``, so a bad value fails here with a message naming the key.
    """

    # Class attributes (ClassVar: transformers turns annotated config attributes into dataclass
    # fields). The scoring mode is what tells the two classes apart.
    scoring: ClassVar[str] = ""
    architecture_name: ClassVar[str] = ""

    def __init__(self, **kwargs: Any) -> None:
        given_scoring = kwargs.pop("scoring", None)
        if given_scoring is not None and given_scoring != self.scoring:
            raise ValueError(
                f"scoring is fixed to {self.scoring!r} for {type(self).__name__}, got {given_scoring!r}; "
                f"use the other config class to switch scoring"
            )
        for dsa_name, hf_name in _HF_NAMES.items():
            if dsa_name in kwargs:  # the DSAModelConfig name, e.g. from from_dsa_config or a YAML node
                if hf_name in kwargs:
                    raise ValueError(f"give {hf_name} or {dsa_name}, not both")
                kwargs[hf_name] = kwargs.pop(dsa_name)
        for f in _DSA_FIELDS:
            name = _HF_NAMES.get(f.name, f.name)
            value = kwargs.pop(name, _field_default(f))
            if f.name in _TUPLE_FIELDS and value is not None:
                value = tuple(int(v) for v in value)
            setattr(self, name, value)
        kwargs.setdefault("architectures", [self.architecture_name])
        super().__init__(tie_word_embeddings=self.tie_word_embeddings, **kwargs)
        self.to_dsa_config()

    @property
    def backend(self) -> str:
        """The indexer kernel choice under its ``DSAModelConfig`` name."""
        return self.indexer_backend

    @property
    def rope_scaling(self) -> dict | None:
        """The compressed layers' YaRN scaling under its ``DSAModelConfig`` name (replaces
        PretrainedConfig's alias of ``rope_parameters``, which this config does not use)."""
        return self.__dict__.get("compress_rope_scaling")

    @rope_scaling.setter
    def rope_scaling(self, value: dict | None) -> None:
        self.compress_rope_scaling = value

    def to_dsa_config(self, **overrides: Any) -> DSAModelConfig:
        """The equivalent ``DSAModelConfig`` (``overrides`` replace single fields by their
        ``DSAModelConfig`` names)."""
        values = {f.name: getattr(self, _HF_NAMES.get(f.name, f.name)) for f in _DSA_FIELDS}
        values.update(overrides)
        return DSAModelConfig(scoring=self.scoring, **values)

    @classmethod
    def from_dsa_config(cls, config: DSAModelConfig, **kwargs: Any) -> "_NemoDsaConfigBase":
        """Wrap a ``DSAModelConfig``; its ``scoring`` must match this class."""
        if not isinstance(config, DSAModelConfig):
            raise TypeError(f"config must be a DSAModelConfig, got {type(config).__name__}")
        values = {f.name: getattr(config, f.name) for f in _DSA_FIELDS}
        return cls(scoring=config.scoring, **values, **kwargs)


class NemoDsaV4Config(_NemoDsaConfigBase):
    """transformers config of the DSA causal LM with DeepSeek-V4 indexer scoring."""

    model_type = "nemo_dsa_v4"
    scoring = "v4"
    architecture_name = "NemoDsaV4ForCausalLM"

    def __init__(self, **kwargs: Any) -> None:
        # Defined here because transformers generates a dataclass __init__ for every config
        # subclass that lacks one, which would bypass the base class's.
        super().__init__(**kwargs)


class NemoDsaV41Config(_NemoDsaConfigBase):
    """transformers config of the DSA causal LM with DeepSeek-V4.1 indexer scoring."""

    model_type = "nemo_dsa_v41"
    scoring = "v41"
    architecture_name = "NemoDsaV41ForCausalLM"

    def __init__(self, **kwargs: Any) -> None:
        # Defined here because transformers generates a dataclass __init__ for every config
        # subclass that lacks one, which would bypass the base class's.
        super().__init__(**kwargs)


def register_with_transformers() -> None:
    """Register both config classes with ``AutoConfig`` (safe to call repeatedly)."""
    for config_cls in (NemoDsaV4Config, NemoDsaV41Config):
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)


def _backend_from_attn(backend: Any, default: str | None) -> str | None:
    """nemo_dsa kernel choice from nemo-automodel's ``backend`` (BackendConfig, dict or None).

    Only ``attn`` has a meaning here ("tilelang" or "torch" pick the indexer's and the attention's
    kernels); the other BackendConfig fields (linear, rms_norm, experts, ...) concern modules this
    model does not have, and attn values such as "sdpa" (BackendConfig's default) leave the
    config's choice (``default``) in place.
    """
    if backend is None:
        return default
    attn = backend.get("attn") if isinstance(backend, dict) else getattr(backend, "attn", None)
    return _ATTN_TO_NEMO_DSA_BACKEND.get(attn, default)


class _NemoDsaForCausalLMBase(StrictCheckpointLoading, DSAForCausalLM):
    """nemo-automodel-facing wrapper around ``DSAForCausalLM`` (same modules, same state dict)."""

    config_class: type[_NemoDsaConfigBase] = _NemoDsaConfigBase

    @dataclass(frozen=True)
    class ModelCapabilities:
        # Read by nemo_automodel._transformers.model_capabilities.query_capabilities.
        # THD: the forward consumes the THD collater's position_ids/seq_lens and builds its own
        # per-document visibility. CP: the model shards contiguously through its own
        # prepare_model_inputs_for_cp hook (integrations.automodel.cp) and gathers keys itself from
        # the cp_group it is given; no TP/PP plans; dense MLP, so no EP.
        supports_tp: bool = False
        supports_cp: bool = True
        supports_pp: bool = False
        supports_ep: bool = False
        supports_thd: bool = True

    # nemo-automodel's packing check (ModelSupports.supports_sequence_packing): the model masks
    # documents itself from the packing metadata, no attention backend has to do it.
    _owns_packed_attention = True
    # Under CP the attention module gathers compressed keys and window tails itself.
    _owns_cp_attention = True

    def prepare_model_inputs_for_cp(self, batch: dict[str, Any], *, num_chunks: int = 1) -> dict:
        """nemo-automodel's CP hook: contiguous shards padded to whole compression groups."""
        from nemo_dsa.integrations.automodel.cp import prepare_model_inputs_for_cp

        return prepare_model_inputs_for_cp(self.dsa_config.compress_ratios, batch, num_chunks=num_chunks)

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype | None = None) -> "_NemoDsaForCausalLMBase":
        """transformers-style loading of an HF-format folder (``config.json`` + ``model.safetensors``,
        as ``nemo-dsa-export`` writes it): JSON and safetensors only, every key checked, eval mode.
        ``dtype`` casts the floating-point parameters the layers do not keep in fp32.

        The folder may come from someone else: both files are read as regular files inside it
        (``nemo_dsa._untrusted``), and the sizes ``config.json`` gives are compared with the
        weights' header before the model is built (a config that does not describe its weights is
        a ValueError naming the file and key, not an allocation of what it asks for)."""
        from nemo_dsa._untrusted import read_json
        from nemo_dsa.models.dsa_lm.checkpoint import check_config_fits, load_checkpoint
        from nemo_dsa.models.dsa_lm.hf_format import CONFIG_FILE, WEIGHTS_FILE

        folder = os.path.join(os.fspath(path), "")
        config_file = os.path.join(folder, CONFIG_FILE)
        if not os.path.isdir(folder) or not os.path.lexists(config_file):
            raise FileNotFoundError(f"{path}: not an HF-format folder (no {CONFIG_FILE})")
        config_dict = read_json(config_file, expect=dict)
        if config_dict.get("model_type") != cls.config_class.model_type:
            raise ValueError(f"{path}: config.json's model_type is {config_dict.get('model_type')!r}, "
                             f"{cls.__name__} reads {cls.config_class.model_type!r}")
        try:
            config = cls.config_class.from_dict(config_dict)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{config_file}: {e}") from None
        weights = os.path.join(folder, WEIGHTS_FILE)
        check_config_fits(config.to_dsa_config(), weights, where=f"{config_file} against {WEIGHTS_FILE}")
        model = cls(config)
        load_checkpoint(model, weights, strict=True, where=str(path))
        if dtype is not None:
            keep_fp32 = fp32_parameter_names(model)
            for name, p in model.named_parameters():
                if p.is_floating_point() and name not in keep_fp32:
                    p.data = p.data.to(dtype)
        return model.eval()

    @classmethod
    def supports_config(cls, config: Any) -> bool:
        """True for this class's own config type (and any config with the same model_type)."""
        return getattr(config, "model_type", None) == cls.config_class.model_type

    def __init__(self, config: Any, moe_config: Any = None, backend: Any = None, **kwargs: Any) -> None:
        # moe_config and other recipe kwargs do not apply: the MLP is dense.
        if isinstance(config, DSAModelConfig):
            config = self.config_class.from_dsa_config(config)
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"config must be a {self.config_class.__name__} (or a DSAModelConfig with scoring "
                f"{self.config_class.scoring!r}), got {type(config).__name__}"
            )
        dsa_config = config.to_dsa_config(
            backend=_backend_from_attn(backend, config.backend),
            attention_backend=_backend_from_attn(backend, config.attention_backend),
        )
        self._refuse_oversized_config(getattr(config, "_name_or_path", None), dsa_config)
        super().__init__(dsa_config)
        self.dsa_config = dsa_config
        # nemo-automodel reads architectures/model_type/to_dict() from model.config; every
        # DSAModelConfig field is also an attribute of the transformers config.
        self.config = config
        if backend is not None and not isinstance(backend, dict):
            self.backend = backend
        # nemo-automodel's loads of the folder at config._name_or_path: strict, like the plugins'.
        self._init_strict_loading()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any):
        """``DSAForCausalLM.forward``. Without ``labels`` (nemo-automodel's trainer computes the loss
        from the logits) enabled indexer KL losses ride on the logits into the backward, at the
        trainer's gradient for auxiliary losses (``nemo_dsa.integrations.common.aux_loss``); with labels
        they are part of ``loss``."""
        out = super().forward(input_ids, labels=labels, **kwargs)
        if labels is None:
            out.logits = attach_indexer_loss(out.logits, out.aux_loss)
        return out

    @torch.no_grad()
    def initialize_weights(
        self,
        buffer_device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **_unused: Any,
    ) -> None:
        """Re-initialise every parameter and buffer in place (CPU-safe).

        nemo-automodel calls this as ``initialize_weights(dtype=...)`` after materialising meta
        tensors with uninitialised memory. Parameters get ``DSAForCausalLM``'s own scheme (so the
        result follows ``torch.manual_seed``); buffers are recomputed (``_reset_buffers``);
        floating-point parameters are then cast to ``dtype`` when given, except those the layers
        keep in fp32 (sinks, compressors: ``nemo_dsa.layers.fp32_parameters``). ``buffer_device`` is
        accepted for the recipes that pass it; buffers stay on the parameters' device.
        """
        super().initialize_weights()
        self._reset_buffers()
        if dtype is not None:
            keep_fp32 = fp32_parameter_names(self)
            for name, p in self.named_parameters():
                if p.is_floating_point() and p.dtype != dtype and name not in keep_fp32:
                    p.data = p.data.to(dtype)

    def _reset_buffers(self) -> None:
        """Overwrite every buffer with the value a fresh construction gives it.

        A skeleton of the model is built with its parameters on the meta device (no parameter
        memory, no init work) but real buffers, and each buffer is copied over by name. Generic
        on purpose: it covers RoPE tables and any other buffer the layers register, whatever
        their modules compute in ``__init__``.
        """
        dsa_config = getattr(self, "dsa_config", None)
        if dsa_config is None or next(self.buffers(), None) is None:
            return  # called from DSAForCausalLM.__init__ (buffers are fresh), or nothing to reset
        with _parameters_on_meta():
            skeleton = DSAForCausalLM(dsa_config)
        fresh = dict(skeleton.named_buffers())
        for name, buf in self.named_buffers():
            value = fresh.get(name)
            if value is None:  # a buffer added after construction: nothing to recompute it from
                continue
            if value.shape != buf.shape:
                raise RuntimeError(
                    f"buffer {name} has shape {tuple(buf.shape)}, a fresh build gives {tuple(value.shape)}"
                )
            buf.copy_(value.to(device=buf.device, dtype=buf.dtype))


class NemoDsaV4ForCausalLM(_NemoDsaForCausalLMBase):
    """The DSA causal LM with DeepSeek-V4 indexer scoring, built from a ``NemoDsaV4Config``."""

    config_class = NemoDsaV4Config


class NemoDsaV41ForCausalLM(_NemoDsaForCausalLMBase):
    """The DSA causal LM with DeepSeek-V4.1 indexer scoring, built from a ``NemoDsaV41Config``."""

    config_class = NemoDsaV41Config


@contextlib.contextmanager
def _parameters_on_meta():
    """Within the block, every registered parameter is moved to the meta device; buffers are not."""
    original = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


register_with_transformers()
