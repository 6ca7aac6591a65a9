"""Every test file collects and runs alone, not only when the whole tree is collected in order.

Static (milliseconds): each module a file under tests/ imports by bare name that is test code must
be the shared package ``_support`` or a test module in a folder on pytest's ``pythonpath``
(pyproject.toml), whose name no other test file shares, so it resolves whichever file runs first;
shared code lives in ``_support`` and nowhere else (no stray modules in the test folders). Dynamic
(two fresh processes, ~10 s each on 2 cores): the two files that once failed alone collect alone.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _pythonpath() -> list[Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return [(ROOT / entry).resolve() for entry in config["pythonpath"]]


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_shared_code_lives_in_support_and_test_imports_resolve_alone():
    files = _test_files()
    support = TESTS / "_support"
    stray = [p.relative_to(TESTS) for p in files
             if support not in p.parents and p.name != "conftest.py" and not p.name.startswith("test_")]  # fmt: skip
    assert not stray, f"shared test code belongs in tests/_support/: {stray}"
    test_modules: dict[str, list[Path]] = {}
    for p in files:
        if p.name.startswith("test_"):
            test_modules.setdefault(p.stem, []).append(p)
    on_path = set(_pythonpath())
    problems = []
    for path in files:
        for name in sorted(_imported_names(path)):
            if name == "tests":
                problems.append(f"{path.relative_to(TESTS)} imports through 'tests.' (import from _support instead)")
            if name not in test_modules:
                continue
            homes = test_modules[name]
            if len(homes) > 1:
                problems.append(f"{path.relative_to(TESTS)} imports {name}, which names {len(homes)} files")
            elif homes[0].parent.resolve() not in on_path and homes[0].parent != path.parent:
                problems.append(f"{path.relative_to(TESTS)} imports {name} from {homes[0].parent.relative_to(ROOT)}, "
                                "not on pytest's pythonpath")  # fmt: skip
    assert not problems, "\n".join(problems)


def test_files_that_failed_alone_collect_alone():
    for name in ("models/test_cp_gpu.py", "ops/test_sparse_attention_kernels_gpu.py"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a fresh shell runs it
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               str(TESTS / name)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, (name, proc.stdout[-3000:], proc.stderr[-3000:])
