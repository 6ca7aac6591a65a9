"""NVFP4 (E2M1 values, E4M3 block scale) quantize-dequantize with a straight-through gradient
(reference only; V4.1 compressed KV)."""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {"nvfp4_quant_dequant": "nemo_dsa.ops.nvfp4.naive"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
