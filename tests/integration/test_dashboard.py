"""The Grafana dashboard asks only for metrics a live worker really exports."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import running_worker
from worker.commands.localservers import free_port

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).parents[2] / "deploy/grafana/inference-worker.json"


def _cuda_only() -> set[str]:
    """What the device collector exports only when the process runs on CUDA: its names with
    a device, less its names without one (so a typo in the dashboard still fails)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from worker.health.metrics import DeviceCollector

    def names(memory) -> set[str]:
        registry = CollectorRegistry()
        registry.register(DeviceCollector(memory, lambda: 0))
        return _exported(generate_latest(registry).decode())

    return names(lambda: {"allocated": 1.0}) - names(dict)


def _exported(text: str) -> set[str]:
    """Every sample name /metrics shows (counters' _total, histograms' _bucket, ...)."""
    return {
        line.split("{")[0].split(" ")[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _queries() -> list[str]:
    def walk(panels):
        for panel in panels:
            yield from (target["expr"] for target in panel.get("targets", []))
            yield from walk(panel.get("panels", []))

    dashboard = json.loads(DASHBOARD.read_text())
    return [*walk(dashboard["panels"])]


async def test_every_dashboard_query_names_metrics_a_live_worker_exports(nats_server, settings_for):
    port = free_port()
    settings = settings_for(nats_server.url, metrics={"port": port, "host": "127.0.0.1"})
    async with running_worker(settings):
        exported = _exported(await asyncio.to_thread(_metrics, port))

    queries = _queries()
    named = {name for expr in queries for name in re.findall(r"\binference_worker_\w+", expr)}
    assert len(queries) >= 12 and len(named) >= 10
    assert _cuda_only() == {"inference_worker_device_memory_bytes"}
    assert named - exported - _cuda_only() == set()
    assert {"inference_worker_tasks_total", "inference_worker_stalled"} <= named


def test_the_dashboard_is_provisioning_ready():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables and dashboard["uid"] == "inference-worker"
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert any(row.get("repeat") == "instance" for row in rows), "one row per process"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
