"""The plugins' ``recompute`` option: hyper-connections, norms (and attention) recomputed in the backward.

Same weights with and without it (V4 alone, under nemo-automodel's whole-block ``apply_ac`` and with
the attention part; V4.1 alone and with the attention part): the loss and every gradient bitwise
equal, parameter names and state-dict keys unchanged, and the forward keeps less by at least the
parts' fp32 copies (CPU, fp32, the tiny released structure of the step benchmark). Cast to bf16,
every parameter keeps the plain model's dtype."""

from __future__ import annotations

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    from nemo_automodel.components.moe.parallelizer import apply_ac
except ImportError as error:
    skip_without_automodel(error)

from nemo_dsa.integrations.common.recompute import PARTS, is_recomputed, recompute_parts
from nemo_dsa.integrations import side_by_side as sides
from _support.tiny_side_by_side import SEQ, TINY, VOCAB, redraw_attention_, step

CPU = {"device": "cpu", "dtype": torch.float32, "attn": "sdpa"}


def tiny_config(family, recompute=None):
    config = sides.model_config(family, sides.DEFAULT_RATIOS[family], VOCAB, 2, dtype="float32", **TINY[family])
    if family == "v4":
        config.indexer_kl_coef = 0.5  # the indexers train too
    if recompute is not None:
        config.recompute = recompute
    return config


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "whole_blocks", "attention"),
    [("v4", None, False), ("v4", "full", False), ("v4", "selective", False), ("v41", None, False),
     ("v4", None, True), ("v41", None, True)],
    ids=["v4", "v4_inside_apply_ac", "v4_inside_selective_ac", "v41", "v4_with_attention", "v41_with_attention"],
)  # fmt: skip
def test_recomputed_parts_give_the_plain_steps_loss_and_gradients(family, whole_blocks, attention):
    torch.manual_seed(0)
    plain = sides.build("plugin", tiny_config(family), **CPU)
    redraw_attention_(plain, family, seed=5)
    parts = "hyper_connections, norms" + (",attention" if attention else "")
    lean = sides.build("plugin", tiny_config(family, parts), sides.copy_weights(plain), **CPU)
    wrapped = [name for name, module in lean.named_modules() if is_recomputed(module)]
    layers = len(plain.model.layers)
    # every block's 2 mixes and 2 norms (and attention), the final norm (and V4's head mix)
    assert len(wrapped) == layers * (5 if attention else 4) + (2 if family == "v4" else 1), wrapped
    # names (and so nemo-automodel's fp32-by-name parameters) unchanged
    assert dict(lean.named_parameters()).keys() == dict(plain.named_parameters()).keys()
    assert lean.state_dict().keys() == plain.state_dict().keys()
    if whole_blocks is not None:
        apply_ac(lean, selective=whole_blocks == "selective")

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
    if attention:  # what the attention keeps is at least its q and out, per layer
        q_and_out = 2 * seq * config.num_attention_heads * config.head_dim * 4
        assert kept - kept_lean >= copies * (mixes * stream + norms * norm_input) + layers * q_and_out


def test_parts_are_named_and_checked():
    assert recompute_parts(None) == recompute_parts("") == recompute_parts("none") == ()
    assert recompute_parts("norms,hyper_connections") == ("norms", "hyper_connections")
    assert recompute_parts(["norms", "norms"]) == ("norms",)
    assert set(PARTS) == {"hyper_connections", "norms", "attention"}
    with pytest.raises(ValueError, match=r"recompute: unknown part\(s\) \['moe'\]"):
        recompute_parts("norms,moe")
    with pytest.raises(ValueError, match="recompute must be a list of part names"):
        recompute_parts(3)
    with pytest.raises(ValueError, match="unknown part"):
        sides.build("plugin", tiny_config("v4", "moe"), **CPU)


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_a_bf16_model_keeps_the_release_fp32_parameters(family):
    """The built-in keeps its hyper-connections' (and V4's compressors') parameters in fp32 by name
    when the model is cast to bf16; recompute must not change a name or a dtype."""
    dtypes = []
    for recompute in (None, "hyper_connections,norms,attention"):
        config = sides.model_config(family, sides.DEFAULT_RATIOS[family], VOCAB, 2, **TINY[family])
        if recompute is not None:
            config.recompute = recompute
        model = sides.build("plugin", config, device="cpu", dtype=torch.bfloat16, attn="sdpa")
        dtypes.append({name: p.dtype for name, p in model.named_parameters()})
    assert dtypes[0] == dtypes[1]
    assert any(".attn_hc." in n and d == torch.float32 for n, d in dtypes[1].items())
