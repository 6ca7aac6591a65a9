"""The built-in's fp32 LM head, with its products on bf16 tensor cores when the plugin calls it.

nemo-automodel keeps DeepSeek's ``lm_head`` weight in fp32 and projects the bf16 final hidden
state as ``lm_head(hidden.float()).to(hidden.dtype)`` (``fp32_lm_head``): fp32 GEMMs on SIMT units.
``Fp32HeadLinear`` is that ``nn.Linear`` (same parameter, same checkpoint key, FSDP2's hooks on the
module as before) whose forward computes the same projection with
``nemo_dsa.ops.fp32_linear.fp32_linear_of_bf16`` (exact products, fp32 accumulation, one rounding
to bf16, or fp32 logits for an fp32 input) whenever its input holds bf16 values on a CUDA device:
a bf16 tensor, or an fp32 one that the plugin announced as the upcast of its bf16 hidden state
(FSDP2's fp32 head policy casts the module's inputs to fp32 before the forward; the built-in V4.1
forward casts the hidden state to the head's dtype itself). Every other call (the MTP loss's fp32
states, CPU, a DTensor weight) is the built-in's ``F.linear`` in fp32, unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from nemo_dsa.ops.fp32_linear import fp32_linear_of_bf16, split_applies


class Fp32HeadLinear(nn.Linear):
    """``nn.Linear`` computing ``x.float() @ weight.T`` (fp32 weight) in ``x``'s dtype, in exact
    bf16 products when ``x`` holds bf16 values."""

    # Set by the plugin right before the head's call whose fp32 input holds bf16 values; read and
    # cleared by that call (``called_with_bf16``, ``announce_bf16_hidden``).
    bf16_valued_input = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        announced, self.bf16_valued_input = self.bf16_valued_input, False
        bf16_valued = x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and announced)
        if bf16_valued and self.bias is None:
            values = x.to(torch.bfloat16)  # exact: the input holds bf16 values
            if split_applies(values, self.weight):
                return fp32_linear_of_bf16(values, self.weight, out_dtype=x.dtype)
        return super().forward(x.float()).to(x.dtype)


def adopt_fp32_head(model: nn.Module) -> None:
    """Make ``model.lm_head`` (a plain ``nn.Linear``) an ``Fp32HeadLinear``, in place (same parameters)."""
    head = getattr(model, "lm_head", None)
    if type(head) is nn.Linear:
        head.__class__ = Fp32HeadLinear


@contextmanager
def called_with_bf16(head: nn.Module, hidden: torch.Tensor):
    """Tell ``head`` that the input of the call inside holds ``hidden``'s bf16 values (even if a
    wrapper casts it to fp32 first)."""
    if not isinstance(head, Fp32HeadLinear) or hidden.dtype != torch.bfloat16:
        yield
        return
    head.bf16_valued_input = True
    try:
        yield
    finally:
        head.bf16_valued_input = False


def announce_bf16_hidden(model: nn.Module, head: nn.Module):
    """A forward hook for ``model`` (a backbone returning ``(hidden, ...)``) that announces a bf16
    ``hidden`` to ``head`` for its next call: the built-in V4.1 forward casts it to fp32 first."""

    def hook(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(head, Fp32HeadLinear) and isinstance(hidden, torch.Tensor):
            head.bf16_valued_input = hidden.dtype == torch.bfloat16

    return model.register_forward_hook(hook)
