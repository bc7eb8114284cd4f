"""Every WORKER_ name in the code is made by ``config.names.env_name`` from its field path:
none is spelt by hand outside docstrings, comments and the settings' own descriptions."""

from __future__ import annotations

import ast
from pathlib import Path

from config.names import env_name

ROOT = Path(__file__).parents[3]
PACKAGES = ("worker", "datasets", "pipelines", "config")
THE_RULE = ROOT / "config" / "names.py"


def _docstrings_and_descriptions(tree: ast.AST) -> set[int]:
    """ids of the string nodes that are documentation: docstrings and ``description=``."""
    allowed: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            allowed.add(id(body[0].value))
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg in ("description", "help"):
                    allowed.update(id(part) for part in ast.walk(keyword.value))
    return allowed


def spelt_by_hand(root: Path, packages: tuple[str, ...]) -> list[str]:
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path == THE_RULE:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            allowed = _docstrings_and_descriptions(tree)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and "WORKER_" in node.value
                    and id(node) not in allowed
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.value[:60]!r}")
    return found


def test_no_worker_name_is_spelt_by_hand_in_the_packages():
    assert spelt_by_hand(ROOT, PACKAGES) == []


def test_the_scan_finds_a_name_spelt_in_a_message_but_not_in_documentation(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        '"""Reads WORKER_A__B."""\n'
        "def f():\n"
        '    """WORKER_C."""\n'
        '    x = Field(1, description="see WORKER_D")\n'
        '    raise ValueError(f"WORKER_LOADER__TIMEOUT_S={x} is too short")\n'
    )
    found = spelt_by_hand(tmp_path, ("pkg",))
    assert len(found) == 1 and "WORKER_LOADER__TIMEOUT_S=" in found[0]


def test_a_name_is_the_prefix_and_the_field_path_in_capitals():
    assert env_name("loader", "timeout_s") == "WORKER_LOADER__TIMEOUT_S"
    assert env_name("log_level") == "WORKER_LOG_LEVEL"
