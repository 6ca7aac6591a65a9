"""Where nemo_dsa's Triton kernels come from: imported only where Triton is installed (CPU installs
may lack it), and run in Triton's interpreter on CPU tensors when ``TRITON_INTERPRET=1`` (the
tests check the kernels' arithmetic that way)."""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType


@functools.cache
def load_kernels(module: str) -> ModuleType | None:
    """The kernels module ``module`` (a dotted name), or None where Triton is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET`` set and not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1): Triton's block shapes are powers of two."""
    return 1 << max(0, (int(n) - 1).bit_length())
