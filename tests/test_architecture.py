"""The package's architecture: the import contract (pyproject.toml, [tool.importlinter]), lazy
heavy dependencies, and the public exports of nemo_dsa and its op packages."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import nemo_dsa

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nemo_dsa"
OP_PACKAGES = ["topk", "fused_selection", "v4_indexer", "v41_indexer", "quant"]


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_import_contract_is_kept():
    """lint-imports on the contracts in pyproject.toml: a change that turns an arrow back fails here."""
    run = subprocess.run(
        # --no-cache: no .import_linter_cache directory left in the checkout.
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
         "--no-cache"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert "No module named 'importlinter'" not in run.stderr, "install the dev extra: pip install -e '.[dev]'"
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"{len(_contracts())} kept, 0 broken" in run.stdout


def test_every_top_level_module_has_a_layer():
    """A new module or package under nemo_dsa/ must be placed in the layers contract."""
    layers = next(c for c in _contracts() if c["id"] == "layers")["layers"]
    placed = {name.strip().strip("()") for layer in layers for name in layer.replace(":", "|").split("|")}
    found = {f"nemo_dsa.{p.stem}" for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    found |= {f"nemo_dsa.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py")}
    assert found <= placed, f"not in the layers contract: {sorted(found - placed)}"


@pytest.mark.parametrize(
    "module",
    [
        "nemo_dsa",
        "nemo_dsa.metadata",
        "nemo_dsa.ops.topk.interface",
        "nemo_dsa.ops.fused_selection.interface",
        "nemo_dsa.ops.v4_indexer.interface",
        "nemo_dsa.ops.v41_indexer.interface",
        "nemo_dsa.ops.quant.mxfp4",
        "nemo_dsa.ops._tilelang",
        "nemo_dsa.ops.topk.kernels",
        "nemo_dsa.ops.v4_indexer.kernels",
        "nemo_dsa.ops.v41_indexer.kernels",
        "nemo_dsa.layers",
        "nemo_dsa.models.dsa_lm",
    ],
)
def test_import_loads_no_heavy_dependency(module):
    """TileLang is imported when a kernel is built, nemo-automodel and transformers only by the
    integrations: importing the library, its ops (kernel modules included) or its model does not
    load them (nor initialise CUDA)."""
    code = (
        f"import sys, torch, {module};"
        "bad = [m for m in ('tilelang', 'tvm', 'nemo_automodel', 'transformers') if m in sys.modules];"
        "assert not bad, bad;"
        "assert not torch.cuda.is_initialized()"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_lazy_exports_resolve_to_the_interfaces():
    from nemo_dsa.ops.topk.gather import pytorch_extract_topk_scores
    from nemo_dsa.ops.v4_indexer.interface import V4IndexerFunction, v4_indexer_bshd, v4_lighting_indexer
    from nemo_dsa.ops.v41_indexer.interface import indexer_scores

    assert nemo_dsa.v4_lighting_indexer is v4_lighting_indexer
    assert nemo_dsa.v4_indexer_bshd is v4_indexer_bshd
    assert nemo_dsa.V4IndexerFunction is V4IndexerFunction
    assert nemo_dsa.pytorch_extract_topk_scores is pytorch_extract_topk_scores
    assert nemo_dsa.indexer_scores is indexer_scores
    with pytest.raises(AttributeError, match="no attribute"):
        nemo_dsa.not_a_name  # noqa: B018


@pytest.mark.parametrize("package", OP_PACKAGES)
def test_op_packages_export_their_public_names(package):
    """Every name in ``__all__`` resolves (lazily); functions and classes come from the package."""
    module = importlib.import_module(f"nemo_dsa.ops.{package}")
    assert module.__all__ and sorted(dir(module)) == sorted(module.__all__)
    for name in module.__all__:
        value = getattr(module, name)
        if isinstance(value, type) or callable(value):
            assert value.__module__.startswith("nemo_dsa.ops."), (name, value.__module__)
