"""The DeepSeek plugins with their hyper-connections on the fused kernels (``hyper_connection_backend``).

On CPU the Triton kernels run in Triton's interpreter (tests/conftest.py). A bf16 model differs
from its fp32 self by bf16 rounding wherever it computes; the fused hyper-connections round in
other places than nemo-automodel's torch code (fp32 sums in another order, the V4 comb product
with fp32 accumulation), so the test measures how far each bf16 model is from the same weights
in fp32 (the torch path) and asks the fused one to be no further than the torch one's own distance
allows. Parameter names and state-dict keys do not change.
"""

from __future__ import annotations

import pytest
import torch

from nemo_dsa.integrations.side_by_side import TINY_OVERRIDES, TINY_VOCAB, build, copy_weights, model_config
from nemo_dsa.ops.hyper_connections.interface import _kernels

pytest.importorskip("nemo_automodel")
pytestmark = pytest.mark.skipif(_kernels() is None, reason="Triton is not installed (scripts/install.sh installs it)")

CASES = {"v4": ([0, 4], 32, "torch"), "v41": ([0, 2, 2, 1, 1], 64, "sdpa")}  # ratios, tokens, backend.attn


def _run(model, ids):
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, position_ids=pos).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None and "hc" in n}
    return logits.detach().float(), grads


def _distance(result, truth):
    logits, grads = result
    t_logits, t_grads = truth
    logit_err = ((logits - t_logits).norm() / t_logits.norm()).item()
    grad_err = max(((grads[n] - t_grads[n]).norm() / t_grads[n].norm().clamp_min(1e-30)).item() for n in t_grads)
    return logit_err, grad_err


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_fused_hyper_connections_are_as_close_to_fp32_as_the_torch_path(family):
    ratios, seq, attn = CASES[family]
    config = model_config(family, ratios, TINY_VOCAB, 4, dtype="bfloat16", **TINY_OVERRIDES[family])
    torch.manual_seed(0)
    base = build("plugin", config, device="cpu", dtype=torch.bfloat16, attn=attn)
    weights = copy_weights(base)
    ids = torch.randint(0, TINY_VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))

    config.hyper_connection_backend = "torch"
    truth = _run(build("plugin", config, {k: v.float() for k, v in weights.items()}, device="cpu",
                       dtype=torch.float32, attn=attn), ids)  # fmt: skip
    torch_path = _run(base, ids)
    config.hyper_connection_backend = "triton"
    fused_model = build("plugin", config, weights, device="cpu", dtype=torch.bfloat16, attn=attn)
    assert list(fused_model.state_dict()) == list(weights)
    fused = _run(fused_model, ids)

    torch_logits, torch_grads = _distance(torch_path, truth)
    fused_logits, fused_grads = _distance(fused, truth)
    assert fused_logits <= 1.5 * torch_logits + 1e-3, (fused_logits, torch_logits)
    assert fused_grads <= 1.5 * torch_grads + 1e-2, (fused_grads, torch_grads)


def test_the_option_is_checked():
    config = model_config("v4", [0], TINY_VOCAB, 4, dtype="float32", **TINY_OVERRIDES["v4"])
    config.hyper_connection_backend = "cuda"
    with pytest.raises(ValueError, match="hyper_connection_backend"):
        build("plugin", config, device="cpu", dtype=torch.float32, attn="torch")


def test_fp32_streams_under_auto_run_the_builtin_arithmetic():
    """On CPU (or fp32) ``auto`` is nemo-automodel's own arithmetic: bitwise the built-in's step."""
    config = model_config("v4", [0, 4], TINY_VOCAB, 4, dtype="float32", **TINY_OVERRIDES["v4"])
    config.hyper_connection_backend = "auto"
    plugin = build("plugin", config, device="cpu", dtype=torch.float32, attn="torch")
    ids = torch.randint(0, TINY_VOCAB, (1, 32), generator=torch.Generator().manual_seed(2))
    auto = _run(plugin, ids)
    plugin.zero_grad()
    config.hyper_connection_backend = "torch"
    reference = _run(build("plugin", config, copy_weights(plugin), device="cpu", dtype=torch.float32,
                           attn="torch"), ids)  # fmt: skip
    assert torch.equal(auto[0], reference[0])
    assert all(torch.equal(auto[1][n], reference[1][n]) for n in reference[1])
