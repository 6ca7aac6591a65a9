"""Block quantize-dequantize references with a straight-through gradient, the roundings DeepSeek-V4.1
applies: FP8 E4M3 in blocks of 32 (window KV, ``fp8``), MXFP4 in blocks of 32 (index q/k,
``mxfp4``), NVFP4 in blocks of 16 (compressed KV, ``nvfp4``); ``blocks`` holds what they share."""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {
    "fp8_quant_dequant": "nemo_dsa.ops.quant.fp8",
    "mxfp4_quant_dequant": "nemo_dsa.ops.quant.mxfp4",
    "nvfp4_quant_dequant": "nemo_dsa.ops.quant.nvfp4",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
