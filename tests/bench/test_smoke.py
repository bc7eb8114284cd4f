"""Each benchmark's smoke mode still runs and its stages still make what they time.

A benchmark broken by a change (the loader stage once timed AttributeErrors for weeks) fails
here. The smoke runs are tiny and assert outcomes, never speed: the rates they print mean
nothing. Results go to a temporary BENCH_RESULTS_DIR, never over bench/results/.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
# Each smoke is its own test, one benchmark at a time per test process: 10-60 s each on a quiet
# 2-core machine, so 300 s is five times the longest; pytest-timeout's bound is above it, so
# the error that comes is this module's, naming the benchmark it waited for.
SMOKE_TIMEOUT_S = 300
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SMOKE_TIMEOUT_S + 60)]


@dataclass(frozen=True)
class Smoke:
    module: str
    returncode: int
    stdout: str
    stderr: str
    results: Path


def run_smoke(module: str, results: Path, *args: str) -> Smoke:
    """``python -m bench.MODULE --smoke``, its results in ``results``; a run past
    ``SMOKE_TIMEOUT_S`` is ended with everything it started (its process group) and fails
    the test naming the benchmark and what it had written to stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env["BENCH_RESULTS_DIR"] = str(results)
    command = [sys.executable, "-m", f"bench.{module}", "--smoke", *args]
    with subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=SMOKE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate(timeout=30)
            pytest.fail(
                f"bench.{module} --smoke did not finish within {SMOKE_TIMEOUT_S} s "
                f"(ended with its process group); its stderr ends:\n{stderr[-3000:]}"
            )
    return Smoke(module, proc.returncode, stdout, stderr, results)


def saved(run: Smoke, name: str = "") -> dict[str, Any]:
    """The results a smoke run saved; the test fails with its output if it exited non-zero."""
    assert run.returncode == 0, f"bench.{run.module} exited {run.returncode}:\n{run.stderr[-3000:]}"
    result: dict[str, Any] = json.loads((run.results / f"{name or run.module}.json").read_text())
    return result


def test_throughput_times_images_in_every_stage(tmp_path):
    """The loader stage by each path, the model and the worker made every image (the loader
    children's CPU was counted), and one-image jobs were timed."""
    result = saved(run_smoke("throughput", tmp_path))
    for path in ("default", "fast", "exact"):
        assert result["loader_alone"][path]["children_cpu_ms_per_image"] > 0
    assert result["end_to_end"]["tree_cpu_ms_per_image"] > 0
    assert result["end_to_end"]["per_job_overhead_s"] >= 0
    assert result["model_alone_images_per_s"] > 0


def test_network_loader_ami_and_worker_cases_load_every_image(tmp_path):
    cases = saved(run_smoke("network", tmp_path))["sets"]["1080p"]
    assert cases["loader_shaped_8_reads"]["failures"] == 0
    assert cases["ami_shaped_8_threads"]["images_per_s"] > 0
    assert cases["worker_shaped"]["images_per_s"] > 0


def test_soak_checks_every_result(tmp_path):
    result = saved(run_smoke("soak", tmp_path))
    assert result["outcomes"] == {"ok": 40, "failed": {}}
    assert result["summary"]["loader_pids_constant"]


def test_preprocess_compares_each_path_with_the_reference(tmp_path):
    done = run_smoke("preprocess", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{\n") :])
    (case,) = report["cases"]
    assert case["default"]["mean_pixel_diff"] <= report["tolerance"]["mean_pixel_diff_at_most"]
    assert {"default", "fast"} <= set(case)


def test_workload_runs_detect_and_classify_every_way(tmp_path):
    result = saved(run_smoke("workload", tmp_path))
    assert result["end_to_end"]["peak_rss_bytes"] > 0
    assert result["ami_pattern"]["crops_classified"] > 0
    assert result["ratio_end_to_end_to_slower_stage"] > 0


def test_pipelines_runs_every_case_and_checks_every_answer(tmp_path):
    """bench.pipelines: the model switch, two pipelines interleaved, fair share off and on,
    models under a budget; each result was its own pipeline's answer (a failed check exits 1
    without figures)."""
    result = saved(run_smoke("pipelines", tmp_path))
    switch = result["switch"]
    assert switch["same_sha256"] and switch["s3_equals_disk_logits"]
    assert result["interleaved"]["models_loaded_ample_budget"] == 2
    assert result["interleaved"]["budget_fits_one"]["model_loads"] >= 1
    assert set(result["fairness"]) >= {"off", "on"}
    memory = result["memory"]
    assert memory["fits_2"]["peak_models_resident"] == 2 and memory["fits_2"]["evictions"] > 0
    assert memory["fits_3"]["peak_models_resident"] == 3 and memory["fits_3"]["evictions"] == 0
    assert memory["answers_compared"]["labels_differ"] == 0


def test_antenna_wan_serves_every_task_through_antenna_and_nats_shaped_and_direct(tmp_path):
    result = saved(run_smoke("antenna_wan", tmp_path, "--rtt-ms", "20"))
    for source in ("antenna", "nats"):
        direct, shaped = result[source]["cases"]
        assert (direct["rtt_ms"], shaped["rtt_ms"]) == (0, 20)
        assert direct["tasks"] == shaped["tasks"] == 40 and direct["tls"]
        assert direct["tasks_per_s"] > 0 and shaped["tasks_per_s"] > 0
        # Kept alive: fewer image connections than images, however the reads were spread.
        assert shaped["image_connections_per_task"] < 1


def test_many_jobs_answers_every_one_task_job_and_deletes_their_consumers(tmp_path):
    """bench.many_jobs: every job's task ``ok`` (it exits 1 otherwise), job consumers made and
    none refused, and none left once the jobs are done (the shared and the new-jobs consumer
    stay). It once stalled here, its consumer sampler's cancel swallowed by Python 3.11's
    ``asyncio.wait_for`` inside a nats-py request (``bench/common/sampling.py``)."""
    result = saved(run_smoke("many_jobs", tmp_path))
    assert result["jobs"] == 20
    assert result["consumers_made"] > 0 and result["consumers_refused"] == 0
    assert result["consumers_after"] <= 2


def test_listing_counts_the_idle_fleets_listings_and_serves_each_new_job(tmp_path):
    """bench.listing: the listings, the server's bytes and CPU were measured, and each new
    job's first task was fetched (it exits 1 otherwise)."""
    result = saved(run_smoke("listing", tmp_path))
    assert result["listings_per_s"] > 0 and result["server_out_bytes_per_s"] > 0
    assert result["one_listing_bytes"] > 0
    assert len(result["first_task_s"]["each"]) == 2


def test_ami_saves_every_image_of_an_ami_job_once_with_its_boxes_classified(tmp_path):
    """bench.ami: quebec_vermont_moths_2023 from random weights in ADC's layouts, a 4K and a
    1080p image through the fake Antenna; it exits 1 unless each was saved once with boxes,
    each classified."""
    result = saved(run_smoke("ami", tmp_path))
    assert result["images"] == 2 and result["outcomes"] == {"ok": 2, "failed": {}}
    assert result["pipeline"] == "quebec_vermont_moths_2023"


def test_ami_stages_times_every_stage_of_every_image(tmp_path):
    """bench.ami_stages: one image through quebec_vermont_moths_2023's stages, each timed; it
    exits 1 unless the image's boxes were each classified."""
    result = saved(run_smoke("ami_stages", tmp_path))
    (run,) = result["runs"]
    assert run["outcomes"] == {"ok": 1, "failed": {}}
    assert {"decode", "backbone", "rpn", "roi heads", "crops", "filter"} <= set(run["stages"])
