"""The core speaks tasks, not NATS messages: no module of the core imports ``nats``,
``worker.nats`` or ``worker.antenna``, directly or through another core module (a
function-local import counts). The core is every module of ``worker/`` but the sources' rooms
(``worker/nats/``, ``worker/antenna/``), the commands (``worker/commands/``) and the wiring
that picks a source and assembles the process (``worker/process/``,
``worker/__main__.py``); ``config``, ``datasets`` and ``pipelines``,
which the core builds on, are held to the same rule."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = ("worker.nats", "worker.antenna", "worker.commands")
WIRING = {
    "worker.process.pick_source",
    "worker.process.app",
    "worker.process.serve",
    "worker.__main__",
}
FORBIDDEN = ("nats", "worker.nats", "worker.antenna")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, name: str) -> set[str]:
    """Every module ``path`` imports, anywhere in it, as absolute names (``from a import b``
    counts as ``a`` and ``a.b``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def is_forbidden(target: str) -> bool:
    return any(target == f or target.startswith(f + ".") for f in FORBIDDEN)


def core_modules() -> dict[str, set[str]]:
    modules: dict[str, set[str]] = {}
    for package in ("worker", "config", "datasets", "pipelines"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = module_name(path)
            if name in WIRING or any(name == o or name.startswith(o + ".") for o in OUTSIDE):
                continue
            modules[name] = imported(path, name)
    return modules


def violations(modules: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each core module that reaches a forbidden import, with the way there."""

    def way(name: str, seen: frozenset[str]) -> list[str] | None:
        for target in sorted(modules[name]):
            if is_forbidden(target):
                return [name, target]
            if target in modules and target not in seen:
                rest = way(target, seen | {target})
                if rest is not None:
                    return [name, *rest]
        return None

    found = {name: way(name, frozenset({name})) for name in modules}
    return {name: path for name, path in found.items() if path is not None}


def test_no_core_module_imports_a_source_directly_or_through_another() -> None:
    modules = core_modules()
    assert len(modules) > 40, "the core was not found"
    assert violations(modules) == {}


def test_the_check_sees_an_import_made_through_another_core_module() -> None:
    modules = {
        "worker.a": {"worker.b"},
        "worker.b": {"worker.c"},
        "worker.c": {"nats.js"},
        "worker.d": {"config.settings"},
    }
    assert violations(modules) == {
        "worker.a": ["worker.a", "worker.b", "worker.c", "nats.js"],
        "worker.b": ["worker.b", "worker.c", "nats.js"],
        "worker.c": ["worker.c", "nats.js"],
    }
