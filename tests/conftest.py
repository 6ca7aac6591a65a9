import os
import tempfile

import pytest
import torch

# TileLang creates its cache under ~/.tilelang on import unless told otherwise.
os.environ.setdefault("TILELANG_CACHE_DIR", tempfile.mkdtemp(prefix="nemo-dsa-tilelang-"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: runs the TileLang kernels (pytest -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
