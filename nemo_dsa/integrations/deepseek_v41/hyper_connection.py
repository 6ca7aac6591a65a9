"""nemo-automodel's DeepSeek-V4.1 hyper-connection mixer on nemo_dsa's fused mHC parts.

``NemoDsaDeepseekV41HyperConnection`` is the built-in's ``DeepseekV41HyperConnection`` (its class
made this subclass; same parameters): the built-in block calls its ``forward`` (the coefficients),
``collapse`` and ``expand``, which here run on ``nemo_dsa.ops.hyper_connections`` in V4.1's
rounding (the projection before the RMS scale, the logits in one ``addcmul``, the expand summed in
fp32 and rounded once). On the ``torch`` backend each is nemo-automodel's arithmetic, op for op.
See ``integrations/common/hyper_connections.py``.
"""

from __future__ import annotations

import torch

from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection, DeepseekV41Mix

from nemo_dsa.integrations.common.hyper_connections import hc_coefficients
from nemo_dsa.ops.hyper_connections import collapse_streams, expand_streams, stream_mix

__all__ = ["NemoDsaDeepseekV41HyperConnection", "adopt_hyper_connections"]


class NemoDsaDeepseekV41HyperConnection(DeepseekV41HyperConnection):
    """The built-in mixer on the fused parts (module docstring)."""

    hc_backend: str

    def forward(self, hidden_states: torch.Tensor) -> DeepseekV41Mix:
        mix = stream_mix(hidden_states, self.fn, self.norm_eps, order="project_first", backend=self.hc_backend)
        return DeepseekV41Mix(*hc_coefficients(mix, self.base, self.scale, self.streams, self.eps, self.iterations,
                                               fused_affine=True))  # fmt: skip

    def collapse(self, hidden_states: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return collapse_streams(hidden_states, pre_mix, backend=self.hc_backend)

    def expand(self, output: torch.Tensor, residual: torch.Tensor, mix: DeepseekV41Mix) -> torch.Tensor:  # type: ignore[override]
        return expand_streams(output, residual, mix.post, mix.comb, rounding="once", backend=self.hc_backend)


def adopt_hyper_connections(blocks, hc_backend: str) -> None:
    """Make the ``attn_hc`` / ``ffn_hc`` mixers of ``blocks`` run on ``hc_backend``."""
    for block in blocks:
        for name in ("attn_hc", "ffn_hc"):
            mixer = getattr(block, name, None)
            if isinstance(mixer, DeepseekV41HyperConnection):
                mixer.__class__ = NemoDsaDeepseekV41HyperConnection
                mixer.hc_backend = hc_backend
