"""Every test file collects and runs alone, not only when the whole tree is collected in order.

Static (milliseconds): no module under tests/ imports a test module (``test_*``), neither in its
own code nor in a script it hands a child process as text; what test files share lives in the
package ``_support`` and nowhere else (no other module in the test folders). ``tests/`` and every
folder holding test files are on pytest's ``pythonpath`` (pyproject.toml): ``_support`` resolves
from any file, and the worker processes of the multi-process tests (tests/conftest.py hands them
the path) import the test module whose function they run by its name. Dynamic (one fresh
process, ~10 s on 2 cores): the two files that once failed alone collect without the rest.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# An import statement at the start of a line of a string: a script a test runs in a child process.
_IMPORT_IN_TEXT = re.compile(r"^\s*(?:from|import)\s+([\w.]+)", re.MULTILINE)
_IMPORT_FUNCTIONS = {"import_module", "__import__"}


def _pythonpath() -> set[Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return {(ROOT / entry).resolve() for entry in config["pythonpath"]}


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def imported_modules(source: str, filename: str = "<test>") -> set[str]:
    """Top-level names of the modules ``source`` imports: import statements anywhere (functions
    included), ``importlib.import_module`` / ``__import__`` of a literal name, and import lines
    in string literals (child-process scripts)."""
    names = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if function in _IMPORT_FUNCTIONS and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.update(_IMPORT_IN_TEXT.findall(node.value))
    return {name.split(".")[0] for name in names}


def layout_problems(path: Path) -> list[str]:
    names = imported_modules(path.read_text(), str(path))
    problems = [f"imports test module {name} (move what it shares into tests/_support/)"
                for name in sorted(names) if name.startswith("test_")]  # fmt: skip
    if "tests" in names:
        problems.append("imports through 'tests.' (import from _support instead)")
    return problems


def test_no_test_module_imports_another_and_shared_code_lives_in_support():
    files = _python_files()
    support = TESTS / "_support"
    stray = [p.relative_to(TESTS) for p in files
             if support not in p.parents and p.name != "conftest.py" and not p.name.startswith("test_")]  # fmt: skip
    assert not stray, f"shared test code belongs in tests/_support/: {stray}"
    # This file's own examples (below) are the imports it looks for.
    checked = [path for path in files if path != Path(__file__).resolve()]
    problems = [f"{path.relative_to(TESTS)}: {problem}" for path in checked for problem in layout_problems(path)]
    assert not problems, "\n".join(problems)
    folders = {p.parent for p in files if p.name.startswith("test_")} | {TESTS}
    missing = sorted(str(folder.relative_to(ROOT)) for folder in folders - _pythonpath())
    assert not missing, f"not on pytest's pythonpath (pyproject.toml): {missing}"


def test_the_check_finds_every_way_of_importing_a_test_module(tmp_path):
    sources = {
        "plain": "import test_layers\n",
        "from": "from test_cp_model import CASES\n",
        "in a function": "def f():\n    from test_data import check_row_invariants\n",
        "dotted": "import test_layers.sub as t\n",
        "by name": "import importlib\nimportlib.import_module('test_layers')\n",
        "child script": 'SCRIPT = """\nimport json\nimport test_sparse_attention_kernels_gpu as t\n"""\n',
        "through tests": "from tests._support.helpers import stable_seed\n",
    }
    for what, source in sources.items():
        path = tmp_path / "test_example.py"
        path.write_text(source)
        assert layout_problems(path), what
    clean = tmp_path / "test_clean.py"
    clean.write_text('from _support.helpers import stable_seed\nimport pytest\nSCRIPT = "import _support.cp_spawn"\n'
                     '"""A docstring naming test_layers.py."""\n')  # fmt: skip
    assert layout_problems(clean) == []


def test_files_that_failed_alone_collect_alone():
    names = ("models/test_cp_gpu.py", "ops/test_sparse_attention_kernels_gpu.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a fresh shell runs it
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *(str(TESTS / name) for name in names)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
