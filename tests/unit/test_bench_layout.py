"""bench/ as one tool (bench/README.md): the package `tokenloop.bench`, read from its import statements. No path set up by
hand, nothing from tests/, no import circle (no `_private` name of another module: tests/unit/test_layers.py); every
module is a benchmark that `tokenloop-bench` lists (with `main(argv)`) or one of the harness's support modules."""

from __future__ import annotations

import ast
import importlib

import pytest

from tests.conftest import ROOT
from tokenloop.bench.__main__ import BENCHMARKS, SUPPORT, listing, main

BENCH = ROOT / "bench"
MODULES = sorted(p for p in BENCH.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))


def imports(path) -> list[tuple[str, str]]:
    """(module, name) of every `from MODULE import NAME` in `path`, and (module, "") of every `import MODULE`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            out += [(node.module or "", alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            out += [(alias.name, "") for alias in node.names]
    return out


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_path_hack_and_nothing_from_tests(path):
    text = path.read_text()
    assert "sys.path" not in text and "noqa: E402" not in text
    assert [m for m, _ in imports(path) if m == "tests" or m.startswith(("tests.", "bench."))] == []


def test_no_import_circle_among_the_benchmarks():
    edges = {p.stem: {m.removeprefix("tokenloop.bench.") for m, _ in imports(p) if m.startswith("tokenloop.bench.")}
             | {n for m, n in imports(p) if m == "tokenloop.bench"} for p in MODULES}

    def reaches(start: str, target: str, seen: set) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in edges.get(start, ()))
    assert [m for m in edges if reaches(m, m, set())] == []


def test_every_module_is_a_listed_benchmark_or_a_support_module():
    listed = {b.module for b in BENCHMARKS.values()}
    assert sorted(p.stem for p in MODULES if p.stem not in listed | set(SUPPORT) | {"figures"}) == []
    for name, bench in BENCHMARKS.items():
        module = importlib.import_module(f"tokenloop.bench.{bench.module}")
        assert callable(module.main), name
        assert bench.results == "" or (BENCH / bench.results).suffix == ".json", name


def test_the_runner_lists_every_benchmark_and_refuses_an_unknown_one(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out == listing() + "\n" and all(f"\n{name} " in out for name in BENCHMARKS)
    assert main(["nonesuch"]) == 2
    assert "unknown benchmark 'nonesuch'" in capsys.readouterr().err
    assert main(["smoke", "nonesuch"]) == 2
