"""Recompute in the backward the DeepSeek-V4 parts that are cheap to run and expensive to keep.

Counted by ``examples/saved_activations.py`` on the V4 step model (docs/performance.md v17), the
built-in's hyper-connections keep two fp32 copies of the ``[S, hc_mult * hidden]`` stream per
mixing module (its fp32 cast and its RMS-normalised copy, 128 KiB a token at hidden 4,096 and
hc_mult 4): 7 modules in 3 layers are 896 of the step's 2,454 KiB a token. Their forward is a
cast, a norm and a narrow ``[hc_mult * hidden] -> [24]`` product, a few ms a step. The blocks'
RMS norms keep two fp32 copies of their bf16 input (32 KiB a token each). Recomputing these parts
keeps only their inputs, which the blocks keep anyway, at about one extra forward of them.

``recompute`` names parts (``PARTS``); each of their modules runs under non-reentrant
``torch.utils.checkpoint`` via torch's ``checkpoint_wrapper``, the wrapper nemo-automodel's own
activation checkpointing uses, so state-dict keys, FSDP2 and nemo-automodel's ``apply_ac`` (whole
blocks, which may wrap these) are unchanged. Values and gradients are the plain step's, bitwise
(tests/test_recompute.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper

__all__ = ["PARTS", "apply_recompute", "recompute_parts"]

# part -> (module names inside every decoder block, module names on the backbone ``model``), per family
PARTS = {
    "hyper_connections": {"v4": (("attn_hc", "ffn_hc"), ("hc_head",)), "v41": (("attn_hc", "ffn_hc"), ())},
    "norms": {
        "v4": (("input_layernorm", "post_attention_layernorm"), ("norm",)),
        "v41": (("attn_norm", "ffn_norm"), ("norm",)),
    },
}


def recompute_parts(value) -> tuple[str, ...]:
    """``value`` (None, a comma-separated string or a list of part names) as a tuple of parts;
    anything else, or an unknown part, is a ValueError naming ``recompute`` and the parts."""
    if value is None or value == "" or value == "none":
        return ()
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, Iterable) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"recompute must be a list of part names from {sorted(PARTS)}, got {value!r}")
    parts = tuple(dict.fromkeys(n.strip() for n in names))
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"recompute: unknown part(s) {unknown}; the parts are {sorted(PARTS)}")
    return parts


def apply_recompute(backbone: nn.Module, blocks: Iterable[nn.Module], parts: Iterable[str], family: str) -> None:
    """Wrap the modules of ``parts`` in ``blocks`` and on ``backbone`` of a ``family`` ("v4" |
    "v41") model (see the module docstring). V4.1's mixing modules recompute their forward (the
    mix coefficients); their ``collapse`` / ``expand``, called by the block, are not wrapped."""
    blocks = list(blocks)
    for part in recompute_parts(list(parts)):
        block_names, backbone_names = PARTS[part][family]
        for owner, names in [(block, block_names) for block in blocks] + [(backbone, backbone_names)]:
            for name in names:
                module = getattr(owner, name, None)
                if module is not None and not isinstance(module, CheckpointWrapper):
                    # No RNG inside these parts: the recompute need not restore the RNG state.
                    owner.register_module(name, checkpoint_wrapper(module, preserve_rng_state=False))
