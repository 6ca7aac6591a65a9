"""Lazy package exports: a package's public names load their modules on first use.

``nemo_dsa`` and each op package export names from their modules this way, so that importing one
module never imports its siblings: ``import nemo_dsa`` stays light (no TileLang, no CUDA
initialisation), and importing ``ops/<op>/naive.py`` (as the fused selection does for the
scorers) does not pull in that op's interface.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: name -> the module that defines it."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return list(getattr(sys.modules[package], "__all__", sorted(exports)))

    return __getattr__, __dir__
