"""``x @ weight.T`` for bf16 ``x`` and an fp32 ``weight`` (DeepSeek's fp32 LM head), rounded to bf16.

``naive.py`` is the reference (one fp32 GEMM); ``split.py`` computes the same products exactly on
bf16 tensor cores (the weight as three bf16 pieces, fp32 accumulation) with its own backward.
"""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {
    "fp32_linear_reference": "nemo_dsa.ops.fp32_linear.naive",
    "bf16_pieces": "nemo_dsa.ops.fp32_linear.split",
    "fp32_linear_of_bf16": "nemo_dsa.ops.fp32_linear.split",
    "split_applies": "nemo_dsa.ops.fp32_linear.split",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
