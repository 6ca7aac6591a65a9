"""DeepSeek-V4 / V4.1 hyper-connection (mHC) mixing: the stream projection with its RMS scale, the
collapse of the streams into a sublayer's input and the expand of its output back into streams.

``naive.py`` holds the references (nemo-automodel's arithmetic for each family), ``kernels.py``
the fused Triton kernels, ``interface.py`` the autograd functions that choose between them.
"""

from nemo_dsa.ops.hyper_connections.interface import (
    HC_BACKENDS,
    collapse_streams,
    expand_streams,
    resolve_hc_backend,
    stream_mix,
)

__all__ = ["HC_BACKENDS", "collapse_streams", "expand_streams", "resolve_hc_backend", "stream_mix"]
