"""The DeepSeek plugins as drop-ins for nemo-automodel's built-in classes (CPU, fp32).

What a nemo-automodel user relies on beyond the logits (those are test_deepseek_v4_plugin.py's and
test_deepseek_v41_plugin.py's): the four classes come from ``nemo_dsa.integrations`` without
importing nemo-automodel early; an attention layer is built from the built-in's ``(config,
layer_idx, backend)`` and, called on its own with the inputs the built-in's block hands its
attention, gives the built-in's output; the built-in's attributes and FSDP hooks exist and act as
the built-in's do; configs the built-in takes (empty ``compress_ratios``, any
``num_key_value_heads``, ``attention_dropout``) run; the V4.1 forward shows nemo-automodel's
trainer the built-in's signature (batch keys it does not name are dropped, ``logits_to_keep``).
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from _support.cp_spawn import run_on_ranks
from nemo_automodel.components.models.deepseek_v4.layers import DeepseekV4Attention
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM
from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
from nemo_automodel.components.utils.model_utils import _supports_logits_to_keep, filter_forward_kwargs
from _support.v4_builtin_and_plugin import backend, models, randomize_, rel, tiny_config  # noqa: F401 (fixture)
from _support.v41_builtin_and_plugin import backend as v41_backend
from _support.v41_builtin_and_plugin import build_models as build_v41_models

from nemo_dsa.integrations import (
    NemoDsaDeepseekV4Attention,
    NemoDsaDeepseekV4ForCausalLM,
    NemoDsaDeepseekV41Attention,
    NemoDsaDeepseekV41ForCausalLM,
)
from nemo_dsa.integrations.deepseek_v4.attention import DeepseekV4Compressor
from nemo_dsa.ops.sparse_attention.naive import sparse_attention

RTOL = 1e-5


def test_exports_load_lazily():
    """``import nemo_dsa.integrations`` imports neither framework; naming a class imports its family."""
    code = (
        "import sys, nemo_dsa, nemo_dsa.integrations as i\n"
        "assert 'nemo_automodel' not in sys.modules and 'transformers' not in sys.modules\n"
        "from nemo_dsa.integrations.deepseek_v41 import modeling\n"
        "assert i.NemoDsaDeepseekV41ForCausalLM is modeling.NemoDsaDeepseekV41ForCausalLM\n"
        "print(sorted(n for n in dir(i) if n.startswith('NemoDsaDeepseek')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(
        ["NemoDsaDeepseekV41Attention", "NemoDsaDeepseekV41ForCausalLM", "NemoDsaDeepseekV4Attention",
         "NemoDsaDeepseekV4ForCausalLM"]  # fmt: skip
    )


# --------------------------------------------------------------------------------------------
# DeepSeek-V4: the attention layer alone
# --------------------------------------------------------------------------------------------


def block_attention_calls(model, ids: torch.Tensor) -> dict:
    """``{layer: (args, kwargs, output, weights)}`` of every main block's ``self_attn`` call in one forward."""
    calls, handles = {}, []
    for name, block in model.model.layers.items():
        def hook(module, args, kwargs, output, name=name):
            calls[name] = (args, dict(kwargs), output[0], output[1])

        handles.append(block.self_attn.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def test_v4_attention_alone_matches_the_builtin_block_call(models):
    """Each layer (window-only, ratio 4, ratio 128), built from the built-in's constructor arguments
    with the built-in's weights and called alone with the inputs the built-in's block gave its
    attention, returns the built-in's output, and its attention probabilities where the built-in
    returns them (a lone layer on a non-TileLang backend)."""
    builtin, _ = models
    ids = torch.randint(0, builtin.config.vocab_size, (2, 160), generator=torch.Generator().manual_seed(3))
    calls = block_attention_calls(builtin, ids)
    for name, (args, kwargs, expected, expected_weights) in calls.items():
        layer = int(name)
        reference = builtin.model.layers[name].self_attn
        alone = NemoDsaDeepseekV4Attention(builtin.config, layer, builtin.backend)
        alone.load_state_dict(reference.state_dict(), strict=True)
        assert sorted(dict(alone.named_parameters())) == sorted(dict(reference.named_parameters()))
        with torch.no_grad():
            out, weights = alone.eval()(*args, **kwargs)
        if expected_weights is None:
            assert weights is None
        else:
            assert weights.shape == expected_weights.shape and rel(weights, expected_weights) < RTOL, layer
        assert rel(out, expected) < RTOL, (layer, rel(out, expected))


def test_v4_attention_alone_reads_padding_and_documents(models):
    """Alone, the layer reads padding from the built-in's additive mask (a token that cannot see
    itself) and documents from ``packed_seq_ids``: real tokens match a forward of each piece."""
    builtin, plugin = models
    attention = plugin.model.layers["1"].self_attn.eval()
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 96, builtin.config.hidden_size, generator=gen)
    with torch.no_grad():
        first, _ = attention(hidden[:, :64], position_ids=torch.arange(64))
        second, _ = attention(hidden[:, 64:], position_ids=torch.arange(32))
        packed, _ = attention(
            hidden, position_ids=torch.cat([torch.arange(64), torch.arange(32)]),
            packed_seq_ids=torch.cat([torch.ones(64), torch.full((32,), 2)]).long(),
        )  # fmt: skip
        assert rel(packed[:, :64], first) < RTOL and rel(packed[:, 64:], second) < RTOL
        mask = torch.zeros(1, 1, 96, 96).masked_fill(~torch.ones(96, 96, dtype=torch.bool).tril(), float("-inf"))
        mask[..., 80:, :] = float("-inf")  # the last 16 tokens are padding
        mask[..., :, 80:] = float("-inf")
        padded, _ = attention(hidden, attention_mask=mask, position_ids=torch.arange(96))
        real, _ = attention(hidden[:, :80], position_ids=torch.arange(80))
    assert rel(padded[:, :80], real) < RTOL


def _cp_shard_rank(rank: int, world: int) -> dict:
    """Each layer alone on this rank's contiguous shard (the built-in's CP inputs: the shard's
    positions, the [B, 1, S / cp, S] mask, ``_dsv4_cp_group``) against the built-in's full forward."""
    import torch.distributed as dist
    from nemo_automodel.components.models.deepseek_v4.cp import build_dsv4_cp_causal_padding_mask

    torch.manual_seed(0)
    config = tiny_config(num_nextn_predict_layers=0)
    builtin = DeepseekV4ForCausalLM(config, backend=backend())
    builtin.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    randomize_(builtin, seed=1)
    ids = torch.randint(0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(5))
    calls = block_attention_calls(builtin.eval(), ids)
    local = 256 // world
    positions = torch.arange(rank * local, (rank + 1) * local)[None]
    mask = build_dsv4_cp_causal_padding_mask(
        position_ids=positions, key_len=256, dtype=torch.float32, device=torch.device("cpu"),
        cp_group=dist.group.WORLD, sliding_window=config.sliding_window,
    )  # fmt: skip
    errors = {}
    for name in ("0", "2"):  # window-only, ratio 128 (no selection whose ties could decide)
        _, kwargs, expected, _ = calls[name]
        alone = NemoDsaDeepseekV4Attention(config, int(name), builtin.backend).eval()
        alone.load_state_dict(builtin.model.layers[name].self_attn.state_dict())
        with torch.no_grad():
            out, _ = alone(kwargs["hidden_states"][:, rank * local : (rank + 1) * local], attention_mask=mask, position_ids=positions,
                           _dsv4_cp_group=dist.group.WORLD)  # fmt: skip
        errors[name] = rel(out, expected[:, rank * local : (rank + 1) * local])
    return errors


def test_v4_attention_alone_on_cp_shards_matches_the_full_sequence():
    for errors in run_on_ranks(_cp_shard_rank, 2):
        assert max(errors.values()) < RTOL, errors


def test_v4_attributes_of_the_builtin(models):
    builtin, plugin = models
    for name, block in plugin.model.layers.items():
        attention, reference = block.self_attn, builtin.model.layers[name].self_attn
        assert torch.equal(attention.sinks, reference.sinks)
        for attr in ("num_heads", "head_dim", "rope_head_dim", "sliding_window", "scaling", "attention_dropout",
                     "compress_ratio"):  # fmt: skip
            assert getattr(attention, attr) == getattr(reference, attr), attr
        assert (attention.compressor is None) == (reference.compressor is None)
    hca = plugin.model.layers["2"].self_attn.compressor
    # nemo-automodel's FSDP2 wrapping finds the HCA compressors by class name.
    assert type(hca) is DeepseekV4Compressor and type(hca).__name__ == "DeepseekV4Compressor"
    with pytest.raises(TypeError, match="unexpected keyword"):
        NemoDsaDeepseekV4Attention(tiny_config(), 1, backend(), window=3)


def test_v4_setup_cp_attention_records_the_group(models):
    _, plugin = models

    class Mesh:
        def get_group(self):
            return "the-cp-group"

    attention = NemoDsaDeepseekV4Attention(tiny_config(), 2, backend())
    attention.setup_cp_attention(Mesh())
    assert attention._cp_group == "the-cp-group"


def _short_hca_rank(rank: int, world: int) -> dict:
    """One ratio-128 layer per rank: rank 0 holds 40 tokens (no complete window), rank 1 holds 136."""
    import torch.distributed as dist

    torch.manual_seed(0)
    attention = NemoDsaDeepseekV4Attention(tiny_config(), 2, backend())
    attention.init_weights(torch.device("cpu"))
    attention.compressor._set_hca_param_sync_group(dist.group.WORLD if world > 1 else None)
    seq = 40 if rank == 0 else 136
    hidden = torch.randn(1, seq, 64, generator=torch.Generator().manual_seed(rank))
    mask = torch.zeros(1, 1, seq, seq).masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    plain, _ = attention.eval()(hidden, attention_mask=mask)
    out, _ = attention.train()(hidden, attention_mask=mask)
    out.square().sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in attention.compressor.named_parameters()}
    return {"same_output": bool(torch.equal(out.detach(), plain)), "grads": grads}


def test_v4_hca_hooks_align_short_ranks_of_a_mixed_group():
    """The built-in's semantics on a real two-rank gloo group: the short rank sends zero gradients
    through every HCA compressor parameter (outputs unchanged); alone, it sends none."""
    short, long = run_on_ranks(_short_hca_rank, 2)
    assert short["same_output"] and long["same_output"]
    assert short["grads"] and all(g is not None and not g.any() for g in short["grads"].values())
    assert any(g is not None and g.abs().sum() > 0 for g in long["grads"].values())
    alone = _short_hca_rank(0, 1)
    assert all(g is None or not g.any() for g in alone["grads"].values())
    assert all(g is None for name, g in alone["grads"].items())


# --------------------------------------------------------------------------------------------
# DeepSeek-V4: configs the built-in takes
# --------------------------------------------------------------------------------------------


def _pair(config):
    torch.manual_seed(0)
    builtin = DeepseekV4ForCausalLM(config, backend=backend())
    builtin.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    randomize_(builtin, seed=2)
    plugin = NemoDsaDeepseekV4ForCausalLM(config, backend=backend())
    plugin.load_state_dict(builtin.state_dict(), strict=True)
    return builtin.eval(), plugin.eval()


@pytest.mark.parametrize("overrides", [{"compress_ratios": []}, {"compress_ratios": [], "num_key_value_heads": 2}])
def test_v4_configs_the_builtin_takes(overrides):
    """Empty ``compress_ratios`` (every layer window-only) and a ``num_key_value_heads`` the
    built-in does not read: the same logits as the built-in."""
    builtin, plugin = _pair(tiny_config(num_nextn_predict_layers=0, **overrides))
    assert all(block.self_attn.compressor is None for block in plugin.model.layers.values())
    ids = torch.randint(0, builtin.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert rel(plugin(ids).logits, builtin(ids).logits) < RTOL


@pytest.mark.parametrize("mtp", [0, 1])
def test_v4_without_main_layers(mtp):
    """No main layers (``num_hidden_layers=0, compress_ratios=[]``), which the built-in builds: with
    no attention at all the plugin builds no nemo_dsa module config and still equals the built-in on
    padded, packed (``cu_seqlens``) and plain batches; with an MTP layer that layer is nemo_dsa's and
    the training forward's MTP hidden states equal the built-in's."""
    builtin, plugin = _pair(tiny_config(num_hidden_layers=0, compress_ratios=[], num_hash_layers=0,
                                        num_nextn_predict_layers=mtp))  # fmt: skip
    assert (plugin.dsa_config is None) == (mtp == 0)
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, builtin.config.vocab_size, (2, 19), generator=gen)
    mask = torch.ones(2, 19, dtype=torch.long)
    mask[1, 13:] = 0
    cu = torch.tensor([0, 5, 19], dtype=torch.int32)
    packed = dict(position_ids=torch.cat([torch.arange(5), torch.arange(14)]).unsqueeze(0), qkv_format="thd",
                  cu_seqlens=cu, cu_seqlens_padded=cu)  # fmt: skip
    with torch.no_grad():
        assert rel(plugin(ids).logits, builtin(ids).logits) < RTOL
        got, want = plugin(ids, attention_mask=mask).logits, builtin(ids, attention_mask=mask).logits
        assert rel(got[0], want[0]) < RTOL and rel(got[1, :13], want[1, :13]) < RTOL
        assert rel(plugin(ids[:1], **packed).logits, builtin(ids[:1], **packed).logits) < RTOL
    if mtp:
        plugin.train(), builtin.train()
        got, want = plugin(ids).mtp_per_depth_h, builtin(ids).mtp_per_depth_h
        assert len(got) == len(want) == 1 and rel(got[0], want[0]) < RTOL


def test_v4_without_layers_still_checks_options_and_inputs():
    """A model with no attention layers still refuses a bad nemo_dsa option and bad batch layouts
    (the forward checks the layout as always); an attention layer cannot be built on its config;
    the small LM's own config keeps refusing zero layers."""
    config = tiny_config(num_hidden_layers=0, compress_ratios=[], num_hash_layers=0, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="backend"):
        NemoDsaDeepseekV4ForCausalLM(config, backend=backend(), indexer_backend="cuda-magic")
    with pytest.raises(ValueError, match="no attention layers"):
        NemoDsaDeepseekV4Attention(config, 0, backend())
    _, plugin = _pair(config)
    ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="vocab_size"):
        plugin(ids + config.vocab_size)
    bad_offsets = torch.tensor([0, 3, 9], dtype=torch.int32)  # covers 9 of 8 tokens
    with pytest.raises(ValueError):
        plugin(ids, qkv_format="thd", cu_seqlens=bad_offsets, cu_seqlens_padded=bad_offsets)
    from nemo_dsa.models.dsa_lm.configuration import DSAModelConfig

    with pytest.raises(ValueError, match="num_hidden_layers"):
        DSAModelConfig(num_hidden_layers=0, compress_ratios=())


def test_v4_attention_dropout_in_training_only():
    """``attention_dropout`` reaches nemo_dsa's attention: eval (and p = 0) is the built-in's
    forward; training draws masks (two steps differ, gradients finite), replayed by recompute."""
    config = tiny_config(num_nextn_predict_layers=0, attention_dropout=0.5)
    builtin, plugin = _pair(config)
    assert {b.self_attn.core.config.attention_dropout for b in plugin.model.layers.values()} == {0.5}
    ids = torch.randint(0, config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert rel(plugin(ids).logits, builtin(ids).logits) < RTOL
    plugin.train()
    torch.manual_seed(11)
    first = plugin(ids).logits
    torch.manual_seed(12)
    second = plugin(ids).logits
    assert rel(first, second) > 1e-3
    first.square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in plugin.parameters() if p.grad is not None)
    recomputed = NemoDsaDeepseekV4ForCausalLM(config, backend=backend(), recompute="attention").train()
    recomputed.load_state_dict(plugin.state_dict())
    torch.manual_seed(11)
    replay = recomputed(ids).logits
    assert torch.equal(replay, first.detach()) or rel(replay, first) < RTOL
    replay.square().mean().backward()
    torch.manual_seed(11)
    plugin.zero_grad()
    plugin(ids).logits.square().mean().backward()
    name, param = next((n, p) for n, p in plugin.named_parameters() if n.endswith("self_attn.wq_b.weight"))
    assert rel(dict(recomputed.named_parameters())[name].grad, param.grad) < RTOL


def test_reference_dropout_is_the_softmax_probabilities_dropped():
    """The reference op drops the probabilities (sink in the denominator) as ``F.dropout`` would:
    one chunk, the same seed, the same mask."""
    gen = torch.Generator().manual_seed(8)
    q, kv = torch.randn(2, 5, 3, 8, generator=gen), torch.randn(2, 9, 8, generator=gen)
    indices, sink = torch.randint(-1, 9, (2, 5, 6), generator=gen), torch.randn(3, generator=gen)
    torch.manual_seed(9)
    out, _ = sparse_attention(q, kv, indices, sink, 0.4, dropout_p=0.25, chunk_size=5)
    keys = kv[torch.arange(2)[:, None, None], indices.clamp_min(0)]  # [B, S, M, D]
    logits = torch.einsum("bshd,bsmd->bshm", q, keys) * 0.4
    logits = logits.masked_fill((indices < 0)[:, :, None], float("-inf"))
    denominator = torch.logsumexp(torch.cat([logits, sink.view(1, 1, 3, 1).expand(2, 5, 3, 1)], -1), -1)
    torch.manual_seed(9)
    probs = torch.nn.functional.dropout(torch.exp(logits - denominator[..., None]), p=0.25)
    assert rel(out, torch.einsum("bshm,bsmd->bshd", probs, keys)) < 1e-6
    with pytest.raises(ValueError, match="dropout_p"):
        sparse_attention(q, kv, indices, sink, 0.4, dropout_p=1.0)


# --------------------------------------------------------------------------------------------
# DeepSeek-V4.1: the trainer's view of the forward, the attention layer alone
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v41_models():
    builtin, plugin = build_v41_models()
    return builtin.eval(), plugin.eval()


def test_v41_forward_shows_the_builtin_signature(v41_models):
    builtin, plugin = v41_models
    ours = dict(inspect.signature(plugin.forward).parameters)
    assert ours.pop("use_cache").default is None
    assert list(ours) == list(inspect.signature(builtin.forward).parameters)
    assert _supports_logits_to_keep(plugin)
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "attention_mask": torch.ones(1, 4),
             "padding_mask": torch.zeros(1, 4, dtype=torch.bool), "use_cache": False}  # fmt: skip
    assert filter_forward_kwargs(plugin, batch).keys() == {"input_ids", "attention_mask", "use_cache"}
    assert filter_forward_kwargs(builtin, batch).keys() == {"input_ids", "attention_mask"}


def test_v41_logits_to_keep_and_use_cache(v41_models):
    builtin, plugin = v41_models
    ids = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        full = plugin(ids).logits
        last = plugin(ids, logits_to_keep=1, use_cache=False).logits
        reference = builtin(ids, logits_to_keep=1).logits
    assert last.shape[1] == 1 and rel(last, full[:, -1:]) < RTOL and rel(last, reference) < RTOL
    with pytest.raises(ValueError, match="use_cache"):
        plugin(ids, use_cache=True)


@pytest.mark.parametrize("layer", [0, 1])  # window-only; kv and index source
def test_v41_attention_alone_matches_the_builtin_layer(v41_models, layer):
    """A V4.1 layer built from the built-in's ``(text_config, layer_idx, backend)`` and called
    alone (first layer of a forward: empty built-in state) gives the built-in layer's output."""
    from nemo_automodel.components.models.deepseek_v41.attention import DeepseekV41AttentionState

    builtin, _ = v41_models
    text = builtin.config.text_config
    reference = builtin.model.layers[str(layer)].attn
    alone = NemoDsaDeepseekV41Attention(text, layer, v41_backend())
    alone.load_state_dict(reference.state_dict(), strict=True)
    assert (alone.compressor is None) == (reference.compressor is None)
    assert torch.equal(alone.attn_sink, reference.attn_sink) and alone.is_kv_source == reference.is_kv_source
    hidden = torch.randn(2, 32, text.hidden_size, generator=torch.Generator().manual_seed(11))
    positions = torch.arange(32).expand(2, -1)
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 24:] = 0
    with torch.no_grad():
        expected = reference.eval()(hidden, position_ids=positions, state=DeepseekV41AttentionState(), attention_mask=mask)
        got = alone.eval()(hidden, position_ids=positions, state=DeepseekV41AttentionState(), attention_mask=mask)
    assert rel(got.hidden_states, expected.hidden_states) < RTOL
    assert isinstance(NemoDsaDeepseekV41ForCausalLM(builtin.config, backend=v41_backend()), DeepseekV41ForCausalLM)


def test_v41_rotary_emb_describes_the_builtin_rope():
    """``attn.rotary_emb`` gives the built-in's RoPE parameters on every layer: plain RoPE on
    window-only layers, YaRN on compressed ones."""
    from nemo_automodel.components.models.deepseek_v41.attention import DeepseekV41Attention
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
    from _support.tiny_released_v41 import hf_config

    yarn = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 48, "beta_fast": 24, "beta_slow": 2}
    text = DeepseekV41TextConfig(**{**hf_config().to_dict(), "rope_scaling": yarn, "compress_rope_theta": 40000.0})
    seen = set()
    for layer in range(text.num_hidden_layers):
        ours = NemoDsaDeepseekV41Attention(text, layer, v41_backend()).rotary_emb
        with torch.device("meta"):
            theirs = DeepseekV41Attention(text, layer, v41_backend()).rotary_emb
        fields = ("dim", "theta", "factor", "original_length", "beta_fast", "beta_slow")
        assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}, layer
        seen.add(ours.original_length > 0)
    assert seen == {True, False}  # both kinds of layer were compared


def test_v41_reused_state_of_other_tokens_is_refused(v41_models):
    """A layer handed the state an earlier layer built for other tokens (another batch size or
    length) raises a ValueError naming the state, where shapes would otherwise clash."""
    from nemo_automodel.components.models.deepseek_v41.attention import DeepseekV41AttentionState

    builtin, _ = v41_models
    text = builtin.config.text_config
    first = NemoDsaDeepseekV41Attention(text, 1, v41_backend()).eval()
    later = NemoDsaDeepseekV41Attention(text, 2, v41_backend()).eval()
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        state = first(torch.randn(2, 12, text.hidden_size, generator=gen), position_ids=torch.arange(12)[None],
                      state=DeepseekV41AttentionState()).state  # fmt: skip
        later(torch.randn(2, 12, text.hidden_size, generator=gen), position_ids=torch.arange(12)[None], state=state)
        for batch, seq in ((1, 12), (2, 10)):
            with pytest.raises(ValueError, match="state: .*different batch or sequence"):
                later(torch.randn(batch, seq, text.hidden_size, generator=gen), position_ids=torch.arange(seq)[None],
                      state=state)  # fmt: skip
