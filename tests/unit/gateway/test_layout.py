"""The gateway's module layout (docs/architecture.md#gateway-layout): no import cycles between
its modules, no module but the entry point imports the app, no file of 600 lines or more.

Every import counts, wherever it is written: at module level, inside a function (a lazy
import only hides a cycle until that function runs) and under `if TYPE_CHECKING:` (a cycle of
type-only imports is still two modules that cannot be understood one without the other).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3] / "services"
PACKAGE = "flywheel.gateway"
MAX_LINES = 600


def module_name(path: Path, root: Path) -> str:
    """`flywheel/gateway/api/chat.py` -> `flywheel.gateway.api.chat`; a package's
    `__init__.py` is the package itself."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that `module`'s source imports, anywhere in it.

    `from a.b import c` names module `a.b.c` when that is a module, else `a.b` (c is a name
    in it); relative imports are resolved against `module` (its package when `is_package`).
    """
    out: set[str] = set()
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                source = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                out.add(candidate if candidate in known else source)
    return {name for name in out if name in known and name != module}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports, for every module of `package` under
    `root` (a source root such as `services/`)."""
    files = sorted((root / package.replace(".", "/")).rglob("*.py"))
    names = {module_name(f, root): f for f in files}
    known = set(names)
    return {
        name: imported(
            ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py", known
        )
        for name, path in names.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path `a -> b -> ... -> a`) per strongly connected component of more
    than one module, or of one module importing itself (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path(graph, set(c)) for c in components]


def _path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A cycle through the component's first module, staying inside the component."""
    start = min(component)
    parents = {start: ""}
    frontier = [start]
    while frontier:  # breadth first, so the cycle shown is a shortest one
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while parents[path[-1]]:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in component {sorted(component)}")


def test_gateway_modules_import_each_other_without_cycles():
    graph = import_graph(ROOT, PACKAGE)
    assert len(graph) > 40, sorted(graph)  # the walk found the package
    assert "flywheel.gateway.deps" in graph["flywheel.gateway.api.chat"]
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_only_the_entry_point_imports_the_app():
    graph = import_graph(ROOT, PACKAGE)
    importers = sorted(m for m, deps in graph.items() if f"{PACKAGE}.app" in deps)
    assert importers == [f"{PACKAGE}.main"]


def test_gateway_files_stay_under_600_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / PACKAGE.replace(".", "/")).rglob("*.py"))
        if (n := len(path.read_text(encoding="utf-8").splitlines())) >= MAX_LINES
    }
    assert not long, long


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {
        "flywheel/__init__.py": "",
        "flywheel/gateway/__init__.py": "",
        **files,
    }.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "back",
    [
        "from flywheel.gateway.app import create_app\n",
        "def f():\n    from flywheel.gateway import app\n",  # lazy
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..app import Deps\n",
    ],
    ids=["module-level", "in-a-function", "type-only-relative"],
)
def test_a_planted_cycle_is_found_and_shown(tmp_path, back):
    root = _package(
        tmp_path,
        {
            "flywheel/gateway/app.py": "from flywheel.gateway.api import chat\n",
            "flywheel/gateway/api/__init__.py": "",
            "flywheel/gateway/api/chat.py": "import json\nfrom flywheel.gateway.api import turn\n",
            "flywheel/gateway/api/turn.py": back,
            "flywheel/gateway/deps.py": "from flywheel.gateway.api.chat import x\n",
        },
    )
    graph = import_graph(root, PACKAGE)
    assert graph["flywheel.gateway.deps"] == {"flywheel.gateway.api.chat"}
    assert cycles(graph) == [
        [
            "flywheel.gateway.api.chat",
            "flywheel.gateway.api.turn",
            "flywheel.gateway.app",
            "flywheel.gateway.api.chat",
        ]
    ]


def test_a_layout_without_a_cycle_passes(tmp_path):
    root = _package(
        tmp_path,
        {
            "flywheel/gateway/app.py": "from flywheel.gateway.api import chat\n",
            "flywheel/gateway/api/__init__.py": "",
            "flywheel/gateway/api/chat.py": "from flywheel.gateway.deps import Deps\n",
            "flywheel/gateway/deps.py": "from flywheel.gateway import engines\n",
            "flywheel/gateway/engines.py": "",
        },
    )
    assert cycles(import_graph(root, PACKAGE)) == []
