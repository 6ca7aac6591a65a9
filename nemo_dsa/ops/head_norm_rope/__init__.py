"""V4's query preparation in one pass: the weightless per-head RMS norm, then RoPE on the last
rotary channels (``naive.py``: the reference, the layer's eager ops; ``kernels.py``: TileLang)."""

from nemo_dsa._lazy import lazy_exports

_EXPORTS = {
    "head_rms_rope": "nemo_dsa.ops.head_norm_rope.interface",
    "head_rms_rope_reference": "nemo_dsa.ops.head_norm_rope.naive",
    "kernels_support": "nemo_dsa.ops.head_norm_rope.interface",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
