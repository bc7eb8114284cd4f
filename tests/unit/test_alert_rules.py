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
    check = subprocess.run(
        [tool, "check", "rules", str(ROOT / "deploy/prometheus/alerts.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    tested = subprocess.run(
        [tool, "test", "rules", str(ROOT / "tests/prometheus/alerts_test.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
