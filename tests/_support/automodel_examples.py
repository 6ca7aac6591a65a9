"""examples/automodel/ (nemo-automodel recipes and the tiny released-layout V4 checkpoint writer)
as the tests run them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "automodel"


def load_writer():
    """examples/automodel/write_tiny_v4_checkpoint.py as a module."""
    spec = importlib.util.spec_from_file_location("write_tiny_v4_checkpoint", EXAMPLES / "write_tiny_v4_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
