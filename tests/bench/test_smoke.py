"""Each benchmark's smoke mode still runs and its stages still make what they time.

A benchmark broken by a change (the loader stage once timed AttributeErrors for weeks) fails
here. The smoke runs are tiny and assert outcomes, never speed: the rates they print mean
nothing. Results go to a temporary BENCH_RESULTS_DIR, never over bench/results/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
SMOKE_TIMEOUT_S = 240
# Longest first; two at a time: most of a smoke run is one core starting processes.
MODULES = ("workload", "throughput", "network", "profile", "scale", "soak", "recovery")


@dataclass(frozen=True)
class Smoke:
    module: str
    returncode: int
    stdout: str
    stderr: str
    results: Path


def run_smoke(module: str, results: Path) -> Smoke:
    """``python -m bench.MODULE --smoke``, its results in ``results``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env["BENCH_RESULTS_DIR"] = str(results)
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    return Smoke(module, done.returncode, done.stdout, done.stderr, results)


@pytest.fixture(scope="module")
def smokes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Smoke]:
    """Every benchmark's smoke run, two at a time."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            module: pool.submit(run_smoke, module, tmp_path_factory.mktemp(module))
            for module in MODULES
        }
        return {module: future.result() for module, future in futures.items()}


def saved(smokes: dict[str, Smoke], module: str, name: str = "") -> dict[str, Any]:
    """The results a smoke run saved; the test fails with its output if it exited non-zero."""
    run = smokes[module]
    assert run.returncode == 0, f"bench.{module} exited {run.returncode}:\n{run.stderr[-3000:]}"
    result: dict[str, Any] = json.loads((run.results / f"{name or module}.json").read_text())
    return result


def test_throughput_times_images_in_every_stage(smokes):
    """The loader stage by each path, the model and the worker made every image (the loader
    children's CPU was counted), and the pattern classified every image."""
    result = saved(smokes, "throughput")
    for path in ("default", "fast", "exact"):
        assert result["loader_alone"][path]["children_cpu_ms_per_image"] > 0
    assert result["end_to_end"]["tree_cpu_ms_per_image"] > 0
    assert result["end_to_end"]["per_job_overhead_s"] >= 0
    assert set(result["patterns"]) == {"fork_rebuilt"}


def test_scale_runs_two_workers_on_one_consumer(smokes):
    assert saved(smokes, "scale")["two_processes_one_loader_worker_each"] > 0


def test_network_loader_ami_and_worker_cases_load_every_image(smokes):
    cases = saved(smokes, "network")["sets"]["1080p"]
    assert cases["loader_shaped_8_reads"]["failures"] == 0
    assert cases["ami_shaped_8_threads"]["images_per_s"] > 0
    assert cases["worker_shaped"]["images_per_s"] > 0


def test_soak_checks_every_result(smokes):
    result = saved(smokes, "soak")
    assert result["outcomes"] == {"ok": 40, "failed": {}}
    assert result["summary"]["loader_pids_constant"]


def test_profile_samples_the_worker(smokes):
    run = smokes["profile"]
    assert run.returncode == 0, run.stderr[-3000:]
    assert "samples" in (run.results / "profile.txt").read_text()


def test_recovery_leaves_no_child_alive(smokes):
    assert saved(smokes, "recovery")["ours"]["children_left_alive"] == [0]


def test_preprocess_compares_each_path_with_the_reference():
    done = subprocess.run(
        [sys.executable, "-m", "bench.preprocess", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{\n") :])
    (case,) = report["cases"]
    assert case["default"]["mean_pixel_diff"] <= report["tolerance"]["mean_pixel_diff_at_most"]
    assert {"default", "fast"} <= set(case)


def test_workload_runs_detect_and_classify_every_way(smokes):
    result = saved(smokes, "workload")
    assert result["end_to_end"]["peak_rss_bytes"] > 0
    assert result["ami_pattern"]["crops_classified"] > 0
    assert result["ratio_end_to_end_to_slower_stage"] > 0


def test_bench_stages_runs_the_throughput_stages():
    """bench.stages is bench.throughput's stages (which the smoke above runs), no copy."""
    from bench import stages, throughput

    assert stages.stages is throughput.stages


def test_pipelines_runs_every_case_and_checks_every_answer(tmp_path):
    """bench.pipelines alone (its own workers, not two at a time with the others): the model
    switch, two pipelines interleaved, fair share off and on, models under a budget; each
    result was its own pipeline's answer (a failed check exits 1 without figures)."""
    run = run_smoke("pipelines", tmp_path)
    assert run.returncode == 0, f"bench.pipelines exited {run.returncode}:\n{run.stderr[-3000:]}"
    result = json.loads((tmp_path / "pipelines.json").read_text())
    switch = result["switch"]
    assert switch["same_sha256"] and switch["s3_equals_disk_logits"]
    assert result["interleaved"]["models_loaded_ample_budget"] == 2
    assert result["interleaved"]["budget_fits_one"]["model_loads"] >= 1
    assert set(result["fairness"]) >= {"off", "on"}
    memory = result["memory"]
    assert memory["fits_2"]["peak_models_resident"] == 2 and memory["fits_2"]["evictions"] > 0
    assert memory["fits_3"]["peak_models_resident"] == 3 and memory["fits_3"]["evictions"] == 0
    assert memory["answers_compared"]["labels_differ"] == 0
