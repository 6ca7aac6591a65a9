import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

# Everything the suite itself writes goes under one temporary folder, removed when the session
# ends: TileLang's kernel cache (it creates ~/.tilelang on import unless told otherwise; worker
# processes inherit the variable) and Hypothesis's example database and caches (.hypothesis/ in the
# working directory by default). Runs and exports go to pytest's tmp_path.
if "TILELANG_CACHE_DIR" not in os.environ or "HYPOTHESIS_STORAGE_DIRECTORY" not in os.environ:
    _SESSION_DIR = tempfile.mkdtemp(prefix="nemo-dsa-tests-")
    atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
    os.environ.setdefault("TILELANG_CACHE_DIR", os.path.join(_SESSION_DIR, "tilelang"))
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(_SESSION_DIR, "hypothesis"))

# Without a GPU, Triton kernels run in Triton's interpreter (the same kernels, on the CPU): the
# hyper-connection tests check their arithmetic that way. Set before anything imports a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Child processes import the shared test code (tests/_support), and multiprocessing workers the test
# module whose function they run, by name: they get the test folders pytest put on sys.path.
_TESTS = os.path.dirname(os.path.abspath(__file__))
_TEST_PATHS = [p for p in sys.path if os.path.abspath(p) == _TESTS or os.path.abspath(p).startswith(_TESTS + os.sep)]
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*_TEST_PATHS, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))

try:
    from hypothesis.configuration import set_hypothesis_home_dir
except ImportError:  # hypothesis is a dev dependency; the tests that use it import it themselves
    pass
else:
    set_hypothesis_home_dir(os.environ["HYPOTHESIS_STORAGE_DIRECTORY"])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: runs the TileLang kernels (pytest -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
