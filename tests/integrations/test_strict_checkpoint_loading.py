"""Strict, named loading of the DeepSeek-V4 plugin's weights, on both paths a user takes.

A good tiny checkpoint in the released HF layout (bf16, written by the built-in's own adapter,
its config naming the plugin) is broken one way at a time in real safetensors files under
tmp_path: a tensor removed, one added, one reshaped, a float weight replaced by an integer
tensor, a NaN in a weight, the file truncated. Each must be a ValueError naming the checkpoint
key (or, for a damaged file, the file) through nemo_dsa's ``load_hf_checkpoint`` and through
``NeMoAutoModelForCausalLM.from_pretrained`` (nemo-automodel's checkpointer, which on its own
loads non-strictly), and the model is left untouched. The built-in model keeps nemo-automodel's
own behaviour.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
    from nemo_automodel._transformers import auto_model  # noqa: F401 (needs torchao)
except ImportError as error:
    skip_without_automodel(error)

from safetensors.torch import load_file, save_file

from _support.helpers import cpu_automodel  # noqa: F401 (a fixture)
from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

from nemo_dsa.integrations.common.checkpoint import load_hf_checkpoint
from nemo_dsa.integrations.common.strict_loading import read_safetensors_header
from nemo_dsa.integrations.deepseek_v4 import ARCHITECTURE, NemoDsaDeepseekV4ForCausalLM
from _support.v4_builtin_and_plugin import backend, build_plugin, randomize_, tiny_config, write_hf_folder

WEIGHT = "layers.1.attn.wq_b.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """(directory, tensors): the tiny checkpoint, bf16 floats, in the released key names."""
    torch.manual_seed(60)
    model = DeepseekV4ForCausalLM(tiny_config(), backend=backend())
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    randomize_(model, seed=61)
    tensors = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
        for k, v in model.state_dict_adapter.to_hf(model.state_dict()).items()
    }
    path = tmp_path_factory.mktemp("good")
    write_hf_folder(path, tensors, ARCHITECTURE)
    return path, tensors


def broken_copy(good, tmp_path, edit, architecture=ARCHITECTURE):
    _, tensors = good
    tensors = dict(tensors)
    edit(tensors)
    write_hf_folder(tmp_path, tensors, architecture)
    return tmp_path


def truncate(path) -> None:
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])


def nan_in(key):
    def edit(tensors):
        value = tensors[key].clone()
        value[0, 3] = float("nan")
        tensors[key] = value

    return edit


CASES = {
    "missing": (lambda t: t.pop(WEIGHT), f"lacks {WEIGHT}"),
    "unexpected": (lambda t: t.update({"layers.1.attn.wq_c.weight": torch.ones(4, 4)}),
                   r"model\.safetensors has layers\.1\.attn\.wq_c\.weight"),
    "shape": (lambda t: t.update({WEIGHT: t[WEIGHT][:-1].clone()}), rf"model\.safetensors: {WEIGHT} has shape"),
    "integer": (lambda t: t.update({WEIGHT: torch.ones(t[WEIGHT].shape, dtype=torch.int32)}),
                rf"model\.safetensors: {WEIGHT} is I32"),
    "bool": (lambda t: t.update({"layers.1.attn.attn_sink": torch.ones(4, dtype=torch.bool)}),
             r"model\.safetensors: layers\.1\.attn\.attn_sink is BOOL"),
    "float_into_integer": (lambda t: t.update({"layers.0.ffn.gate.tid2eid": t["layers.0.ffn.gate.tid2eid"].float()}),
                           r"layers\.0\.ffn\.gate\.tid2eid is F32, but the model's .* is integer"),
    "nan": (nan_in(WEIGHT), rf"checkpoint tensor {WEIGHT} \(model tensor model\.layers\.1\.self_attn\.wq_b\.weight, "
                            r"file .*model\.safetensors\) holds 1 non-finite"),
    "inf_in_expert": (lambda t: t["layers.2.ffn.experts.1.w2.weight"].view(-1)[5].fill_(float("inf")),
                      r"layers\.2\.ffn\.experts\.0\.w2\.weight \.\. .* holds 1 non-finite"),
}  # fmt: skip


def fresh_plugin():
    plugin = build_plugin(tiny_config())
    plugin.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    return plugin


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_hf_checkpoint_names_the_key_and_file(case, good, tmp_path):
    edit, message = CASES[case]
    if case == "inf_in_expert":  # the edit writes into the shared tensor: work on a copy
        tensors = {k: v.clone() for k, v in good[1].items()}
        good = (good[0], tensors)
    path = broken_copy(good, tmp_path, edit)
    plugin = fresh_plugin()
    before = {k: v.clone() for k, v in plugin.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        load_hf_checkpoint(plugin, path)
    for key, value in plugin.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_truncated_and_unreadable_files_name_the_file(good, tmp_path):
    path = broken_copy(good, tmp_path, lambda t: None)
    truncate(path)
    with pytest.raises(ValueError, match=r"checkpoint file .*model\.safetensors is \d+ bytes .*truncated"):
        load_hf_checkpoint(fresh_plugin(), path)
    (path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match=r"checkpoint file .*model\.safetensors is not a readable safetensors"):
        read_safetensors_header(path / "model.safetensors")


def test_an_index_naming_an_absent_file_is_an_error(good, tmp_path):
    path = broken_copy(good, tmp_path, lambda t: None)
    index = {"metadata": {}, "weight_map": {WEIGHT: "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names model-00002-of-00002.safetensors, which is not in"):
        load_hf_checkpoint(fresh_plugin(), path)


def test_from_pretrained_loads_a_good_checkpoint_exactly(cpu_automodel, good):
    from nemo_automodel import NeMoAutoModelForCausalLM

    path, tensors = good
    model = NeMoAutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert isinstance(model, NemoDsaDeepseekV4ForCausalLM)
    loaded = model.state_dict_adapter.to_hf(model.state_dict())
    assert loaded.keys() == tensors.keys()
    for key, value in tensors.items():  # bf16 -> fp32 is exact; tid2eid stays an integer tensor
        assert loaded[key].dtype == (torch.float32 if value.is_floating_point() else value.dtype), key
        assert torch.equal(loaded[key].to(value.dtype), value), key


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "integer", "nan", "inf_in_expert", "truncated"])
def test_from_pretrained_is_strict_for_the_plugin(cpu_automodel, case, good, tmp_path):
    from nemo_automodel import NeMoAutoModelForCausalLM

    if case == "truncated":
        path = broken_copy(good, tmp_path, lambda t: None)
        truncate(path)
        message = r"checkpoint file .*model\.safetensors is \d+ bytes"
    else:
        edit, message = CASES[case]
        tensors = {k: v.clone() for k, v in good[1].items()}
        path = broken_copy((good[0], tensors), tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        NeMoAutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def test_the_builtin_keeps_nemo_automodels_own_loading(cpu_automodel, good, tmp_path):
    # The same extra tensor and NaN weight: nemo-automodel's own (non-strict) load of the built-in
    # model is unchanged by the plugin.
    from nemo_automodel import NeMoAutoModelForCausalLM

    def edit(tensors):
        tensors["layers.1.attn.wq_c.weight"] = torch.ones(4, 4)
        nan_in("layers.1.ffn.shared_experts.w1.weight")(tensors)

    tensors = {k: v.clone() for k, v in good[1].items()}
    path = broken_copy((good[0], tensors), tmp_path, edit, architecture="DeepseekV4ForCausalLM")
    model = NeMoAutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert type(model).__name__ == "DeepseekV4ForCausalLM" and not isinstance(model, NemoDsaDeepseekV4ForCausalLM)
    assert torch.isnan(model.state_dict()["model.layers.1.mlp.shared_experts.gate_proj.weight"]).any()
    assert "layers.1.attn.wq_c.weight" in load_file(str(path / "model.safetensors"))  # and it was ignored


def test_the_v41_plugin_loads_strictly(tmp_path):
    from _support.v41_builtin_and_plugin import build_models

    builtin, plugin = build_models()
    tensors = {k: v.contiguous() for k, v in builtin.state_dict_adapter.to_hf(builtin.state_dict()).items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    load_hf_checkpoint(plugin, tmp_path)
    for key, value in builtin.state_dict().items():
        assert torch.equal(plugin.state_dict()[key], value), key
    key = "layers.1.attn.indexer.weights_proj.weight"
    for edit, message in [
        (lambda t: t.update({key: torch.ones(t[key].shape, dtype=torch.int16)}), rf"model\.safetensors: {key} is I16"),
        (nan_in(key), rf"checkpoint tensor {key} \(model tensor .*, file .*model\.safetensors\) holds 1 non-finite"),
    ]:
        broken = {k: v.clone() for k, v in tensors.items()}
        edit(broken)
        save_file(broken, str(tmp_path / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            load_hf_checkpoint(plugin, tmp_path)


def _check_on_expert_parallel_rank(rank: int, world_size: int, paths: dict) -> dict:
    """Each rank's plugin holds only its own experts (DTensors sharded on the expert axis of an
    ``ep`` mesh, as expert parallelism leaves them) and checks every checkpoint in ``paths``:
    ``{name: None (accepted) or the error}``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    plugin = fresh_plugin()
    sharded = 0
    for module in plugin.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if name in ("gate_and_up_projs", "down_projs"):
                local = distribute_tensor(param.detach(), mesh, [Shard(0)])
                setattr(module, name, torch.nn.Parameter(local, requires_grad=param.requires_grad))
                sharded += 1
    assert sharded >= 2 * 2, sharded  # both expert stacks of the routed layers
    own = [k for k, v in plugin.state_dict().items() if k.endswith("gate_and_up_projs")]
    assert plugin.state_dict()[own[0]].to_local().shape[0] == 4 // world_size
    results = {}
    for name, path in paths.items():
        try:
            plugin.check_checkpoint_source(path)
            results[name] = None
        except ValueError as err:
            results[name] = str(err)
    return results


def test_expert_parallel_ranks_check_against_the_whole_model(good, tmp_path):
    """On 2 gloo ranks, each holding 2 of the 4 experts: the complete checkpoint passes on both,
    and an expert of either rank missing or misshapen is a named ValueError on both."""
    from _support.cp_spawn import run_on_ranks

    expert = "layers.2.ffn.experts.{}.w2.weight"
    paths = {"good": str(good[0])}
    for owner in (0, 3):  # experts 0-1 live on rank 0, 2-3 on rank 1
        key = expert.format(owner)
        (tmp_path / f"missing{owner}").mkdir()
        (tmp_path / f"shape{owner}").mkdir()
        paths[f"missing{owner}"] = str(broken_copy(good, tmp_path / f"missing{owner}", lambda t, k=key: t.pop(k)))
        paths[f"shape{owner}"] = str(broken_copy(
            good, tmp_path / f"shape{owner}", lambda t, k=key: t.update({k: t[k][:, :-1].clone()})
        ))  # fmt: skip
    for results in run_on_ranks(_check_on_expert_parallel_rank, 2, paths):
        assert results["good"] is None, results["good"]
        for owner in (0, 3):
            key = expert.format(owner).replace(".", r"\.")
            assert re.search(f"lacks {key}", results[f"missing{owner}"]), results[f"missing{owner}"]
            assert re.search(f"{key} has shape", results[f"shape{owner}"]), results[f"shape{owner}"]
