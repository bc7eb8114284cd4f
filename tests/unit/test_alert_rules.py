"""The alert rules, unit-tested with promtool (Debian's `prometheus` package)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.conftest import _unavailable

ROOT = Path(__file__).parents[2]


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        _unavailable("promtool", FileNotFoundError("not on PATH: apt-get install prometheus"))
    assert found is not None
    return found


def test_alert_rules_are_valid_and_fire_as_their_tests_say():
    tool = promtool()
    for command, path in (
        ("check", "deploy/prometheus/alerts.yml"),
        ("test", "tests/prometheus/alerts_test.yml"),
    ):
        done = subprocess.run(
            [tool, command, "rules", str(ROOT / path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"promtool {command} rules {path}:\n{done.stdout}{done.stderr}"
