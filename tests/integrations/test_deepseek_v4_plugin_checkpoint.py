"""HF-format DeepSeek-V4 checkpoints, written by nemo-automodel's state-dict adapter, into the plugin.

Two file sets from one random built-in model: bf16, and FP8 as the adapter lays it out (an e4m3
weight plus a ``.scale`` tensor for every quantised projection, experts included), with real
per-128x128-block scales. The plugin and the built-in each load the same files; their logits must
agree. Broken checkpoints (a key removed, a key added, a tensor of the wrong shape) are a
ValueError naming the key.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from safetensors.torch import save_file

from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

from nemo_dsa.integrations.common.checkpoint import load_hf_checkpoint, read_hf_checkpoint
from _support.v4_builtin_and_plugin import RTOL, VOCAB, backend, build_plugin, randomize_, rel, tiny_config

FP8_MAX = 448.0
BLOCK = 128


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weight and fp32 scale per 128x128 block (the layout the adapter dequantises)."""
    rows, cols = weight.shape
    w = weight.float()
    scale = torch.empty((rows + BLOCK - 1) // BLOCK, (cols + BLOCK - 1) // BLOCK)
    q = torch.empty_like(w)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            s = block.abs().amax().clamp_min(1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = block / s
    return q.to(torch.float8_e4m3fn), scale


@pytest.fixture(scope="module")
def source():
    torch.manual_seed(10)
    model = DeepseekV4ForCausalLM(tiny_config(), backend=backend())
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    randomize_(model, seed=12)
    return model


@pytest.fixture(scope="module")
def checkpoints(source, tmp_path_factory):
    """{"bf16": dir, "fp8": dir}, both through the built-in adapter's to_hf."""
    adapter = source.state_dict_adapter
    state = source.state_dict()
    plain = {k: v.contiguous() for k, v in adapter.to_hf(state).items()}
    dirs = {}
    bf16 = tmp_path_factory.mktemp("bf16")
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in plain.items()},
              str(bf16 / "model.safetensors"))  # fmt: skip
    dirs["bf16"] = bf16

    # The adapter's quantised layout decides which keys carry a .scale (routed experts in the
    # FP8 "base" layout); the values are quantised here with real block scales.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEMO_AUTOMODEL_DSV4_EXPERT_LAYOUT", "fp8")
        layout = adapter.to_hf(state, quantization=True)
    fp8_tensors = {}
    for key, value in layout.items():
        if key.endswith(".scale"):
            continue
        if key[: -len(".weight")] + ".scale" in layout:
            fp8_tensors[key], fp8_tensors[key[: -len(".weight")] + ".scale"] = quantize_fp8(plain[key])
        else:
            fp8_tensors[key] = plain[key].to(torch.bfloat16) if plain[key].is_floating_point() else plain[key]
    assert sum(k.endswith(".scale") for k in fp8_tensors) > 10
    assert "layers.1.attn.wo_a.scale" in fp8_tensors and "layers.1.attn.indexer.wq_b.scale" in fp8_tensors
    fp8 = tmp_path_factory.mktemp("fp8")
    save_file(fp8_tensors, str(fp8 / "model.safetensors"))
    dirs["fp8"] = fp8
    return dirs


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_plugin_loads_the_checkpoint_like_the_builtin(kind, checkpoints, source):
    builtin = DeepseekV4ForCausalLM(tiny_config(), backend=backend())
    load_hf_checkpoint(builtin, checkpoints[kind])
    plugin = build_plugin(tiny_config())
    load_hf_checkpoint(plugin, checkpoints[kind])
    for key, value in builtin.state_dict().items():
        torch.testing.assert_close(plugin.state_dict()[key], value, rtol=0, atol=0, msg=key)
    # The files hold the source model up to their rounding (bf16 / fp8 blocks).
    tolerance = 1e-2 if kind == "bf16" else 8e-2
    assert rel(builtin.state_dict()["model.layers.1.self_attn.wq_b.weight"],
               source.state_dict()["model.layers.1.self_attn.wq_b.weight"]) < tolerance  # fmt: skip
    ids = torch.randint(0, VOCAB, (2, 288), generator=torch.Generator().manual_seed(13))
    with torch.no_grad():
        ref = builtin.eval()(ids).logits
        out = plugin.eval()(ids).logits
    print(kind, "logits rel", rel(out, ref))
    assert rel(out, ref) <= RTOL


def broken(checkpoint_dir, tmp_path, edit) -> str:
    tensors = read_hf_checkpoint(checkpoint_dir)
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


@pytest.mark.parametrize("model_kind", ["builtin", "plugin"])
@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("layers.1.attn.attn_sink"), "lacks layers.1.attn.attn_sink"),
        (lambda t: t.pop("layers.2.attn.compressor.ape"), "lacks layers.2.attn.compressor.ape"),
        (lambda t: t.update({"layers.1.attn.indexer.extra.weight": torch.zeros(2, 2)}),
         "has layers.1.attn.indexer.extra.weight"),
        (lambda t: t.update({"layers.0.attn.attn_sink": torch.zeros(5)}), r"layers.0.attn.attn_sink has shape \(5,\)"),
        (lambda t: t.update({"layers.1.attn.indexer.weights_proj.weight": torch.zeros(3, 64)}),
         "layers.1.attn.indexer.weights_proj.weight has shape"),
    ],
)  # fmt: skip
def test_broken_checkpoints_name_the_key(model_kind, edit, message, checkpoints, tmp_path):
    model = DeepseekV4ForCausalLM(tiny_config(), backend=backend()) if model_kind == "builtin" else build_plugin(tiny_config())
    model.initialize_weights(dtype=torch.float32) if model_kind == "plugin" else model.initialize_weights(
        buffer_device=torch.device("cpu"), dtype=torch.float32
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        load_hf_checkpoint(model, broken(checkpoints["bf16"], tmp_path, edit))
    for key, value in model.state_dict().items():  # nothing was half-loaded
        assert torch.equal(value, before[key]), key


def test_missing_files_are_an_error(tmp_path):
    with pytest.raises(ValueError, match="no .safetensors"):
        read_hf_checkpoint(tmp_path)
