"""The layout's rules hold: every room of `workers/` keeps to its imports (each room's `ruff.toml`,
checked here on planted imports so that a rule that stopped applying fails), no import circle
(function-level imports included), no `_private` name taken from another module, no test module
importing another."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The installed import name of each source folder.
PACKAGES = {"pipeline": "threadline.pipeline", "workers": "threadline.workers"}


def _ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("ruff is not installed in this environment (pip install '.[test]' installs it)")
    return [found]


def _lint(path: str, source: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_ruff(), "check", "--no-cache", "--select", "TID", "--stdin-filename", path, "-"],
                          input=source, capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize(("path", "source"), [
    ("workers/protocol/planted.py", "from threadline.workers.storage import lua\n"),
    ("workers/protocol/planted.py", "import dramatiq\n"),
    ("workers/storage/planted.py", "from threadline.workers.worker.runtime import Runtime\n"),
    ("workers/clients/planted.py", "from threadline.workers.worker.process import Supervisor\n"),
    ("workers/clients/planted.py", "import dramatiq\n"),
    ("workers/gateway/planted.py", "from threadline.workers.worker.broker import DoorbellBroker\n"),
    ("workers/gateway/planted.py", "from threadline.workers.cli.common import connect\n"),
    ("workers/cli/planted.py", "def f():\n    from threadline.workers.worker.process import Supervisor\n"),
    ("workers/worker/planted.py", "from threadline.workers.clients.client import Client\n"),
    ("workers/worker/middleware/planted.py", "from threadline.workers.gateway.app import create_app\n"),
    ("workers/telemetry/planted.py", "from threadline.workers.storage.store import Store\n"),
    ("workers/operations/planted.py", "from threadline.workers.worker.actors import declare_actors\n"),
    ("pipeline/planted.py", "import redis\n"),
    ("workers/worker/planted.py", "from ..storage import lua\n"),
])
def test_the_lint_refuses_a_planted_forbidden_import(path: str, source: str) -> None:
    result = _lint(path, source)
    assert result.returncode == 1 and ("TID251" in result.stdout or "TID252" in result.stdout), result.stdout


@pytest.mark.parametrize(("path", "source"), [
    ("workers/cli/serve.py", "def f():\n    from threadline.workers.worker.process import Supervisor\n"),
    ("workers/worker/planted.py", "from threadline.workers.storage.store import Store\n"),
    ("workers/gateway/planted.py", "from threadline.workers.clients.client import Client\n"),
])
def test_the_lint_lets_an_allowed_import_pass(path: str, source: str) -> None:
    result = _lint(path, source)
    assert result.returncode == 0, result.stdout


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts[:-1])) if parts[-1] == "__init__" else ".".join((package, *parts))
            found[name] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> Iterator[tuple[str, str, int]]:
    """(module imported, name imported or "", line) for every import in the file, at any depth."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, "", node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:  # `from package import module`
                    yield f"{base}.{alias.name}", "", node.lineno
                else:
                    yield base, alias.name, node.lineno


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m, _, _ in _imports(path, name, modules) if m in modules and m != name}
            for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_function_level_imports_included() -> None:
    assert _circles(_graph()) == []


def test_the_circle_check_sees_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_is_imported_from_another_module() -> None:
    modules = _modules()
    private = [f"{path.relative_to(ROOT)}:{line} takes {imported}.{what}"
               for name, path in modules.items() for imported, what, line in _imports(path, name, modules)
               if imported.startswith("threadline.") and what.startswith("_") and not what.startswith("__")]
    assert private == []


def test_no_test_module_imports_another() -> None:
    offenders = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.startswith("tests.") and n.rpartition(".")[2].startswith("test_")]
    assert offenders == []
