"""The package layers (CONTRIBUTING.md, "Layers"): read from the import statements of every module.

`core/` imports no other tokenloop package; `looper/` and each executor package (`engine/`, `trtllm/`) import only
`core/` (and `tokenloop.v1`, the generated contract); in `service/` only `service/executors.py` imports an executor
package; no module imports a `_private` name from another package, nor (in the packages, the client and bench/)
from another module; tests import `tokenloop.*`, never a folder name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "looper", "engine", "trtllm", "service")
EXECUTORS = {"engine", "trtllm"}
ALLOWED = {"core": {"v1"}, "looper": {"core", "v1"}, "engine": {"core", "v1"}, "trtllm": {"core", "v1"},
           "service": {"core", "looper", "engine", "trtllm", "v1"}}
BUILDS_EXECUTORS = "service/executors.py"  # the one place that builds the configured executor


def imports(path: Path, package: str) -> list[tuple[str, list[str], int]]:
    """(tokenloop subpackage, names imported, line) of each import of another tokenloop module in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from . import x` stays in the package; `from ..core.x` leaves it
                parts = (node.module or "").split(".")
                target = package if node.level == 1 else parts[0]
                if node.level == 1 and not node.module:
                    target = package
                module_parts = [target] + (parts[1:] if node.level > 1 else parts)
            elif node.module and node.module.startswith("tokenloop."):
                module_parts = node.module.split(".")[1:]
                target = module_parts[0]
            else:
                continue
            names = [alias.name for alias in node.names]
            if len(module_parts) == 1 and target != package:  # `from tokenloop.core import request`: modules
                names = [n for n in names if not (ROOT / target / f"{n}.py").exists()]
            out.append((target, names, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tokenloop."):
                    out.append((alias.name.split(".")[1], [], node.lineno))
    return out


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_the_layers_below_it(package):
    bad = [f"{path.relative_to(ROOT)}:{line} imports tokenloop.{target}"
           for path in modules(package) for target, _, line in imports(path, package)
           if target != package and target not in ALLOWED[package]]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_private_name_is_imported_from_another_package(package):
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name} from tokenloop.{target}"
           for path in modules(package) for target, names, line in imports(path, package)
           if target != package for name in names if name.startswith("_")]
    assert not bad, "\n".join(bad)


def test_one_module_of_the_service_builds_the_executor():
    importers = {str(path.relative_to(ROOT)) for path in modules("service")
                 for target, _, _ in imports(path, "service") if target in EXECUTORS}
    assert importers == {BUILDS_EXECUTORS}


def test_the_checks_see_imports():
    """The rules above read real imports: the looper imports core, the builder imports both executors."""
    looper = {t for p in modules("looper") for t, _, _ in imports(p, "looper")}
    server = {t for t, _, _ in imports(ROOT / BUILDS_EXECUTORS, "service")}
    assert "core" in looper and {"engine", "trtllm"} <= server


def private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """`from M import _name` statements of `path` that take a `_private` name from another module. A private module
    of the importer's own package (`from . import _request`, `from ._gen import x`) is that package's own business:
    the underscore on a module means "this package only"."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            name = alias.name
            if not name.startswith("_") or name.startswith("__"):
                continue
            own_module = node.level == 1 and not node.module and (path.parent / f"{name}.py").exists()
            if not own_module:
                bad.append(f"{path.relative_to(root)}:{node.lineno} imports {name} from "
                           f"{'.' * node.level}{node.module or ''}")
    return bad


SHARING = (*PACKAGES, "bench", "clients/python/tokenloop_client")  # the code that must share by publishing


def test_no_private_name_is_imported_from_another_module():
    """CONTRIBUTING.md, "Layers": a helper two modules need is public in the module that owns it."""
    bad = [line for folder in SHARING for path in sorted((ROOT / folder).rglob("*.py"))
           if "_gen" not in path.parts for line in private_imports(path)]
    assert not bad, "\n".join(bad)


def test_tests_import_no_private_name_of_tokenloop_or_of_another_test_module():
    """The fake tensorrt_llm's own private modules and names (`tensorrt_llm._fake`) are that package's business."""
    bad = [line for path in sorted((ROOT / "tests").rglob("*.py")) if "fakes" not in path.parts
           for line in private_imports(path) if " from tokenloop." in line or " from tests." in line]
    assert not bad, "\n".join(bad)


FOLDERS = {"core", "looper", "engine", "trtllm", "service", "bench"}  # folders that are packages only under tokenloop.*


def test_tests_import_packages_by_their_tokenloop_name():
    """`from service.cli import x` in a test would load a second copy of tokenloop.service.cli (another module
    object, other globals): tests import `tokenloop.*` only."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert not bad, "\n".join(bad)


def test_the_sharing_checks_see_what_they_refuse(tmp_path):
    """The check above reads real statements: a private name from another module fails, a private module of the
    importer's own package does not."""
    (tmp_path / "_own.py").write_text("")
    probe = tmp_path / "probe.py"
    probe.write_text("from . import _own\nfrom .other import _helper\nfrom tokenloop.x import public, _y\n")
    assert private_imports(probe, tmp_path) == ["probe.py:2 imports _helper from .other",
                                                "probe.py:3 imports _y from tokenloop.x"]


def import_style(path: Path, package: str, root: Path = ROOT) -> list[str]:
    """Imports of `path` (a module of `package`) that break the one import style: another tokenloop package by its
    full name (`from tokenloop.core.request import ...`), a module of the own package relatively (`from .sequence
    import ...`); so never `from ..core` and never `from tokenloop.<own package>`."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level > 1:
            bad.append(f"{path.relative_to(root)}:{node.lineno} imports {'.' * node.level}{node.module or ''}")
        own = f"tokenloop.{package}"
        names = ([node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        bad += [f"{path.relative_to(root)}:{node.lineno} imports {n}" for n in names if n == own or
                n.startswith(own + ".")]
    return bad


@pytest.mark.parametrize("package", PACKAGES)
def test_one_import_style(package):
    """CONTRIBUTING.md, "Layers": another package as `tokenloop.<package>`, the own package relatively."""
    bad = [line for path in modules(package) if "_gen" not in path.parts for line in import_style(path, package)]
    assert not bad, "\n".join(bad)


def test_the_import_style_check_sees_both_styles(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from ..core.request import POOLINGS\nfrom tokenloop.engine.sequence import Sequence\n"
                     "import tokenloop.engine\nfrom tokenloop.core.request import ValidRequest\n"
                     "from .sequence import Sequence\n")
    assert import_style(probe, "engine", tmp_path) == ["probe.py:1 imports ..core.request",
                                                       "probe.py:2 imports tokenloop.engine.sequence",
                                                       "probe.py:3 imports tokenloop.engine"]


MAX_LINES = 400  # CONTRIBUTING.md, "Layers": a longer module is split by responsibility


def long_modules(root: Path = ROOT) -> list[str]:
    return [f"{path.relative_to(root)} has {n} lines" for package in PACKAGES
            for path in sorted((root / package).rglob("*.py")) if "_gen" not in path.parts
            if (n := len(path.read_text().splitlines())) > MAX_LINES]


def test_no_module_of_the_packages_is_over_400_lines(tmp_path):
    assert not long_modules(), "\n".join(long_modules())
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert long_modules(tmp_path) == ["engine/long.py has 401 lines"]


NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}  # public API despite the underscore
# (file, name) pairs still using another module's private name: none left (issue 42); a new one is published instead
KNOWN_PRIVATE_USES: set[tuple[str, str]] = set()


def private_names(paths) -> set[str]:
    """The `_private` names `paths` define: functions, classes, attributes and variables they assign."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = (node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    else node.attr if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    else node.id if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) else "")
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def private_uses(path: Path, tokenloop_private: set[str], root: Path = ROOT) -> list[tuple[str, str, int]]:
    """(file, name, line) of each `x._name` in `path` (not `self.` / `cls.`) where tokenloop defines `_name`."""
    rel = str(path.relative_to(root))
    return [(rel, node.attr, node.lineno) for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Attribute) and node.attr in tokenloop_private - NAMEDTUPLE_API
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def test_tests_and_bench_use_no_private_name_of_tokenloop():
    """CONTRIBUTING.md, "Layers": tests and benchmarks reach tokenloop through public names (`engine.apply()`, not
    `engine._admit(engine._new)`). The fake tensorrt_llm (tests/fakes) mirrors that package's own private names."""
    ours = private_names(path for package in PACKAGES for path in modules(package) if "_gen" not in path.parts)
    found = [use for folder in ("tests", "bench") for path in sorted((ROOT / folder).rglob("*.py"))
             if "fakes" not in path.parts for use in private_uses(path, ours)]
    bad = [f"{file}:{line} uses {name}" for file, name, line in found if (file, name) not in KNOWN_PRIVATE_USES]
    assert not bad, "\n".join(bad)
    assert {(file, name) for file, name, _ in found} == KNOWN_PRIVATE_USES  # one published: drop it from the list


def test_the_private_use_check_sees_attribute_access(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("engine._admit(engine._new)\nself._new = 1\nengine.apply()\nrow._replace(a=1)\n")
    assert private_uses(probe, {"_admit", "_new", "_replace"}, tmp_path) == [
        ("probe.py", "_admit", 1), ("probe.py", "_new", 1)]
