"""MXFP4 quantize-dequantize with a straight-through gradient (reference only; V4.1 scoring)."""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {"mxfp4_quant_dequant": "nemo_dsa.ops.mxfp4.naive"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
