"""The DeepSeek-V4.1 plugin under nemo-automodel's pipeline parallelism: refused, as the built-in is.

nemo-automodel 0.7.0's V4.1 model has no pipeline stages (``ModelCapabilities.supports_pp`` is
False; its forward needs the embedding on every stage), and ``AutoPipeline`` refuses to build them
for its ``deepseek_v41`` config. The plugin keeps that config and gets the same error, on 2 gloo
ranks, while the stages are built: never a failure inside a later stage's forward.
"""

from __future__ import annotations

import pytest
import torch

from _support.helpers import skip_without_automodel

try:
    import nemo_automodel  # noqa: F401
except ImportError as error:
    skip_without_automodel(error)

from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

from _support.cp_spawn import run_on_ranks
from nemo_dsa.integrations import NemoDsaDeepseekV41ForCausalLM
from _support.v41_builtin_and_plugin import backend, config

pytestmark = pytest.mark.slow


def _build_stages(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from nemo_automodel.components.distributed.pipelining.autopipeline import AutoPipeline
    from nemo_automodel.components.loss.masked_ce import MaskedCrossEntropy

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("pp",))
    messages = {}
    for cls in (DeepseekV41ForCausalLM, NemoDsaDeepseekV41ForCausalLM):
        pipeline = AutoPipeline(
            world_mesh=mesh, pp_axis_name="pp", dp_axis_names=None, pp_schedule="1f1b", pp_batch_size=2,
            patch_inner_model=False, patch_causal_lm_model=False, device=torch.device("cpu"),
        )  # fmt: skip
        try:
            pipeline.build(cls(config(), backend=backend()), loss_fn=MaskedCrossEntropy())
        except ValueError as err:
            messages[cls.__name__] = str(err)
    return messages


def test_pipeline_stages_are_refused_as_for_the_builtin():
    assert DeepseekV41ForCausalLM.ModelCapabilities().supports_pp is False
    assert NemoDsaDeepseekV41ForCausalLM.ModelCapabilities().supports_pp is False
    for messages in run_on_ranks(_build_stages, 2):
        builtin, plugin = messages.get("DeepseekV41ForCausalLM"), messages.get("NemoDsaDeepseekV41ForCausalLM")
        assert builtin and "not compatible with pipeline parallelism" in builtin, messages
        assert plugin == builtin.replace("DeepseekV41ForCausalLM", "NemoDsaDeepseekV41ForCausalLM"), messages
