"""The alert rules, unit-tested with promtool (Debian's `prometheus` package)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.conftest import _unavailable

ROOT = Path(__file__).parents[3]


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


DASHBOARD = ROOT / "deploy/grafana/inference-worker.json"
MIB = 1048576
GPU_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
GPU_B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
# inference_worker_device_info of three processes, as a scrape stores them (empty labels are
# absent): a whole GPU, a MIG slice (GPU instance 3) of another, and the CPU.
WORKERS = {
    "w1": {"device": "cuda:0", "UUID": GPU_A, "name": "NVIDIA A100-SXM4-40GB"},
    "w2": {
        "device": "cuda:0",
        "UUID": GPU_B,
        "GPU_I_ID": "3",
        "mig_uuid": "MIG-b3b3b3b3-1111-2222-3333-444444444444",
        "name": "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
    },
    "w4": {"device": "cpu", "name": "cpu"},
}
# dcgm-exporter's series for those GPUs, its labels as it writes them: (metric, GPU, GPU
# instance or None for the whole GPU, value).
DCGM = [
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", GPU_A, None, 0.5),
    ("DCGM_FI_DEV_GPU_UTIL", GPU_A, None, 90),
    ("DCGM_FI_DEV_FB_USED", GPU_A, None, 1000),
    ("DCGM_FI_DEV_FB_FREE", GPU_A, None, 39000),
    ("DCGM_FI_DEV_XID_ERRORS", GPU_A, None, 0),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", GPU_B, "3", 0.25),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", GPU_B, "5", 0.75),
    ("DCGM_FI_DEV_FB_USED", GPU_B, "3", 2000),
    ("DCGM_FI_DEV_FB_FREE", GPU_B, "3", 3000),
    ("DCGM_FI_DEV_FB_USED", GPU_B, "5", 4000),
    ("DCGM_FI_DEV_FB_USED", GPU_B, None, 6000),
    ("DCGM_FI_DEV_XID_ERRORS", GPU_B, None, 48),
]
# Each dcgm query of the dashboard, by panel and target: what it shows per process.
EXPECTED = {
    ("Device busy, per process (dcgm)", "A"): {"w1": 0.5, "w2": 0.25},
    ("Device busy, per process (dcgm)", "B"): {"w1": 0.9},
    ("Framebuffer used, per process (dcgm)", "A"): {"w1": 1000 * MIB, "w2": 2000 * MIB},
    ("Framebuffer used, per process (dcgm)", "B"): {"w1": 40000 * MIB, "w2": 5000 * MIB},
    ("Last Xid on the process's GPU (dcgm)", "A"): {"w1": 0, "w2": 48},
}


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _dcgm_labels(uuid: str, instance: str | None) -> dict[str, str]:
    labels = {"job": "dcgm", "instance": "h1:9400", "gpu": "0" if uuid == GPU_A else "1"}
    labels |= {"UUID": uuid, "device": "nvidia0", "modelName": "NVIDIA A100-SXM4-40GB"}
    if instance is not None:
        labels |= {"GPU_I_PROFILE": "1g.5gb", "GPU_I_ID": instance}
    return labels | {"Hostname": "h1"}


def _dcgm_queries() -> dict[tuple[str, str], str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {
        (panel["title"], target["refId"]): target["expr"]
        for panel in panels
        for target in panel.get("targets", [])
        if "DCGM_" in target["expr"]
    }


def test_the_dashboards_dcgm_panels_show_each_process_its_own_gpu_or_mig_slice(tmp_path):
    """promtool evaluates the dashboard's own queries over dcgm-exporter's series and three
    processes' device_info: each GPU process gets its GPU's (or its slice's) value, the CPU
    process none, the other slice's values never."""
    tool = promtool()
    queries = _dcgm_queries()
    assert set(queries) == set(EXPECTED), "every dcgm query of the dashboard has its case"
    info = "inference_worker_device_info"
    base = {"job": "inference-worker"}
    series = [
        {"series": _series(info, base | {"instance": w} | labels), "values": "1x5"}
        for w, labels in WORKERS.items()
    ] + [
        {"series": _series(name, _dcgm_labels(uuid, gi)), "values": f"{value}x5"}
        for name, uuid, gi, value in DCGM
    ]
    tests = [
        {
            "expr": expr.replace("$instance", ".*"),
            "eval_time": "5m",
            "exp_samples": [
                {"labels": _series("", base | {"instance": w} | WORKERS[w]), "value": value}
                for w, value in EXPECTED[key].items()
            ],
        }
        for key, expr in queries.items()
    ]
    plan = {"rule_files": [], "tests": [{"interval": "1m", "input_series": series}]}
    plan["tests"][0]["promql_expr_test"] = tests
    (tmp_path / "dashboard_test.yml").write_text(json.dumps(plan))  # JSON is YAML

    done = subprocess.run(
        [tool, "test", "rules", str(tmp_path / "dashboard_test.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}{done.stderr}"


def _docs_keda_query() -> str:
    """The Prometheus query of docs/metrics.md's KEDA recipe (its one ``query:`` line)."""
    readme = (ROOT / "docs" / "metrics.md").read_text()
    recipe = readme[readme.index("**Autoscaling.**") :]
    recipe = recipe[: recipe.index("```\n", recipe.index("```yaml") + 7)]
    lines = [line.strip() for line in recipe.splitlines() if line.strip().startswith("query:")]
    assert len(lines) == 1, "the recipe has one query"
    return lines[0].removeprefix("query:").strip()


def test_the_docs_keda_query_counts_a_multi_pipeline_fleets_shared_backlog(tmp_path):
    """A fleet serving moths and orders: each process exports its job consumers' counts under
    each pipeline and the shared consumer's under ``moths,orders``. The recipe's query for
    ``moths`` takes both (once, not once per process), and nothing of another pipeline whose
    name merely contains ``moths``."""
    evaluates_keda_query(_docs_keda_query(), "moths", tmp_path)


def evaluates_keda_query(query: str, pipeline: str, tmp_path: Path) -> None:
    """promtool evaluates ``query`` (a KEDA trigger's, for ``pipeline``) over a fleet serving
    ``pipeline`` and ``orders``, and another fleet's pipelines whose names contain it: 130."""
    tool = promtool()
    waiting = "inference_worker_tasks_waiting"
    # (process, pipeline label, tasks waiting): p2's reads lag p1's by one sweep.
    counts = [
        ("p1", pipeline, 100),
        ("p1", "orders", 7),
        ("p1", f"{pipeline},orders", 30),
        ("p2", pipeline, 90),
        ("p2", "orders", 7),
        ("p2", f"{pipeline},orders", 30),
        ("p3", f"big-{pipeline}", 999),  # another fleet's pipeline
        ("p3", f"big-{pipeline},{pipeline}-x", 999),
    ]
    series = [
        {
            "series": _series(waiting, {"job": "inference-worker", "instance": p, "pipeline": pl}),
            "values": f"{n}x5",
        }
        for p, pl, n in counts
    ]
    test = {"expr": query, "eval_time": "5m", "exp_samples": [{"labels": "{}", "value": 130}]}
    plan = {"rule_files": [], "tests": [{"interval": "1m", "input_series": series}]}
    plan["tests"][0]["promql_expr_test"] = [test]
    (tmp_path / "keda_test.yml").write_text(json.dumps(plan))  # JSON is YAML

    done = subprocess.run(
        [tool, "test", "rules", str(tmp_path / "keda_test.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout}{done.stderr}"
