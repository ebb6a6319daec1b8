"""No service package imports another: what two services share lives in `flywheel.core`.

Service packages: engine, gateway, reward, teacher, trainer and ops (the operator's tools, which
start the services as processes and talk to them over HTTP, gRPC and Redis). `core` and the
generated `_proto` import no service package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import flywheel

PACKAGE = Path(flywheel.__file__).parent
SERVICES = {"engine", "gateway", "reward", "teacher", "trainer", "ops"}
SHARED = {"core", "_proto"}


def _owner(module: str) -> str | None:
    """`flywheel.<part>...` -> part; None for modules outside the project."""
    parts = module.split(".")
    return parts[1] if parts[0] == "flywheel" and len(parts) > 1 else None


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `source`, the source of dotted `module`; relative
    imports resolved, `from flywheel import x` read as `flywheel.x`, and
    `importlib.import_module("...")` calls with a constant name included."""
    out: list[tuple[int, str]] = []
    package = module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            out.append((node.lineno, base))
            if base == "flywheel" or not node.module:
                out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value))
    return out


def crossings(root: Path) -> list[str]:
    """`path:line: owner -> module` for every import from one service package (or core) into
    another service package, under the package directory `root` (named `flywheel`)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        module = ".".join(("flywheel", *rel.with_suffix("").parts))
        owner = rel.parts[0] if len(rel.parts) > 1 else None
        for line, target in imported_modules(path.read_text(), module):
            other = _owner(target)
            if other in SERVICES and other != owner:
                found.append(f"{rel}:{line}: {owner or 'flywheel'} -> {target}")
    return found


def test_no_service_imports_another():
    assert crossings(PACKAGE) == []


def test_every_top_level_part_is_a_service_or_shared():
    parts = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert parts <= SERVICES | SHARED, parts
    assert loose == [], f"modules beside the services: {loose}"


def test_a_planted_cross_service_import_is_found(tmp_path):
    root = tmp_path / "flywheel"
    for name, text in {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/shared.py": "import json\n",
        "gateway/__init__.py": "",
        "gateway/app.py": "from flywheel.core import shared\nfrom . import routes\n",
        "gateway/routes.py": "from ..trainer.step import train\n",
        "trainer/__init__.py": "",
        "trainer/step.py": "from flywheel import gateway\n",
        "teacher/__init__.py": "",
        "teacher/main.py": "import importlib\nimportlib.import_module('flywheel.reward.judge')\n",
        "reward/__init__.py": "",
        "reward/judge.py": "",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert crossings(root) == [
        "gateway/routes.py:1: gateway -> flywheel.trainer.step",
        "teacher/main.py:2: teacher -> flywheel.reward.judge",
        "trainer/step.py:1: trainer -> flywheel.gateway",
    ]
