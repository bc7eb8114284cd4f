"""The alert rules, unit-tested with promtool (Debian's `prometheus` package)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import IN_CI

ROOT = Path(__file__).parents[2]


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = "promtool not found: apt-get install prometheus"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
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
