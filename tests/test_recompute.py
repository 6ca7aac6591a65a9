"""The plugins' ``recompute`` option: the hyper-connections and norms recomputed in the backward.

Same weights with and without it (V4 alone and under nemo-automodel's whole-block ``apply_ac``, V4.1
alone): the
loss and every gradient bitwise equal, the state-dict keys unchanged, and the forward keeps less by
at least the parts' fp32 copies (CPU, fp32, the tiny released structure of the step benchmark)."""

from __future__ import annotations

import pytest
import torch

from helpers import skip_without_automodel

try:
    from nemo_automodel.components.moe.parallelizer import apply_ac
except ImportError as error:
    skip_without_automodel(error)

from nemo_dsa.integrations.recompute import PARTS, recompute_parts
from test_activation_checkpointing import WRAPPED, step
from test_benchmark_model_step_cpu import SEQ, TINY, VOCAB, bench, redraw_attention_

CPU = {"device": "cpu", "dtype": torch.float32, "attn": "sdpa"}


def tiny_config(family, recompute=None):
    config = bench.model_config(family, bench.DEFAULT_RATIOS[family], VOCAB, 2, dtype="float32", **TINY[family])
    if family == "v4":
        config.indexer_kl_coef = 0.5  # the indexers train too
    if recompute is not None:
        config.recompute = recompute
    return config


@pytest.mark.slow
@pytest.mark.parametrize(("family", "whole_blocks"), [("v4", False), ("v4", True), ("v41", False)],
                         ids=["v4", "v4_inside_apply_ac", "v41"])  # fmt: skip
def test_recomputed_parts_give_the_plain_steps_loss_and_gradients(family, whole_blocks):
    torch.manual_seed(0)
    plain = bench.build("plugin", tiny_config(family), **CPU)
    redraw_attention_(plain, family, seed=5)
    lean = bench.build("plugin", tiny_config(family, "hyper_connections, norms"), bench.copy_weights(plain), **CPU)
    wrapped = [name for name, _ in lean.named_modules() if name.endswith(WRAPPED)]
    layers = len(plain.model.layers)
    # every block's 2 mixes and 2 norms, the final norm (and V4's head mix)
    assert len(wrapped) == layers * 4 + (2 if family == "v4" else 1), wrapped
    assert lean.state_dict().keys() == plain.state_dict().keys()
    if whole_blocks:
        apply_ac(lean, selective=False)

    loss, grads, kept = step(plain, family)
    loss_lean, grads_lean, kept_lean = step(lean, family)
    assert torch.equal(loss, loss_lean)
    assert grads.keys() == grads_lean.keys()
    assert family == "v41" or any(".indexer." in name and g is not None for name, g in grads.items())
    for name, grad in grads.items():
        assert (grad is None) == (grads_lean[name] is None), name
        assert grad is None or torch.equal(grad, grads_lean[name]), name
    # V4: each mix keeps two fp32 copies of its [S, hc_mult * hidden] stream, each norm two of its
    # input; V4.1's at least one of each
    config, seq = plain.config, SEQ[family]
    config = getattr(config, "text_config", config)
    copies = 2 if family == "v4" else 1
    stream = seq * config.hc_mult * config.hidden_size * 4
    norm_input = seq * config.hidden_size * 4
    mixes, norms = (7, 7) if family == "v4" else (2 * layers, 2 * layers + 1)
    assert kept - kept_lean >= copies * (mixes * stream + norms * norm_input), (kept, kept_lean)


def test_parts_are_named_and_checked():
    assert recompute_parts(None) == recompute_parts("") == recompute_parts("none") == ()
    assert recompute_parts("norms,hyper_connections") == ("norms", "hyper_connections")
    assert recompute_parts(["norms", "norms"]) == ("norms",)
    assert set(PARTS) == {"hyper_connections", "norms"}
    with pytest.raises(ValueError, match=r"recompute: unknown part\(s\) \['attention'\]"):
        recompute_parts("norms,attention")
    with pytest.raises(ValueError, match="recompute must be a list of part names"):
        recompute_parts(3)
    with pytest.raises(ValueError, match="unknown part"):
        bench.build("plugin", tiny_config("v4", "moe"), **CPU)
