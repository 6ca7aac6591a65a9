"""``integrations/common/lm_head.Fp32HeadLinear``: the built-in's fp32 LM head whose forward takes the
exact-product bf16 path (``ops/fp32_linear``) exactly when its input holds bf16 values on the GPU.

On the CPU the split path is exercised by standing the GPU check and cuBLAS's fp32-output product
in with their CPU emulations; everything else is the module's own fp32 ``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _support.fp32_linear_emulation import EMULATED, operands, ulp_bf16
from _support.helpers import stable_seed
from nemo_dsa.integrations.common import lm_head
from nemo_dsa.integrations.common.lm_head import Fp32HeadLinear, adopt_fp32_head, called_with_bf16
from nemo_dsa.ops.fp32_linear import fp32_linear_of_bf16


class Holder(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)


@pytest.fixture
def split_on_cpu(monkeypatch):
    """The split path on CPU operands; returns the list of calls it served."""
    calls = []

    def split(x, weight, out_dtype=torch.bfloat16):
        calls.append(out_dtype)
        return fp32_linear_of_bf16(x, weight, out_dtype=out_dtype, products=EMULATED)

    monkeypatch.setattr(lm_head, "split_applies", lambda x, weight: True)
    monkeypatch.setattr(lm_head, "fp32_linear_of_bf16", split)
    return calls


def head(weight):
    holder = Holder(weight)
    adopt_fp32_head(holder)
    return holder.lm_head


def test_adopted_head_keeps_its_parameter_and_key():
    _, weight = operands((1,), 16, 12, 0)
    holder = Holder(weight)
    parameter = holder.lm_head.weight
    adopt_fp32_head(holder)
    assert isinstance(holder.lm_head, Fp32HeadLinear) and isinstance(holder.lm_head, nn.Linear)
    assert holder.lm_head.weight is parameter and list(holder.state_dict()) == ["lm_head.weight"]


def test_on_cpu_the_forward_is_the_builtin_fp32_projection_bit_for_bit():
    x, weight = operands((2, 7), 32, 40, stable_seed("cpu head"))
    module = head(weight)
    assert torch.equal(module(x), F.linear(x.float(), weight).to(torch.bfloat16))
    assert torch.equal(module(x.float()), F.linear(x.float(), weight))  # an fp32 call stays fp32


def test_bf16_inputs_take_the_split_path(split_on_cpu):
    x, weight = operands((3, 11), 64, 300, stable_seed("split head"))
    got = head(weight)(x)
    assert split_on_cpu == [torch.bfloat16]
    exact = x.double() @ weight.double().T
    noise = x.double().abs() @ weight.double().abs().T * 2.0**-20
    assert ((got.double() - exact).abs() <= ulp_bf16(exact) * 0.5 + noise).all()


def test_fp32_inputs_take_it_only_when_announced_as_bf16_values(split_on_cpu):
    """FSDP2's fp32 head policy casts the plugin's bf16 hidden state to fp32 before the forward:
    the plugin announces it, any other fp32 caller (the MTP loss) gets the fp32 F.linear."""
    x, weight = operands((2, 5), 32, 50, stable_seed("announced"))
    module = head(weight)
    upcast = module.register_forward_pre_hook(lambda _m, args: (args[0].float(),))
    try:
        plain = module(x)  # not announced: the fp32 path
        assert split_on_cpu == [] and plain.dtype == torch.float32
        with called_with_bf16(module, x):
            announced = module(x)
        # The module answers in its input's dtype (fp32 here, as the fp32 F.linear would).
        assert split_on_cpu == [torch.float32] and announced.dtype == torch.float32
        assert not module.bf16_valued_input  # cleared by the call
        assert module(x).dtype == torch.float32 and split_on_cpu == [torch.float32]  # one call only
    finally:
        upcast.remove()
    torch.testing.assert_close(announced, plain, rtol=1e-5, atol=1e-5)


def test_gradients_through_the_module_match_fp32_autograd(split_on_cpu):
    x, weight = operands((2, 9), 32, 70, stable_seed("head grads"))
    grad = torch.randn(2, 9, 70, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    module = head(weight)
    x1 = x.clone().requires_grad_()
    module(x1).backward(grad)
    x2, w2 = x.double().requires_grad_(), weight.double().requires_grad_()
    F.linear(x2, w2).backward(grad.double())
    torch.testing.assert_close(module.weight.grad.double(), w2.grad, rtol=1e-6, atol=1e-6 * float(w2.grad.abs().max()))
    noise = grad.double().abs() @ weight.double().abs() * 2.0**-20
    assert ((x1.grad.double() - x2.grad).abs() <= ulp_bf16(x2.grad) * 0.5 + noise).all()


def test_the_plugin_adopts_it():
    from _support.v4_builtin_and_plugin import build_plugin, tiny_config  # skips without nemo-automodel

    plugin = build_plugin(tiny_config())
    assert type(plugin.lm_head) is Fp32HeadLinear and plugin.lm_head.weight.dtype == torch.float32


def test_the_v41_plugin_announces_its_bf16_hidden_state(split_on_cpu):
    """The built-in V4.1 forward casts the bf16 hidden state to the fp32 head's dtype itself: the
    plugin's hook on the backbone announces it, so the head's one call takes the split (fp32 logits,
    as the built-in returns), and nothing stays announced after the forward."""
    from _support.v41_builtin_and_plugin import backend, batch, config  # skips without nemo-automodel

    from nemo_dsa.integrations.deepseek_v41 import NemoDsaDeepseekV41ForCausalLM

    torch.manual_seed(0)
    model = NemoDsaDeepseekV41ForCausalLM(config(), backend=backend())
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.bfloat16)  # the head stays fp32
    assert type(model.lm_head) is Fp32HeadLinear and model.lm_head.weight.dtype == torch.float32
    inputs = batch("rows")
    with torch.no_grad():
        fast = model(**inputs).logits
    assert split_on_cpu == [torch.float32] and fast.dtype == torch.float32
    assert not model.lm_head.bf16_valued_input
    with torch.no_grad():
        hidden, _ = model.model(inputs["input_ids"], attention_mask=inputs["attention_mask"])
    exact = hidden.double() @ model.lm_head.weight.double().T
    noise = hidden.double().abs() @ model.lm_head.weight.double().abs().T * 2.0**-20
    assert ((fast.double() - exact).abs() <= noise).all()
