"""The GPU kit's rules that need no network and no GPU (bench/gpukit): what is carried and
what is not, one version of each, the size the device tool carries, the report read from
pytest's JUnit XML, the pipeline declared to the worker, and the sections' processes ended."""

from __future__ import annotations

import ast
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from bench.gpukit import machine
from bench.gpukit.gather import (
    KIT_EXTRAS,
    GatherFailed,
    Resolved,
    check_size,
    check_wheels,
    requirement_name,
    requirements,
    split,
)
from bench.gpukit.run import FIGURES, Clock, Options, child, cuda_test_files, install, junit

REPO = Path(__file__).parents[3]


def _resolved(name: str, version: str = "1.0") -> Resolved:
    return Resolved(machine.canonical(name), version, f"https://example.invalid/{name}.whl")


def test_what_the_machine_has_is_left_out_and_torch_and_cuda_are_never_carried():
    plan = split(
        _resolved(name)
        for name in ("nats-py", "PyYAML", "torch", "nvidia-cudnn-cu13", "triton", "Flask_Cors")
    )
    assert [r.name for r in plan.carry] == ["nats-py", "flask-cors"]
    assert [r.name for r in plan.on_machine] == ["pyyaml"]
    assert [r.name for r in plan.never] == ["torch", "nvidia-cudnn-cu13", "triton"]


def test_a_package_resolved_at_two_versions_is_refused():
    with pytest.raises(GatherFailed, match="resolved twice"):
        split([_resolved("boto3", "1.0"), _resolved("boto3", "2.0")])


def test_the_wheels_must_be_one_per_package_and_exactly_the_resolution():
    carry = [_resolved("nats-py", "2.16.0"), _resolved("pydantic-core", "2.50.5")]
    wheels = ["nats_py-2.16.0-py3-none-any.whl", "pydantic_core-2.50.5-cp312-cp312-x.whl"]
    check_wheels(wheels, carry)
    with pytest.raises(GatherFailed, match="more than one wheel"):
        check_wheels([*wheels, "nats_py-2.15.0-py3-none-any.whl"], carry)
    with pytest.raises(GatherFailed, match="has or must keep"):
        check_wheels([*wheels, "pillow-13.0.0-cp312-cp312-x.whl"], carry)
    with pytest.raises(GatherFailed, match=r"lacking \['pydantic-core'\]"):
        check_wheels(wheels[:1], carry)


def test_a_kit_over_what_the_device_tool_carries_fails_saying_by_how_much():
    check_size(40 * 2**20, 2 * 2**20)
    with pytest.raises(GatherFailed, match=r"2\.0 MiB over the 64 MiB"):
        check_size(63 * 2**20, 3 * 2**20)


def test_the_requirements_are_the_projects_less_torch_and_the_kits_from_the_dev_extra():
    wanted = requirements(REPO / "pyproject.toml")
    names = [requirement_name(spec) for spec in wanted]
    assert "nats-py" in names and "pydantic-settings" in names
    assert not any(machine.never_carried(name) for name in names)
    assert names[-len(KIT_EXTRAS) :] == list(KIT_EXTRAS)
    assert "moto[server]" in "".join(wanted).replace(" ", "")


_JUNIT = """<testsuites><testsuite>
<testcase classname="tests.unit.pipelines.test_device" name="test_a_real_cuda_out_of_memory_x">
 <properties><property name="out_of_memory_splits" value="7"/>
 <property name="cpu_s" value="0.1"/><property name="wall_s" value="2.5"/></properties>
</testcase>
<testcase classname="tests.unit.pipelines.test_device" name="test_nvjpeg_decodes_y">
 <properties><property name="wall_s" value="0.1"/></properties><failure message="boom"/>
</testcase>
<testcase classname="tests.unit.pipelines.test_device" name="test_copies_z">
 <properties><property name="wall_s" value="0.0"/></properties>
 <skipped message="needs CUDA"/></testcase>
</testsuite></testsuites>"""


def test_the_report_counts_the_tests_and_keeps_what_the_ones_that_ran_recorded():
    read = junit(_JUNIT)
    counts = {k: read[k] for k in ("passed", "failed", "errors", "skipped")}
    assert counts == {"passed": 1, "failed": 1, "errors": 0, "skipped": 1}
    assert read["failures"] == ["tests.unit.pipelines.test_device::test_nvjpeg_decodes_y"]
    assert read["skips"] == {"needs CUDA": 1}
    assert read["recorded"] == {
        "test_a_real_cuda_out_of_memory_x": {"out_of_memory_splits": 7, "wall_s": 2.5},
        "test_nvjpeg_decodes_y": {"wall_s": 0.1},
    }


def test_every_figure_the_report_lifts_out_names_a_cuda_test_the_kit_collects():
    assert "tests/unit/pipelines/test_device.py" in cuda_test_files(REPO)
    tree = ast.parse((REPO / "tests/unit/pipelines/test_device.py").read_text())
    cuda_tests = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("cuda" in ast.unparse(d) for d in node.decorator_list)
    ]
    for prefix in FIGURES.values():
        assert [name for name in cuda_tests if name.startswith(prefix)], prefix


def test_the_pipeline_is_declared_to_the_worker_as_it_is_in_bench_gpu():
    from bench.gpukit.worker_run import as_toml
    from pipelines.declare import Classifier, Detector, Pipeline, Preprocess
    from pipelines.registry import from_toml

    detector = Detector("det", architecture="fasterrcnn_resnet50_fpn", weights="/w/det/model.pt")
    pipeline = Pipeline(
        "moths",
        detector=replace(detector, labels=None, score_threshold=0.0, max_detections=30),
        filter=Classifier(
            "bin", architecture="resnet50", weights="/w/bin.pt", keep=("moth",), labels=("moth",)
        ),
        classifier=Classifier(
            "sp", architecture="resnet50", weights="/w/sp.pt", preprocess=Preprocess(128)
        ),
    )
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpukit-{os.getpid()}.toml"
    path.write_text(as_toml(pipeline))
    try:
        declared = from_toml(path)
    finally:
        path.unlink()
    # Labels left to the weights are named: the labels.txt beside them, which None stands for.
    assert declared == replace(
        pipeline,
        detector=replace(pipeline.detector, labels="/w/det/labels.txt"),  # type: ignore[type-var]
        classifier=replace(pipeline.classifier, labels="/w/labels.txt"),  # type: ignore[type-var]
    )


_SPAWNS = (
    "import subprocess, sys, time\n"
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n"
)


@pytest.mark.parametrize(("sleep_s", "exit_code"), [(120.0, None), (0.0, 0)])
def test_a_section_is_stopped_at_its_timeout_and_nothing_it_started_outlives_it(
    tmp_path, sleep_s, exit_code
):
    out = tmp_path / "out"
    done = child(
        [sys.executable, "-c", _SPAWNS, str(sleep_s)], dict(os.environ), 5.0, tmp_path / "log", out
    )
    assert done["exit_code"] == exit_code
    assert ("error" in done) == (exit_code is None)
    grandchild = int(out.read_text().split()[0])
    deadline = time.monotonic() + 30
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the section's own child was ended with it"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_kit_gathered_for_another_python_is_refused_before_anything_is_installed(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"python_version": "3.99"}))
    site = tmp_path / "site"
    options = Options(REPO, tmp_path, site, "cpu", True, 60.0, ())
    done = install(options, tmp_path, Clock(60.0))
    assert "gathered for Python 3.99" in done["error"] and "make gpu-kit" in done["error"]
    assert not site.exists()


def test_typing_extensions_and_werkzeug_are_carried_though_the_machine_has_them():
    """pydantic 2.14 needs typing_extensions 4.16 and flask 3.1 werkzeug 3.1: the machine's own,
    of an unknown release, may be older, and the kit's copy comes first on PYTHONPATH."""
    plan = split(_resolved(name) for name in ("typing_extensions", "Werkzeug", "numpy"))
    assert [r.name for r in plan.carry] == ["typing-extensions", "werkzeug"]
    assert [r.name for r in plan.on_machine] == ["numpy"]
    check_wheels(["typing_extensions-4.16.0-py3-none-any.whl"], [_resolved("typing-extensions")])


def test_on_cuda_a_cuda_test_that_skipped_fails_the_tests_section():
    from bench.gpukit.run import section_ok

    ran = {"exit_code": 0, "passed": 4, "failed": 0, "errors": 0, "skipped": 0}
    skipped = {**ran, "passed": 3, "skipped": 1}
    assert section_ok("tests", ran, "cuda") and section_ok("tests", skipped, "cpu")
    assert not section_ok("tests", skipped, "cuda"), "a figure is missing"
    assert not section_ok("tests", {**ran, "failed": 1}, "cuda")


def test_the_machines_own_versions_are_reported_where_they_differ(tmp_path):
    from bench.gpukit.run import machine_differs

    pytest_version = __import__("importlib.metadata").metadata.version("pytest")
    listed = tmp_path / "on-machine.txt"
    listed.write_text(f"pytest=={pytest_version}\npsutil==0.0.1\nno-such-package-here==1.0\n")
    assert machine_differs(listed) == {
        "psutil": f"{psutil.__version__} (resolved with 0.0.1)",
        "no-such-package-here": "missing (resolved with 1.0)",
    }


def test_the_worker_runs_rates_are_withheld_unless_every_task_ended_ok_and_it_exited_0():
    from bench.gpukit.worker_run import checked

    ran = {"tasks": 4, "ok": 4, "errors_by_kind": {}, "worker_exit_code": 0}
    rated = {**ran, "images_per_s": 2.5, "images_per_s_from_start": 0.4}
    assert checked(rated) == rated

    failed = checked({**rated, "ok": 3, "errors_by_kind": {"inference_failed": 1}})
    assert (failed["images_per_s"], failed["images_per_s_from_start"]) == (None, None)
    assert failed["rate_withheld"] == "3 of 4 tasks ok: {'inference_failed': 1}"
    assert checked({**rated, "worker_exit_code": 7})["rate_withheld"] == "the worker exited 7"
    stopped = checked({**rated, "worker_exit_code": None})
    assert stopped["rate_withheld"] == "the worker was stopped" and stopped["ok"] == 4
