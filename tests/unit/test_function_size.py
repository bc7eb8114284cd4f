"""Functions short enough to read at once (STYLE, habit 9): none over 50 lines in the
installed packages and the benchmarks, counted from its first decorator or ``def`` to its
last line."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGES = ("worker", "datasets", "pipelines", "config", "bench")
MAX_LINES = 50


def long_functions(root: Path, packages: tuple[str, ...], max_lines: int) -> list[str]:
    """``path:line name (N lines)`` for every function or method over ``max_lines``, nested
    ones included."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - start + 1
                if lines > max_lines:
                    where = path.relative_to(root)
                    found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_the_packages_is_over_50_lines():
    assert long_functions(ROOT, PACKAGES, MAX_LINES) == []


def test_the_scan_finds_long_functions_methods_and_nested_ones_and_nothing_shorter(tmp_path):
    package = tmp_path / "pkg" / "sub"
    package.mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(49))
    (package / "m.py").write_text(
        f"def fifty():\n{body}\n\n"  # def + 49 lines: exactly the limit
        f"def fifty_one():\n{body}\n    return x0\n\n"
        "class C:\n"
        "    @staticmethod\n"
        f"    def decorated():\n{body.replace('    ', '        ')}\n\n"
        "async def outer():\n"
        f"    def inner():\n{body.replace('    ', '        ')}\n        return x0\n"
    )
    found = long_functions(tmp_path, ("pkg",), MAX_LINES)
    names = sorted(line.split()[1] for line in found)
    assert names == ["decorated", "fifty_one", "inner", "outer"]
