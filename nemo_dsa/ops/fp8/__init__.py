"""FP8 (E4M3) block quantize-dequantize with a straight-through gradient (reference only; V4.1 window KV)."""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {"fp8_quant_dequant": "nemo_dsa.ops.fp8.naive"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
