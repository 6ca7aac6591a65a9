"""The V4 plugin's backbone: the built-in's ``model.model`` extended to build nemo_dsa's metadata.

The plugin's outer forward calls ``model.model`` as the built-in's does, so the backbone runs on its
own with the built-in's contract, hooks a user puts on it see (and may change) what the LM head
reads, and the MTP attends with the metadata the backbone built in its forward (the same objects,
one check of the layout). A backbone that hands no metadata over (its forward replaced) leaves the
MTP to build its own, with the same result. CPU, fp32, both models on the same random weights.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM, DeepseekV4Model

from nemo_dsa.integrations.deepseek_v4.backbone import NemoDsaDeepseekV4Model
from _support.v4_builtin_and_plugin import VOCAB, backend, build_plugin, randomize_, rel, thd_batch, tiny_config

RTOL = 1e-5


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    builtin = DeepseekV4ForCausalLM(tiny_config(), backend=backend())
    builtin.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    randomize_(builtin, seed=11)
    plugin = build_plugin(tiny_config())
    plugin.load_state_dict(builtin.state_dict(), strict=True)
    return builtin.eval(), plugin.eval()


def rows(seed: int, batch: int = 2, seq: int = 160):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 37 :] = 0  # right padding on one row
    return ids, mask


def test_the_backbone_is_the_builtins_module_and_runs_on_its_own(models):
    builtin, plugin = models
    assert type(plugin.model) is NemoDsaDeepseekV4Model and isinstance(plugin.model, DeepseekV4Model)
    assert type(builtin.model) is DeepseekV4Model  # adopting the plugin's backbone leaves the class alone
    ids, mask = rows(seed=2)
    with torch.no_grad():
        got_h, got_streams = plugin.model(ids, attention_mask=mask, return_hc_hidden=True)
        ref_h, ref_streams = builtin.model(ids, attention_mask=mask, return_hc_hidden=True)
    valid = mask.bool()
    assert got_h.shape == ref_h.shape and got_streams.shape == ref_streams.shape
    assert rel(got_h[valid], ref_h[valid]) <= RTOL
    assert rel(got_streams[valid], ref_streams[valid]) <= RTOL
    with torch.no_grad():
        alone = plugin.model(ids, attention_mask=mask)
    torch.testing.assert_close(alone, got_h, rtol=0, atol=0)


def test_hooks_on_the_backbone_see_and_change_what_the_head_reads(models):
    _, plugin = models
    ids, mask = rows(seed=3)
    seen = {}

    def before(module, args, kwargs):
        seen["input_ids"], seen["attention_mask"] = args[0], kwargs["attention_mask"]

    def after(module, args, kwargs, output):
        seen["hidden"] = output
        return output.flip(1)  # a change the head must see

    handles = [
        plugin.model.register_forward_pre_hook(before, with_kwargs=True),
        plugin.model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            logits = plugin(ids, attention_mask=mask).logits
    finally:
        for handle in handles:
            handle.remove()
    assert seen["input_ids"] is ids and seen["attention_mask"] is mask
    with torch.no_grad():
        expected = plugin.lm_head(seen["hidden"].flip(1))
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)


def attention_states(plugin) -> tuple[list, list, list]:
    """Hooks recording the ``nemo_dsa_forward`` each main and MTP attention layer receives."""
    main, mtp, handles = [], [], []

    def record(into, module, args, kwargs):
        into.append(kwargs["nemo_dsa_forward"])

    for block in plugin.model.layers.values():
        handles.append(block.self_attn.register_forward_pre_hook(functools.partial(record, main), with_kwargs=True))
    for block in plugin.mtp.layers:
        handles.append(block.self_attn.register_forward_pre_hook(functools.partial(record, mtp), with_kwargs=True))
    return main, mtp, handles


@pytest.mark.parametrize("layout", ["rows", "thd"])
def test_the_mtp_attends_with_the_backbones_metadata(models, layout):
    _, plugin = models
    if layout == "rows":
        ids, mask = rows(seed=4)
        batch = {"input_ids": ids, "attention_mask": mask}
    else:
        batch, _ = thd_batch([100, 150, 38], [104, 152, 40], seed=5)
        batch.pop("labels", None)
    main, mtp, handles = attention_states(plugin)
    try:
        plugin.train()
        out = plugin(**batch)
    finally:
        plugin.eval()
        for handle in handles:
            handle.remove()
    assert len(main) == len(plugin.model.layers) and len(mtp) == len(plugin.mtp.layers)
    assert all(state is main[0] for state in main)  # one state for the backbone's forward
    for state in mtp:
        assert state.metadata is main[0].metadata and state.ctx is main[0].ctx
        assert state.aux_losses is main[0].aux_losses  # the MTP's indexer losses join the backbone's
        assert state.shared is not main[0].shared  # the MTP's ratio-4 sources are its own
    assert len(out.mtp_per_depth_h) == 1 and out.mtp_per_depth_h[0].shape == (*out.logits.shape[:2], 64)


def test_a_backbone_that_hands_no_metadata_over_leaves_the_mtp_to_build_it(models, monkeypatch):
    _, plugin = models
    ids, mask = rows(seed=6)
    plugin.train()
    try:
        torch.manual_seed(0)
        shared = plugin(ids, attention_mask=mask)
        own = plugin.model.forward

        def without_slot(*args, nemo_dsa_forward_slot=None, **kwargs):
            return own(*args, **kwargs)

        monkeypatch.setattr(plugin.model, "forward", without_slot)
        main, mtp, handles = attention_states(plugin)
        torch.manual_seed(0)
        rebuilt = plugin(ids, attention_mask=mask)
        for handle in handles:
            handle.remove()
    finally:
        plugin.eval()
    assert all(state.metadata is not main[0].metadata for state in mtp)
    torch.testing.assert_close(rebuilt.logits, shared.logits, rtol=0, atol=0)
    torch.testing.assert_close(rebuilt.mtp_per_depth_h[0], shared.mtp_per_depth_h[0], rtol=0, atol=0)
