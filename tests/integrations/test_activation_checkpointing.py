"""The plugins under nemo-automodel's activation checkpointing (CPU, fp32, tiny released structure).

Long contexts need it: a V4 step keeps ~2.4 MiB a token for its backward without it
(``benchmarks/saved_activations.py``), so S = 65,536 does not fit one H200. A recipe turns it on with
``distributed.activation_checkpointing: selective`` (or ``true``, which nemo-automodel 0.7.0's
train_ft cannot run for these MoE models: tests/integrations/test_deepseek_v4_plugin_recipe.py); its MoE
parallelizer then wraps every decoder block through ``apply_ac``, the function called here. The plugins'
attention recomputes inside it (its own nested checkpoint of V4's queries included), so the
gradients must be bitwise those of the plain step, every indexer parameter's too, and what the
forward keeps must shrink to the blocks' inputs.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    from nemo_automodel.components.moe.parallelizer import apply_ac
except ImportError as error:
    skip_without_automodel(error)

from nemo_dsa.integrations import side_by_side as sides
from _support.tiny_side_by_side import TINY, VOCAB, WRAPPED, redraw_attention_, step


@pytest.mark.slow
@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_checkpointed_blocks_give_the_plain_steps_gradients(family, selective):
    config = sides.model_config(family, sides.DEFAULT_RATIOS[family], VOCAB, 2, dtype="float32", **TINY[family])
    if family == "v4":  # the indexers learn from their KL loss, which rides on the final hidden state
        config.indexer_kl_coef = 0.5
    cpu = {"device": "cpu", "dtype": torch.float32, "attn": "sdpa"}
    torch.manual_seed(0)
    plain = sides.build("plugin", config, **cpu)
    redraw_attention_(plain, family, seed=5)
    checkpointed = sides.build("plugin", config, sides.copy_weights(plain), **cpu)
    apply_ac(checkpointed, selective=selective)
    assert all(WRAPPED.strip(".") in dict(block.named_children()) for block in checkpointed.model.layers.values())

    loss, grads, kept = step(plain, family)
    loss_ac, grads_ac, kept_ac = step(checkpointed, family)
    assert torch.equal(loss, loss_ac)
    assert grads.keys() == grads_ac.keys()
    indexer_grads = [name for name, g in grads.items() if ".indexer." in name and g is not None]
    assert indexer_grads or family == "v41"  # V4's indexers train (V4.1's are frozen)
    for name, grad in grads.items():
        assert (grad is None) == (grads_ac[name] is None), name
        assert grad is None or torch.equal(grad, grads_ac[name]), name
    if not selective:  # selective AC stores its saved ops inside the checkpoint, out of the hooks' sight
        assert kept_ac * 5 < kept, (kept_ac, kept)
