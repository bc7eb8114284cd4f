"""The chaos suite under pytest: every fault, real servers, nothing lost, nothing doubled."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.suite import run_scenario, scenarios, table

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
NAMES = [scenario.name for scenario in scenarios(Path("unused"))]


@pytest.mark.parametrize("name", NAMES)
async def test_fault_mid_job_loses_and_doubles_nothing(name, tmp_path, s3_server, model_path):
    [scenario] = [s for s in scenarios(tmp_path) if s.name == name]
    row, leftovers = await run_scenario(scenario, tmp_path / name, s3_server, model_path)
    print("\n" + table([row]))
    assert row.lost == 0, row
    assert row.duplicates == 0, row
    assert row.stored == row.published
    assert row.error == (3 if scenario.bad else 0), "only the bad images end in error"
    assert leftovers == [], "every worker process and loader child is gone"
