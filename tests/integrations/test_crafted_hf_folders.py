"""HF-format folders from someone else on every from_pretrained path: ``NemoDsaV4ForCausalLM``'s
own, nemo-automodel's ``NeMoAutoModelForCausalLM`` (for nemo_dsa's model and the DeepSeek-V4
plugin), ``init_from=`` and the plugins' strict file check. A config.json that does not describe
its weights is refused before anything is allocated (a child process measures the peak memory),
an index naming a file outside the folder is refused before anyone opens it, integer / NaN weights
are refused as the plugins refuse them, and every refusal names the file and key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from _support.bounded import PRINT_PEAK, assert_refused_on_one_line, run_python
from _support.helpers import skip_without_automodel
from nemo_dsa.export import main as export_main
from nemo_dsa.integrations.common.strict_loading import checkpoint_files
from nemo_dsa.train import load_config, main as train_main, train

try:
    import nemo_automodel  # noqa: F401
    from nemo_automodel._transformers import auto_model  # noqa: F401 (needs torchao)
except ImportError as error:
    skip_without_automodel(error)

from _support.helpers import cpu_automodel  # noqa: E402, F401 (a fixture)
from nemo_dsa.integrations.automodel import NemoDsaV4ForCausalLM  # noqa: E402

SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=1", "recipe.ckpt_every=1",
         "recipe.val_every=1", "recipe.val_batches=1", "recipe.warmup_steps=0", "recipe.num_threads=1",
         "recipe.plot=false"]
WEIGHT = "layers.1.attn.wq_b.weight"
# nemo-automodel on a CPU: the patches of helpers.cpu_automodel, in a child process.
AUTOMODEL_ON_CPU = """
import torch
from nemo_automodel import NeMoAutoModelForCausalLM
from nemo_automodel._transformers import auto_model
import nemo_dsa.integrations.automodel, nemo_dsa.integrations.deepseek_v4
torch.cuda.current_device = lambda: 0
original = auto_model.apply_model_infrastructure
def on_cpu(*args, **kwargs):
    kwargs["device"] = torch.device("cpu")
    return original(*args, **kwargs)
auto_model.apply_model_infrastructure = on_cpu
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A tiny V4 run's export: config.json + model.safetensors (copied by each test that alters it)."""
    root = tmp_path_factory.mktemp("exported")
    train(load_config([*SHORT, f"run_dir={root / 'run'}"]))
    assert export_main([f"run_dir={root / 'run'}", f"out={root / 'hf'}"]) == 0
    return root / "hf"


def _copy(exported: Path, tmp_path: Path, *, config=None, tensors=None) -> Path:
    folder = tmp_path / "hf"
    shutil.copytree(exported, folder)
    if config is not None:
        values = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**values, **config}))
    if tensors is not None:
        weights = {**load_file(str(folder / "model.safetensors")), **tensors}
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _refuse_in_child(load: str, folder: Path):
    """Run ``load`` (an expression over ``folder``) in a child: ValueError -> its line, exit 2."""
    code = (f"import sys\n{AUTOMODEL_ON_CPU}\nfolder = {str(folder)!r}\n"
            f"try:\n    {load}\n    code = 0\nexcept ValueError as e:\n"
            "    print(' '.join(str(e).split()), file=sys.stderr)\n    code = 2\n"
            + PRINT_PEAK + "sys.exit(code)\n")
    return run_python(code, timeout=120)


# --- 3: config.json is checked against the weights' header before anything is allocated --------

OWN = "NemoDsaV4ForCausalLM.from_pretrained(folder)"
AUTOMODEL = "NeMoAutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)"
OWN_LOADER = "nemo_dsa.integrations.automodel.NemoDsaV4ForCausalLM.from_pretrained(folder)"


@pytest.mark.parametrize("loader", [OWN_LOADER, AUTOMODEL], ids=["own", "nemo_automodel"])
@pytest.mark.parametrize("vocab_size", [6_000_000, 2**33])
def test_a_config_asking_for_a_huge_model_is_refused_before_allocating(exported, tmp_path, loader, vocab_size):
    folder = _copy(exported, tmp_path, config={"vocab_size": vocab_size})
    line = assert_refused_on_one_line(_refuse_in_child(loader, folder), after_imports=True)
    if vocab_size == 2**33:
        assert "vocab_size must be <=" in line
    elif loader == OWN_LOADER:
        assert "config.json" in line and "embed.weight" in line and "[259, 128]" in line
    else:
        assert "refused before allocating" in line and "embed.weight" in line


def test_a_plugin_config_asking_for_a_huge_model_is_refused_before_allocating(tmp_path):
    from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM

    from _support.v4_builtin_and_plugin import backend, tiny_config, write_hf_folder
    from nemo_dsa.integrations.deepseek_v4 import ARCHITECTURE

    model = DeepseekV4ForCausalLM(tiny_config(), backend=backend())
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    tensors = {k: v.contiguous() for k, v in model.state_dict_adapter.to_hf(model.state_dict()).items()}
    write_hf_folder(tmp_path, tensors, ARCHITECTURE)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 200_000_000}))
    line = assert_refused_on_one_line(_refuse_in_child(AUTOMODEL, tmp_path), after_imports=True)
    assert "refused before allocating" in line and "DeepseekV4ForCausalLM" in line


# --- 4: an index cannot name a file outside the folder -------------------------------------------

@pytest.mark.parametrize("name", ["../" * 30 + "etc/passwd", "/etc/passwd", "inside-link.safetensors"],
                         ids=["dotdot", "absolute", "link_out"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(exported, tmp_path, name):
    folder = _copy(exported, tmp_path)
    (folder / "inside-link.safetensors").symlink_to("/etc/passwd")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {WEIGHT: name}}))
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json|symbolic link to /etc/passwd"):
        checkpoint_files(folder)


def test_a_weights_file_linked_outside_the_folder_is_refused(exported, tmp_path):
    from nemo_dsa.integrations.common.strict_loading import read_safetensors_header

    folder = tmp_path / "linked"
    folder.mkdir()
    shutil.copy(exported / "config.json", folder)
    (folder / "model.safetensors").symlink_to(exported / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{folder / 'model.safetensors'} is a symbolic link to .*, outside"):
        read_safetensors_header(folder / "model.safetensors")


# --- 6: integer, bool and NaN weights are refused on every path; float8 loads ------------------

BAD_WEIGHTS = {
    "int32": (lambda t: torch.ones(t.shape, dtype=torch.int32), f"{WEIGHT} is I32"),
    "bool": (lambda t: torch.ones(t.shape, dtype=torch.bool), f"{WEIGHT} is BOOL"),
    "nan": (lambda t: t.clone().fill_(float("nan")), f"{WEIGHT}"),
}


@pytest.mark.parametrize("case", sorted(BAD_WEIGHTS))
def test_init_from_refuses_weights_it_would_cast_or_that_are_not_finite(exported, tmp_path, case, capsys):
    make, message = BAD_WEIGHTS[case]
    original = load_file(str(exported / "model.safetensors"))[WEIGHT]
    folder = _copy(exported, tmp_path, tensors={WEIGHT: make(original)})
    assert train_main([*SHORT, f"run_dir={tmp_path / 'run'}", f"init_from={folder}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "init_from=" in err[0], err


@pytest.mark.parametrize("case", sorted(BAD_WEIGHTS))
def test_from_pretrained_refuses_weights_it_would_cast_or_that_are_not_finite(exported, tmp_path, case):
    make, message = BAD_WEIGHTS[case]
    original = load_file(str(exported / "model.safetensors"))[WEIGHT]
    folder = _copy(exported, tmp_path, tensors={WEIGHT: make(original)})
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        NemoDsaV4ForCausalLM.from_pretrained(str(folder))


@pytest.mark.parametrize("case", ["int32", "nan"])
def test_nemo_automodel_refuses_weights_it_would_cast_or_that_are_not_finite(cpu_automodel, exported, tmp_path,
                                                                              case):
    from nemo_automodel import NeMoAutoModelForCausalLM

    make, message = BAD_WEIGHTS[case]
    original = load_file(str(exported / "model.safetensors"))[WEIGHT]
    folder = _copy(exported, tmp_path, tensors={WEIGHT: make(original)})
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        NeMoAutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def test_init_from_loads_float8_weights_as_their_float32_values(exported, tmp_path, capsys):
    weights = load_file(str(exported / "model.safetensors"))
    folder = _copy(exported, tmp_path, tensors={WEIGHT: weights[WEIGHT].to(torch.float8_e4m3fn)})
    args = [*SHORT, "recipe.max_steps=1", f"run_dir={tmp_path / 'run'}", f"init_from={folder}"]
    assert train_main(args) == 0, capsys.readouterr().err


def test_float8_weights_load_as_their_float32_values(exported, tmp_path):
    weights = load_file(str(exported / "model.safetensors"))
    fp8 = weights[WEIGHT].to(torch.float8_e4m3fn)
    folder = _copy(exported, tmp_path, tensors={WEIGHT: fp8})
    model = NemoDsaV4ForCausalLM.from_pretrained(str(folder))
    assert torch.equal(model.state_dict()[WEIGHT], fp8.float())


# --- 12 / 15: config.json and weights that cannot be read are one line naming the file -----------

@pytest.mark.parametrize("content, message", [
    ("[" * 100_000 + "]" * 100_000, "nests JSON deeper"),
    ("[1, 2]", "holds a JSON list, not an object"),
], ids=["deep", "list"])
def test_an_unreadable_config_json_names_the_file(exported, tmp_path, content, message):
    folder = _copy(exported, tmp_path)
    (folder / "config.json").write_text(content)
    with pytest.raises(ValueError, match=rf"{folder / 'config.json'} {message}"):
        NemoDsaV4ForCausalLM.from_pretrained(str(folder))


def test_a_truncated_or_linked_weights_file_names_the_file(exported, tmp_path):
    folder = _copy(exported, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"{weights} is \d+ bytes where its header describes \d+"):
        NemoDsaV4ForCausalLM.from_pretrained(str(folder))
    weights.unlink()
    weights.symlink_to(exported / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{weights} is a symbolic link"):
        NemoDsaV4ForCausalLM.from_pretrained(str(folder))
