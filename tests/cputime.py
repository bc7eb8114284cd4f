"""Per-test wall and CPU time, reported at the end like --durations.

CPU is the test process's own time plus that of its reaped children (getrusage RUSAGE_SELF +
RUSAGE_CHILDREN deltas over setup, call and teardown); a child still running when the test
ends (a session's nats-server) is not counted. Each runner measures its own tests; the report
rides on the teardown report's user_properties, so it works under xdist too.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Generator
from typing import Any

import pytest

_START = pytest.StashKey[tuple[float, float]]()
_ROWS: list[tuple[float, float, str]] = []
_TIMELINE: list[str] = []  # runner, start (epoch s), wall, cpu, test: for TEST_CPU_REPORT
SHOWN = 25


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Generator[None, Any, Any]:
    item.stash[_START] = (time.monotonic(), _cpu_s())
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "teardown" and _START in item.stash:
        wall_start, cpu_start = item.stash[_START]
        report.user_properties.append(("wall_s", time.monotonic() - wall_start))
        report.user_properties.append(("cpu_s", _cpu_s() - cpu_start))
        report.user_properties.append(("ended_at", time.time()))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "teardown":
        return
    props = dict(report.user_properties)
    if "wall_s" in props:
        _ROWS.append((float(props["cpu_s"]), float(props["wall_s"]), report.nodeid))
        runner = getattr(getattr(report, "node", None), "gateway", None)
        _TIMELINE.append(
            f"{getattr(runner, 'id', 'main')}\t{props['ended_at']:.1f}\t{props['wall_s']:.2f}"
            f"\t{props['cpu_s']:.2f}\t{report.nodeid}\n"
        )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _ROWS:
        return
    cpu_total = sum(row[0] for row in _ROWS)
    wall_total = sum(row[1] for row in _ROWS)
    write = terminalreporter.write_line
    terminalreporter.section(f"cpu time: the {SHOWN} dearest tests (setup+call+teardown)")
    write(f"all {len(_ROWS)} tests: {cpu_total:.1f} s CPU in {wall_total:.1f} s of runner time")
    for cpu_s, wall_s, nodeid in sorted(_ROWS, reverse=True)[:SHOWN]:
        write(f"{cpu_s:8.1f}s cpu {wall_s:8.1f}s wall  {nodeid}")
    every = os.environ.get("TEST_CPU_REPORT")  # a path: every test in the order they ended
    if every and not hasattr(terminalreporter.config, "workerinput"):  # xdist's controller
        with open(every, "w", encoding="utf-8") as out:
            out.writelines(_TIMELINE)
