"""Parameters that stay fp32 inside low-precision models, as the released DeepSeek-V4 keeps them.

The release holds the compressors' ``wkv``/``wgate``/``ape`` (main and indexer) and the attention
sinks in fp32 when the rest of the model is bf16. A module lists such parameters in
``fp32_parameters``; casting the model (``model.to(torch.bfloat16)``, ``.half()``) leaves them
fp32, and :func:`fp32_parameter_names` tells trainers which ones to skip when they cast by hand.
"""

from __future__ import annotations

import torch
from torch import nn

_LOW_PRECISION = (torch.bfloat16, torch.float16)


class KeepsFP32Parameters(nn.Module):
    """Mixin: the parameters named in ``fp32_parameters`` (own or of submodules) stay fp32."""

    fp32_parameters: tuple[str, ...] = ()

    def _apply(self, fn, recurse: bool = True):
        # Keep the fp32 values themselves: casting to bf16 and back would round them.
        originals = {}
        for name in self.fp32_parameters:
            param = self.get_parameter(name)
            if param.dtype == torch.float32:
                originals[name] = param.data
        super()._apply(fn, recurse)
        for name in self.fp32_parameters:
            param = self.get_parameter(name)
            if param.dtype in _LOW_PRECISION:
                original = originals.get(name)
                source = param.data if original is None else original
                param.data = source.to(device=param.device, dtype=torch.float32)
        return self


def fp32_parameter_names(model: nn.Module) -> set[str]:
    """Full names of every parameter of ``model`` that its modules keep in fp32."""
    names = set()
    for prefix, module in model.named_modules():
        for name in getattr(module, "fp32_parameters", ()):
            names.add(f"{prefix}.{name}" if prefix else name)
    return names
