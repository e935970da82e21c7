"""The tests' own layout (CONTRIBUTING.md, "Tests"), read from the files: no module under tests/ imports a test
module (shared fixtures live in conftest.py, shared helpers in helper modules), a unit test imports nothing from
tests/integration or tests/e2e, test files are named after a module or a behaviour (not an issue or a milestone),
and a unit test that starts a gRPC server fails (tests/unit/conftest.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import grpc
import grpc.aio
import pytest

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
# tests/fakes is a stand-in for tensorrt_llm, not tests
MODULES = sorted(p for p in TESTS.rglob("*.py") if "fakes" not in p.relative_to(TESTS).parts)
MILESTONE = re.compile(r"^test_(hardening|hygiene|issue|milestone|m\d|i\d)")


def imported_modules(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, dotted name) of every module `path` imports; relative imports resolved against its package."""
    package = path.relative_to(root).with_suffix("").parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            out.append((node.lineno, module))
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]  # `from tests.e2e import test_x`
    return out


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_no_module_under_tests_imports_a_test_module():
    offenders = sorted({f"{where(path, line)} imports {name}" for path in MODULES for line, name in imported_modules(path)
                        if name.startswith("tests.") and any(part.startswith("test_") for part in name.split("."))})
    assert offenders == [], "move the shared fixture to a conftest.py, the shared helper to a helper module"


def test_the_rule_sees_every_form_of_import(tmp_path):
    package = tmp_path / "tests" / "e2e"
    package.mkdir(parents=True)
    lines = ["from tests.e2e.test_cli import cli", "from .test_cli import cli", "from tests.e2e import test_cli",
             "import tests.e2e.test_cli", "from . import live_server"]
    (package / "test_x.py").write_text("\n".join(lines) + "\n")
    names = [name for _, name in imported_modules(package / "test_x.py", tmp_path)]
    assert names == ["tests.e2e.test_cli", "tests.e2e.test_cli.cli", "tests.e2e.test_cli", "tests.e2e.test_cli.cli",
                     "tests.e2e", "tests.e2e.test_cli", "tests.e2e.test_cli", "tests.e2e", "tests.e2e.live_server"]


def test_unit_tests_import_nothing_from_the_integration_or_e2e_tests():
    offenders = [f"{where(path, line)} imports {name}" for path in MODULES if path.parent.name == "unit"
                 for line, name in imported_modules(path) if name.startswith(("tests.integration", "tests.e2e"))]
    assert offenders == [], "a unit test that needs a server or a process belongs in tests/integration or tests/e2e"


def test_test_files_are_named_after_a_module_or_a_behaviour():
    named = [str(p.relative_to(ROOT)) for p in MODULES if MILESTONE.match(p.name)]
    assert named == [], "name a test file after the module or the behaviour it tests, not the issue that added it"


@pytest.mark.parametrize("name", ["grpc.server", "grpc.aio.server"])
def test_a_unit_test_that_starts_a_grpc_server_fails(name):
    start = {"grpc.server": lambda: grpc.server(None), "grpc.aio.server": lambda: grpc.aio.server()}[name]
    with pytest.raises(pytest.fail.Exception, match=rf"started a gRPC server \({name}\): unit tests start no server"):
        start()
