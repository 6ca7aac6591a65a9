"""The layout adapter both DeepSeek plugins share: a nemo_dsa ``DSASparseAttention`` under a
built-in attention's parameter names.

The nemo_dsa module (``core``) is built first and kept outside the module tree. Its submodules
are registered again under the built-in's names: the same module objects, so whatever FSDP2 or
``.to()`` does to them, ``core`` sees it, and calling them from ``core`` runs their FSDP hooks.
The few tensors ``core`` holds directly (sink logits, compressor position biases) live in
one-parameter holder modules, the layout the built-in uses for fp32 parameters, and are handed
to ``core`` for each call through ``torch.func.functional_call``.
"""

from __future__ import annotations

import torch
from torch import nn

from nemo_dsa.layers.norm import RMSNorm
from nemo_dsa.layers.sparse_attention import DSASparseAttention

__all__ = ["CoreAttention", "adopt_builtin_layout"]


def _fp32_parameter_holder(value: torch.Tensor) -> nn.Module:
    """The built-in's holder for a bare fp32 parameter (``.weight``; calling it returns the full
    tensor). Reused so the built-in's FSDP2 wrapping recognises it by class and keeps the
    parameter unsharded while the attention uses it."""
    from nemo_automodel.components.models.deepseek_v4.layers import DeepseekV4FP32Parameter

    holder = DeepseekV4FP32Parameter(value.detach().clone())
    holder.weight.requires_grad_(value.requires_grad)
    return holder


def _submodule(root: nn.Module, dotted: str) -> nn.Module | None:
    module = root
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if not isinstance(module, nn.Module):
            return None
    return module


def _owner_and_leaf(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = dotted.rpartition(".")
    return (_submodule(root, prefix) if prefix else root), leaf


class CoreAttention(nn.Module):
    """A nemo_dsa ``DSASparseAttention`` (``core``) under a built-in attention's parameter layout.

    ``module_map``: built-in submodule name -> the ``core`` submodule it is (registered here, the
    same objects); ``tensor_map``: built-in one-parameter holder -> the ``core`` tensor it stores
    (handed to ``core`` per call). Shared by the DeepSeek-V4 and V4.1 plugins.
    """

    @classmethod
    def replacing(cls, builtin: nn.Module, config, layer_idx: int, backend, dsa_config) -> "CoreAttention":
        """The replacement of a built-in attention: same parameter names, shapes, dtypes and device."""
        device = next(builtin.parameters()).device
        with torch.device(device):
            attention = cls(config, layer_idx, backend, dsa_config=dsa_config)
        return adopt_builtin_layout(builtin, attention, layer_idx)

    def __init__(self, dsa_config, layer_idx: int, module_map: dict, tensor_map: dict, builtin_class: str) -> None:
        super().__init__()
        if dsa_config is None:
            raise ValueError(f"layer_idx={layer_idx}: the config has no attention layers (num_hidden_layers=0)")
        self.layer_idx = layer_idx
        self.compress_ratio = int(dsa_config.compress_ratios[layer_idx])
        core = DSASparseAttention(dsa_config, layer_idx)
        object.__setattr__(self, "_core", core)  # not a child: its modules are registered below
        covered: set[int] = set()
        for builtin_name, nemo_name in module_map.items():
            module = _submodule(core, nemo_name)
            if module is None:
                if builtin_name in ("wo_a", "wo_b"):
                    raise ValueError(
                        f"nemo_dsa's DSASparseAttention (layer {layer_idx}) has no {nemo_name!r}: the plugin needs "
                        "the released grouped output projection (wo_a, wo_b)"
                    )
                continue  # e.g. no compressor on a window-only layer
            self._register_at(builtin_name, module)
            covered.update(id(p) for p in module.parameters())
        self._held: list[tuple[str, str]] = []  # (holder name, core tensor name)
        for builtin_name, nemo_name in tensor_map.items():
            owner, leaf = _owner_and_leaf(core, nemo_name)
            tensor = None if owner is None else owner._parameters.get(leaf)
            if tensor is None:
                continue
            self._register_at(builtin_name, _fp32_parameter_holder(tensor))
            self._held.append((builtin_name, nemo_name))
            covered.add(id(tensor))
        # Anything the nemo_dsa module owns that has no place in the built-in layout would be
        # silently untrained and unsaved: refuse it.
        orphans = [name for name, p in core.named_parameters() if id(p) not in covered]
        orphans += [name for name, _ in core.named_buffers()]
        if orphans:
            raise ValueError(
                f"nemo_dsa's DSASparseAttention (layer {layer_idx}) holds {orphans}, which have no counterpart "
                f"in nemo-automodel's {builtin_class} layout"
            )

    def _register_at(self, dotted: str, module: nn.Module) -> None:
        parent = self
        parts = dotted.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = getattr(parent, part, None)
            if child is None:
                child = self._container(".".join(parts[: depth + 1]))
                parent.add_module(part, child)
            parent = child
        parent.add_module(parts[-1], module)

    def _container(self, dotted: str) -> nn.Module:
        """The module that holds the built-in's submodules under ``dotted`` (e.g. ``compressor``); a
        plain ``nn.Module`` unless a plugin's layout needs the built-in's hooks there."""
        return nn.Module()

    def call_core(self, hidden_states: torch.Tensor, meta, ctx, shared, *, probabilities: bool = False):
        """``core(hidden_states, meta, ctx, shared)`` with the held tensors of this module; with
        ``probabilities``, ``(out, aux, probs)`` (``DSASparseAttention.forward``)."""
        core = self._core
        requested = core.config.backend if core.config.attention_backend is None else core.config.attention_backend
        if requested == "tilelang" and hidden_states.dtype != torch.bfloat16:
            # Said here, in the model's terms: the op's own check names q's dtype, not the fix.
            dtype = str(hidden_states.dtype).replace("torch.", "")
            raise TypeError(
                f"layer {self.layer_idx}: attention_backend 'tilelang' (backend.attn: tilelang) runs nemo_dsa's "
                f"TileLang kernels, which take bf16 activations, but this model computes in {dtype}: load it in "
                "bf16 (model.dtype: bfloat16), or choose attention_backend: auto (the reference attention "
                "for non-bf16 layers)"
            )
        if core.training != self.training:
            core.train(self.training)
        held = {nemo_name: _submodule(self, builtin_name)(hidden_states) for builtin_name, nemo_name in self._held}
        if probabilities:
            return torch.func.functional_call(core, held, (hidden_states, meta, ctx, shared), {"probabilities": True})
        return torch.func.functional_call(core, held, (hidden_states, meta, ctx, shared))

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | None = None, init_std: float = 0.02) -> None:
        """Truncated-normal projections, unit norm scales, zero sinks and position biases (CPU-safe)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, mean=0.0, std=init_std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        for builtin_name, _ in self._held:
            nn.init.zeros_(_submodule(self, builtin_name).weight)

    @property
    def core(self) -> DSASparseAttention:
        """The nemo_dsa module that computes this layer (shares this module's parameters)."""
        return self._core

    def setup_cp_attention(self, cp_mesh) -> None:
        """nemo-automodel's CP hook: nothing to set up, the CP group arrives with each forward."""


def adopt_builtin_layout(builtin: nn.Module, attention: nn.Module, layer_idx: int) -> nn.Module:
    """Check ``attention`` against the ``builtin`` it replaces (names and shapes), take its dtypes."""
    expected = dict(builtin.named_parameters())
    got = dict(attention.named_parameters())
    if expected.keys() != got.keys():
        raise ValueError(
            f"layer {layer_idx}: nemo_dsa attention parameters {sorted(got.keys() - expected.keys())} / built-in "
            f"parameters {sorted(expected.keys() - got.keys())} have no counterpart"
        )
    for name, param in got.items():
        reference = expected[name]
        if param.shape != reference.shape:
            raise ValueError(
                f"layer {layer_idx}: attention {name} has shape {tuple(param.shape)} in nemo_dsa's module, "
                f"{tuple(reference.shape)} in the built-in"
            )
        if param.dtype != reference.dtype:  # e.g. the built-in's fp32 compressor inside bf16 models
            param.data = param.data.to(reference.dtype)
    return attention
