"""The DeepSeek plugins' hyper-connections (mHC) on nemo_dsa's fused parts.

nemo-automodel computes each mixing site in torch: an fp32 copy of the ``[tokens, M * hidden]``
streams and its RMS-normalised copy (both kept for the backward), a narrow fp32 projection, the
coefficients, then the collapse and the expand as broadcast products and a batched 4 x 4 GEMM.
With ``hyper_connection_backend`` on ``triton`` (or ``auto`` on a GPU) the plugins run the same
mathematics on ``nemo_dsa.ops.hyper_connections``' fused kernels: one pass over the bf16 streams
for the projection and its RMS scale, one for the collapse, one for the expand, each with a fused
backward; the coefficients (pre, post and the Sinkhorn-normalised comb, ``[tokens, M * (M + 2)]``
fp32) stay the few small torch ops they are. ``torch`` runs nemo-automodel's arithmetic, op for
op. Parameter names, shapes and dtypes do not change (the modules are the built-in's, their class
made a subclass), so checkpoints, FSDP2, LoRA targets and the ``recompute`` option work as before.
"""

from __future__ import annotations

import torch

from nemo_dsa.ops.hyper_connections import HC_BACKENDS
from nemo_dsa.ops.hyper_connections.naive import sinkhorn_reference

__all__ = ["DEFAULT_HC_BACKEND", "HC_BACKENDS", "hc_coefficients", "pop_hc_backend_option"]

# The fused kernels on CUDA bf16 streams, nemo-automodel's arithmetic elsewhere (CPU, fp32).
DEFAULT_HC_BACKEND = "auto"


def pop_hc_backend_option(kwargs: dict, config) -> str:
    """The plugins' ``hyper_connection_backend`` option, checked: popped from the constructor's
    ``kwargs``, else the config attribute of that name, else ``DEFAULT_HC_BACKEND``."""
    value = kwargs.pop("hyper_connection_backend", None)
    if value is None:
        value = getattr(config, "hyper_connection_backend", None) or DEFAULT_HC_BACKEND
    if value not in HC_BACKENDS:
        raise ValueError(f"hyper_connection_backend must be one of {HC_BACKENDS}, got {value!r}")
    return value


def hc_coefficients(
    mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: int, eps: float, iterations: int, *,
    fused_affine: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``pre`` ``[..., M]``, ``post`` ``[..., M]`` and ``comb`` ``[..., M, M]`` from the mix
    ``[..., M * (M + 2)]``: ``pre = sigmoid(logit) + eps``, ``post = 2 sigmoid(logit)``, ``comb``
    the Sinkhorn normalisation of its logits, each logit ``mix * scale[part] + base``.
    ``fused_affine`` computes the logits in one ``addcmul`` (V4.1's rounding) instead of a product
    and a sum per part (V4's)."""
    m = streams
    base, scale = base.float(), scale.float()
    if fused_affine:
        scales = torch.cat((scale[0].expand(m), scale[1].expand(m), scale[2].expand(m * m)))
        logits = torch.addcmul(base, mix, scales)
        pre_logit, post_logit, comb_logit = logits[..., :m], logits[..., m : 2 * m], logits[..., 2 * m :]
        comb_logit = comb_logit.unflatten(-1, (m, m))
    else:
        pre_scale, post_scale, comb_scale = scale.unbind(0)
        pre_logit = mix[..., :m] * pre_scale + base[:m]
        post_logit = mix[..., m : 2 * m] * post_scale + base[m : 2 * m]
        comb_logit = mix[..., 2 * m :].view(*mix.shape[:-1], m, m) * comb_scale + base[2 * m :].view(m, m)
    pre = torch.sigmoid(pre_logit) + eps
    post = 2 * torch.sigmoid(post_logit)
    return pre, post, sinkhorn_reference(comb_logit, iterations, eps)
