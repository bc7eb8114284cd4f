"""The chaos suite under pytest: every fault, real servers, the fault seen to happen, nothing
lost, no task completed twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.suite import run_scenario, scenarios, table

pytestmark = [
    pytest.mark.integration,
    pytest.mark.chaos,
    pytest.mark.slow,
    pytest.mark.timeout(300),
]
NAMES = [scenario.name for scenario in scenarios(Path("unused"))]


@pytest.mark.parametrize("name", NAMES)
async def test_a_fault_mid_job_is_seen_and_loses_nothing_and_completes_no_task_twice(
    name, tmp_path, s3_server, model_path
):
    [scenario] = [s for s in scenarios(tmp_path) if s.name == name]
    row, leftovers = await run_scenario(scenario, tmp_path / name, s3_server, model_path)
    print("\n" + table([row]))
    assert row.unshown == [], "the fault's evidence was not seen"
    assert row.lost == 0, row
    assert row.duplicates == 0, "a task completed twice (its result found already stored)"
    assert row.stored == row.published
    assert row.error == (3 if scenario.bad else 0), "only the bad images end in error"
    assert leftovers == [], "every worker process and loader child is gone"
