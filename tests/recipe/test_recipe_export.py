"""``nemo-dsa-export``'s HF-format folder read back by transformers-style loading and by
nemo-automodel: the same logits as the run's own checkpoint, in both scoring modes."""

from __future__ import annotations

import json

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
    import transformers  # noqa: F401
    from nemo_automodel._transformers import auto_model  # noqa: F401 (needs torchao)
except ImportError as error:
    skip_without_automodel(error)

from _support.helpers import cpu_automodel  # noqa: F401 (a fixture)
from nemo_dsa.export import main as export_main
from nemo_dsa.recipe.inference import load_run
from nemo_dsa.train import load_config, train

SHORT = ["recipe=smoke", "recipe.seq_len=32", "recipe.batch_size=2", "recipe.max_steps=1", "recipe.ckpt_every=1",
         "recipe.val_every=1", "recipe.val_batches=1", "recipe.warmup_steps=0", "recipe.num_threads=1",
         "recipe.plot=false"]


@pytest.fixture(scope="module", params=["v4", "v41"])
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"export-{request.param}")
    train(load_config([*SHORT, f"scoring={request.param}", f"run_dir={root / 'run'}"]))
    assert export_main([f"run_dir={root / 'run'}", f"out={root / 'hf'}"]) == 0
    return request.param, root / "run", root / "hf"


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (2, 37), generator=g)


def _reference_logits(run_dir) -> torch.Tensor:
    with torch.no_grad():
        return load_run(run_dir).model(_inputs()).logits


def test_transformers_style_loading(exported):
    from transformers import AutoConfig

    from nemo_dsa.integrations import automodel as integ

    scoring, run_dir, folder = exported
    config = AutoConfig.from_pretrained(folder)
    cls = {"v4": integ.NemoDsaV4ForCausalLM, "v41": integ.NemoDsaV41ForCausalLM}[scoring]
    assert type(config) is cls.config_class and config.architectures == [cls.__name__]
    assert config.to_dsa_config() == load_run(run_dir).model.config
    model = cls.from_pretrained(str(folder))
    assert not model.training
    with torch.no_grad():
        assert torch.equal(model(_inputs()).logits, _reference_logits(run_dir))


def test_nemo_automodel_from_pretrained(exported, cpu_automodel):  # noqa: F811
    from nemo_automodel import NeMoAutoModelForCausalLM

    from nemo_dsa.integrations import automodel as integ

    scoring, run_dir, folder = exported
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    model = NeMoAutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert isinstance(model, getattr(integ, architecture))
    assert set(model.state_dict()) == set(load_run(run_dir).model.state_dict())
    with torch.no_grad():
        assert torch.equal(model.eval()(_inputs()).logits, _reference_logits(run_dir))


def test_from_pretrained_refuses_a_folder_of_the_other_scoring(exported):
    from nemo_dsa.integrations import automodel as integ

    scoring, _, folder = exported
    other = {"v4": integ.NemoDsaV41ForCausalLM, "v41": integ.NemoDsaV4ForCausalLM}[scoring]
    with pytest.raises(ValueError, match="model_type"):
        other.from_pretrained(str(folder))
