"""No test module imports from another test module (a file named ``test_*.py``).

Helpers, fakes and fixtures that more than one test module uses live in shared, non-test modules
(``tests/fakes.py``: the dataflow client's contract, its in-process adapter and its fakes;
``tests/proc_helpers.py``, ``tests/unit/*_fakes.py``, ``tests/unit/run_folders.py``,
``tests/integration/service_helpers.py``, ``tests/integration/conftest.py``, ...), so a test
module can be changed, renamed or deleted without breaking another one. Every ``tests/**/*.py``
is read with :mod:`ast`; an ``import`` / ``from ... import`` (absolute or relative) of a
``test_*`` module fails, and so does a dotted path to *another* test module in a string (a
``class_path`` in a config a test writes, a script run in a child process): those import it too,
only later.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"

#: a dotted path into the tests package, as a plugin ``class_path`` or a child's script names it
DOTTED = re.compile(r"\btests(?:\.[A-Za-z_]\w*)+")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def named_test_module(dotted: str) -> str | None:
    """The ``test_*`` module ``dotted`` names or lies in (``tests.unit.test_x.Foo`` ->
    ``tests.unit.test_x``); None for anything else (shared modules, packages, other code)."""
    parts = dotted.split(".")
    if parts[0] != "tests":
        # a bare ``import test_x`` (the tests folder on sys.path): any test file of that name
        if parts[0].startswith("test_") and any(TESTS.rglob(f"{parts[0]}.py")):
            return parts[0]
        return None
    for i in range(2, len(parts) + 1):
        name = parts[i - 1]
        if name.startswith("test_") and REPO.joinpath(*parts[:i - 1], f"{name}.py").is_file():
            return ".".join(parts[:i])
    return None


def imported_modules(tree: ast.AST, importer: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of everything the import statements of ``tree`` import, relative
    imports resolved against ``importer``; ``from a import b`` gives both ``a`` and ``a.b``."""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - (node.level - 1)] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names
                    if alias.name != "*"]
    return out


def violations(source: str, path: Path) -> list[str]:
    importer = module_name(path)
    tree = ast.parse(source, filename=str(path))
    found = []
    for line, name in imported_modules(tree, importer, path.name == "__init__.py"):
        target = named_test_module(name)
        message = f"{path.relative_to(REPO)}:{line}: imports {target}"
        if target is not None and message not in found:
            found.append(message)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for match in DOTTED.finditer(node.value):
                target = named_test_module(match.group())
                # The one exemption: a string naming the module ITSELF. It is how a child process
                # or a plugin loader reaches this module's own helpers, which must be importable
                # by a dotted path: tests/unit/test_dataflow_crash_state.py's kill -9 test runs a
                # child that does ``from tests.unit.test_dataflow_crash_state import make,
                # drive`` (the same setup as the in-process test, in a process it can SIGKILL);
                # test_eval_pass_k, test_tool_agent and test_math_reward name their own classes
                # and functions as ``class_path`` / verifier paths. That shares nothing between
                # test modules. (An import *statement* of the module itself is never needed and
                # is not exempt.)
                if target is not None and target != importer:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: names {target} "
                                 f"in a string ({match.group()!r})")
    return found


def test_no_test_module_imports_from_another_test_module():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += violations(path.read_text(), path)
    assert not found, ("test modules must not import from other test modules; move what they "
                       "share into a shared non-test module (or a conftest.py fixture):\n"
                       + "\n".join(found))


def test_the_check_sees_every_form_of_import():
    path = Path(__file__).resolve()  # the importer: this module
    # ``{t}`` is "tests": spelled out, these samples would be strings naming other test modules
    bad = {
        "from {t}.unit.test_proc import SLEEPER": "{t}.unit.test_proc",
        "from {t}.unit import test_proc": "{t}.unit.test_proc",
        "import {t}.unit.test_proc": "{t}.unit.test_proc",
        "from .test_proc import SLEEPER": "{t}.unit.test_proc",
        "from ..integration.test_launcher import published_versions":
            "{t}.integration.test_launcher",
        "def f():\n    from {t}.integration.test_launcher import published_versions":
            "{t}.integration.test_launcher",
        "CFG = 'class_path: {t}.unit.test_report.write_db'": "{t}.unit.test_report",
        # an import statement of the module itself is not exempt
        "from {t}.unit.test_no_cross_test_imports import REPO":
            "{t}.unit.test_no_cross_test_imports",
    }
    for source, target in bad.items():
        source, target = source.format(t="tests"), target.format(t="tests")
        (found,) = violations(source, path)
        assert target in found, (source, found)
    fine = ["from tests.proc_helpers import gone", "from tests.fakes import FakeStore",
            "from tests.unit.raas_fakes import states", "import tests.fakes",
            "from . import engine_fakes", "from tests.integration.service_helpers import fake_raas",
            "import unittest", "from torch import testing",
            "HERE = 'tests.unit.test_no_cross_test_imports'"]  # a string naming the module itself
    for source in fine:
        assert violations(source, path) == [], source
