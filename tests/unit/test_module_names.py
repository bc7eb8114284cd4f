"""One name, one thing: no two modules that ship or measure share a file name, except the ones
that play the same part in each room that has one (a task source's ``source``, ``settle``,
``parts``, ``render``, ``waiting`` and ``source_metrics``; a room's chaos ``faults``)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = ("worker", "config", "datasets", "pipelines", "bench", "testing")
SOURCES = {"worker/nats", "worker/antenna"}
SAME_PART = {
    "source.py": SOURCES,
    "settle.py": SOURCES,
    "parts.py": SOURCES,
    "render.py": SOURCES,
    "waiting.py": SOURCES,
    "source_metrics.py": SOURCES,
    "faults.py": {"worker/nats", "worker/engine", "datasets", "config"},
    "__init__.py": None,  # a package's
    "__main__.py": None,  # a runnable package's
}


def shared_names(root: Path) -> dict[str, set[str]]:
    """Each file name used in more than one folder, with those folders."""
    folders: dict[str, set[str]] = defaultdict(set)
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            folders[path.name].add(str(path.parent.relative_to(root)))
    return {name: where for name, where in folders.items() if len(where) > 1}


def collisions(shared: dict[str, set[str]]) -> dict[str, set[str]]:
    """The shared names that are not the same part in each room."""
    found = {}
    for name, where in shared.items():
        allowed = SAME_PART.get(name, set())
        if name in SAME_PART and (allowed is None or where <= allowed):
            continue
        found[name] = where
    return found


def test_every_module_name_says_one_thing_in_the_tree() -> None:
    assert collisions(shared_names(ROOT)) == {}


def test_the_check_sees_a_name_shared_outside_its_rooms() -> None:
    shared = {
        "rules.py": {"config", "worker/core"},
        "settle.py": {"worker/nats", "worker/antenna"},
        "source.py": {"worker/nats", "datasets"},
    }
    assert collisions(shared) == {
        "rules.py": {"config", "worker/core"},
        "source.py": {"worker/nats", "datasets"},
    }
