"""A stage that times failures reports no rate: it stops the benchmark with a printed error."""

from __future__ import annotations

import pytest

from bench.outcomes import BenchmarkFailed, Outcomes, refusing


def test_failures_and_missing_images_are_refused_naming_the_stage():
    outcomes = Outcomes("loader alone")
    outcomes.good(3)
    outcomes.bad("load_failed", "AttributeError: 'int' object has no attribute 'encoded'")
    with pytest.raises(BenchmarkFailed, match=r"loader alone: 1 of 4 images failed.*encoded"):
        outcomes.check(4)
    short = Outcomes("model alone")
    short.good(15)
    with pytest.raises(BenchmarkFailed, match="15 images made, 16 asked for"):
        short.check(16)
    whole = Outcomes("worker")
    whole.good(16)
    whole.check(16)


def test_a_refused_benchmark_prints_one_error_line_and_exits_1(capsys):
    @refusing
    def main() -> None:
        Outcomes("loader alone").check(8)

    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 1
    assert capsys.readouterr().err.startswith("error: loader alone: 0 images made, 8 asked")


def test_the_loader_stage_refuses_a_run_in_which_an_image_failed():
    """The stage bench.throughput times, on two real images and one missing object."""
    from bench.common.stages import LoaderAlone, worker_plan
    from bench.common.world import upload, world

    with world() as w:
        uris = upload(w.s3.client(), "probe", [(640, 480)], 2)
        with LoaderAlone(w, worker_plan(w)) as loader:
            assert loader.seconds(uris) > 0
            with pytest.raises(BenchmarkFailed, match=r"1 of 3 images failed \(object_missing"):
                loader.seconds([*uris, "s3://probe/img/missing.jpg"])


def _answer(job: str, task: str, pipeline: str, sha: str, label: str) -> dict:
    detection = {"classifications": [{"classification": label, "scores": [1.0]}]}
    return {
        "task_id": task,
        "job_id": job,
        "status": "ok",
        "pipeline": pipeline,
        "model": {"name": pipeline, "weights_sha256": sha},
        "response": {"detections": [detection]},
    }


def test_bench_pipelines_refuses_a_job_answered_by_another_model_twice_or_not_at_all(tmp_path):
    """bench.pipelines counts a result only when it is its own pipeline's answer (name,
    weights sha256, labels), once per task; anything else stops the run."""
    from bench.common.job_runs import Job
    from bench.pipelines import Declared, check_job
    from worker.commands.job_client import make_tasks

    alpha = Declared("alpha", "alpha.toml", tmp_path / "model.pt", "a" * 64)
    uris = ["s3://b/img/1.jpg", "s3://b/img/2.jpg"]
    ids = [t.id for t in make_tasks("j", uris)]

    def job(*results: dict) -> Job:
        return Job("j", uris, "alpha", messages=len(uris), results=list(results))

    good = [_answer("j", i, "alpha", "a" * 64, "alpha-3") for i in ids]
    check_job(job(*good), alpha)
    cases = {
        "wrong_pipeline": job(good[0], _answer("j", ids[1], "beta", "a" * 64, "alpha-3")),
        "wrong_weights": job(good[0], _answer("j", ids[1], "alpha", "b" * 64, "alpha-3")),
        "wrong_labels": job(good[0], _answer("j", ids[1], "alpha", "a" * 64, "beta-3")),
        "duplicate": job(*good, good[1]),
        "1 images made, 2 asked for": job(good[0]),
        "error": job(good[0], {**good[1], "status": "error", "error": {"type": "error"}}),
    }
    for expected, case in cases.items():
        with pytest.raises(BenchmarkFailed, match=expected):
            check_job(case, alpha)
