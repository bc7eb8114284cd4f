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
    """The stage bench.stages times, on two real images and one missing object."""
    from bench.common import upload, world
    from bench.throughput import LoaderAlone, worker_plan

    with world() as w:
        uris = upload(w.s3.client(), "probe", [(640, 480)], 2)
        with LoaderAlone(w, worker_plan(w)) as loader:
            assert loader.seconds(uris) > 0
            with pytest.raises(BenchmarkFailed, match=r"1 of 3 images failed \(object_missing"):
                loader.seconds([*uris, "s3://probe/img/missing.jpg"])
