"""Recompute in the backward the DeepSeek-V4 parts that are cheap to run and expensive to keep.

Counted by ``benchmarks/saved_activations.py`` on the V4 step model, the
built-in's hyper-connections keep two fp32 copies of the ``[S, hc_mult * hidden]`` stream per
mixing module (its fp32 cast and its RMS-normalised copy, 128 KiB a token at hidden 4,096 and
hc_mult 4): 7 modules in 3 layers are 896 of the step's 2,454 KiB a token. Their forward is a
cast, a norm and a narrow ``[hc_mult * hidden] -> [24]`` product, a few ms a step. The blocks'
RMS norms keep two fp32 copies of their bf16 input (32 KiB a token each). Recomputing these parts
keeps only their inputs, which the blocks keep anyway, at about one extra forward of them.
``attention`` recomputes each block's whole attention as well (its forward again in the backward,
for about 280 KiB a token a V4-Flash-shaped layer), for the longest sequences.

``recompute`` names parts (``PARTS``); each of their modules runs under non-reentrant
``torch.utils.checkpoint`` through torch's composable ``checkpoint`` (forward hooks), which leaves
the module tree and every parameter name as they are. That matters: nemo-automodel keeps the
hyper-connections' parameters in fp32 by name (``_keep_in_fp32_modules_strict``), and a wrapper
module in the path (``checkpoint_wrapper``'s ``_checkpoint_wrapped_module``) made a bf16 cast
turn them bf16. State-dict keys, FSDP2 and nemo-automodel's ``apply_ac`` (whole blocks, around
these) are unchanged. Values and gradients are the plain step's, bitwise (tests/integrations/test_recompute.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._composable.contract import _get_registry

__all__ = ["PARTS", "apply_recompute", "is_recomputed", "pop_recompute_option", "recompute_parts"]

# part -> (module names inside every decoder block, module names on the backbone ``model``), per family
PARTS = {
    "hyper_connections": {"v4": (("attn_hc", "ffn_hc"), ("hc_head",)), "v41": (("attn_hc", "ffn_hc"), ())},
    "norms": {
        "v4": (("input_layernorm", "post_attention_layernorm"), ("norm",)),
        "v41": (("attn_norm", "ffn_norm"), ("norm",)),
    },
    # The whole nemo_dsa attention of each block (compressor, indexer and selection, the attention
    # op, the output projection): kept are its input and what it hands on (V4.1's shared KV and
    # selection, V4's KL loss). Its forward runs twice.
    "attention": {"v4": (("self_attn",), ()), "v41": (("attn",), ())},
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


def pop_recompute_option(kwargs: dict, config) -> tuple[str, ...]:
    """The plugins' ``recompute`` option, checked: popped from the constructor's ``kwargs``, else
    the config attribute of that name."""
    value = kwargs.pop("recompute", None)
    return recompute_parts(value if value is not None else getattr(config, "recompute", None))


def apply_recompute(backbone: nn.Module, blocks: Iterable[nn.Module], parts: tuple[str, ...], family: str) -> None:
    """Recompute the modules of ``parts`` (as ``recompute_parts`` returns them) in ``blocks`` and on
    ``backbone`` of a ``family`` ("v4" | "v41") model (see the module docstring). V4.1's mixing
    modules recompute their forward (the mix coefficients); their ``collapse`` / ``expand``,
    called by the block, are not wrapped."""
    blocks = list(blocks)
    for part in parts:
        block_names, backbone_names = PARTS[part][family]
        for owner, names in [(block, block_names) for block in blocks] + [(backbone, backbone_names)]:
            for name in names:
                module = getattr(owner, name, None)
                if isinstance(module, nn.Module) and not is_recomputed(module):
                    # Only the attention draws random numbers (attention_dropout): its recompute
                    # replays the forward's dropout mask; the other parts need no RNG state.
                    checkpoint(module, preserve_rng_state=part == "attention")


def is_recomputed(module: nn.Module) -> bool:
    """Whether ``module`` runs under the composable ``checkpoint`` (applied by ``apply_recompute``)."""
    return "checkpoint" in (_get_registry(module) or {})
