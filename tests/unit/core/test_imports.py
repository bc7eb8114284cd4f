"""The core speaks tasks, not NATS messages, and its port no broker verb.

No module of the core imports ``nats``, ``worker.nats`` or ``worker.antenna``, directly or
through another core module (a function-local import counts). The core here is every module of
``worker/`` but the sources' rooms (``worker/nats/``, ``worker/antenna/``), the commands
(``worker/commands/``) and the process's assembly (``worker/process/``, ``worker/__main__.py``);
``config``, ``datasets`` and ``pipelines``, which the core builds on, are held to the same rule.
The core room itself (``worker/core/``) imports no assembly or command either, and only the
commands import the assembly."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
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


def is_forbidden(target: str, forbidden: tuple[str, ...] = FORBIDDEN) -> bool:
    return any(target == f or target.startswith(f + ".") for f in forbidden)


def core_modules() -> dict[str, set[str]]:
    modules: dict[str, set[str]] = {}
    for package in ("worker", "config", "datasets", "pipelines"):
        for path in sorted((ROOT / package).rglob("*.py")):
            name = module_name(path)
            if name in WIRING or any(name == o or name.startswith(o + ".") for o in OUTSIDE):
                continue
            modules[name] = imported(path, name)
    return modules


def violations(
    modules: dict[str, set[str]], forbidden: tuple[str, ...] = FORBIDDEN
) -> dict[str, list[str]]:
    """Each module that reaches a forbidden import, with the way there."""

    def way(name: str, seen: frozenset[str]) -> list[str] | None:
        for target in sorted(modules[name]):
            if is_forbidden(target, forbidden):
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


def test_the_core_room_imports_no_source_no_nats_and_nothing_of_the_assembly() -> None:
    """``worker/core/`` builds on ``config``, ``pipelines``' typed findings and
    ``worker.health``, never on what is built around it: a source's room, ``nats``, the engine
    (it builds on the core's values and the core reaches it through the ``BatchEngine`` port),
    the process's assembly (``worker/process/``) or the commands."""
    modules = core_modules()
    core = {name: targets for name, targets in modules.items() if name.startswith("worker.core")}
    assert len(core) >= 10, "the core room was not found"
    outward = (
        "nats",
        "worker.nats",
        "worker.antenna",
        "worker.engine",
        "worker.process",
        "worker.commands",
    )
    found = violations(modules, outward)
    assert {name: way for name, way in found.items() if name in core} == {}


def test_nothing_but_the_commands_imports_the_assembly() -> None:
    """Dependencies point inward: the sources, the engine and the health layer are built by
    the assembly (``worker/process/``), never the other way round."""
    inward = [
        name
        for package in ("worker", "config", "datasets", "pipelines")
        for path in sorted((ROOT / package).rglob("*.py"))
        if not (name := module_name(path)).startswith(("worker.process", "worker.commands"))
        and name != "worker.__main__"
        and any(is_forbidden(target, ("worker.process",)) for target in imported(path, name))
    ]
    assert inward == []


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


BROKER_VERBS = {"ack", "nak", "term", "in_progress"}


def names_in(source: str) -> set[str]:
    """Every name a module defines or reads: functions, methods, classes, fields, attributes,
    variables and arguments."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
    return found


def test_the_port_names_no_broker_verb() -> None:
    """The core's port speaks tasks, verdicts and results: no ``ack``, ``nak``, ``term`` or
    ``in_progress`` (NATS's verbs), in the port or anywhere in the core."""
    core = sorted((ROOT / "worker" / "core").glob("*.py"))
    assert ROOT / "worker" / "core" / "ports.py" in core
    spoken = {path.name: names_in(path.read_text()) & BROKER_VERBS for path in core}
    assert {name: verbs for name, verbs in spoken.items() if verbs} == {}


def test_the_verb_check_sees_a_verb_on_a_protocol() -> None:
    port = "class Delivery(Protocol):\n    async def nak(self, delay_s: float) -> None: ...\n"
    assert names_in(port) & BROKER_VERBS == {"nak"}
    assert names_in("async def settle(d):\n    await d.msg.ack()\n") & BROKER_VERBS == {"ack"}


def direct_imports(room: str) -> dict[str, set[str]]:
    """Every module of ``room`` (a dotted package) and what it imports."""
    folder = ROOT.joinpath(*room.split("."))
    return {
        (name := module_name(path)): imported(path, name) for path in sorted(folder.rglob("*.py"))
    }


@pytest.mark.parametrize(
    ("room", "never"),
    [
        ("config", ("worker", "datasets", "pipelines")),
        ("datasets", ("worker", "nats")),
        ("pipelines", ("worker", "nats")),
        ("worker.engine", ("nats", "worker.nats", "worker.antenna", "worker.process")),
        ("worker.health", ("nats", "worker.nats", "worker.antenna", "worker.process")),
        ("worker.nats", ("worker.antenna", "worker.process", "worker.commands")),
        ("worker.antenna", ("nats", "worker.nats", "worker.process", "worker.commands")),
        ("worker.process", ("worker.commands",)),
    ],
)
def test_each_room_imports_only_inward(room: str, never: tuple[str, ...]) -> None:
    """docs/architecture.md, "What may import what", as a test."""
    found = {
        name: sorted(t for t in targets if is_forbidden(t, never))
        for name, targets in direct_imports(room).items()
    }
    assert {name: bad for name, bad in found.items() if bad} == {}


def test_the_core_room_reads_its_slice_of_the_settings_not_the_settings() -> None:
    """``worker/core/`` takes what it uses (``ports.CoreSettings``, built once by the
    assembly, and explicit arguments): neither the settings model nor the functions over it."""
    whole = ("config.settings", "config.derived", "config.cross_checks")
    found = {
        name: sorted(t for t in targets if is_forbidden(t, whole))
        for name, targets in direct_imports("worker.core").items()
    }
    assert {name: bad for name, bad in found.items() if bad} == {}
