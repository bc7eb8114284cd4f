"""The forward pass's threads at start: every core a process may use for a detector's
pipeline, the cores the loader children leave for a classifier's, the setting when given; the
cores read from the CPU affinity and the cgroup's quota."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from config.derived import torch_threads
from config.settings import load_settings
from worker.engine.cores import available_cores, cgroup_quota


def test_a_detectors_pipeline_gets_every_core_at_the_defaults() -> None:
    s = load_settings()  # 2 loader children

    assert torch_threads(s, 2, detecting=True)[0] == 2
    assert torch_threads(s, 16, detecting=True)[0] == 16


def test_a_classifiers_pipeline_leaves_the_loader_children_their_cores() -> None:
    s = load_settings()

    assert torch_threads(s, 2, detecting=False)[0] == 1
    assert torch_threads(s, 8, detecting=False)[0] == 6


def test_the_setting_wins_over_the_plan() -> None:
    s = load_settings(model={"torch_threads": 3})

    assert torch_threads(s, 2, detecting=True) == (3, "set")


def _write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_a_cgroup_v2_quota_of_one_and_a_half_cpus_counts_as_two(tmp_path: Path) -> None:
    _write(tmp_path, "cpu.max", "150000 100000")

    assert cgroup_quota(tmp_path) == 1.5
    assert available_cores(tmp_path) == min(2, len(os.sched_getaffinity(0)))


def test_a_cgroup_v1_quota_is_read_and_no_quota_is_none(tmp_path: Path) -> None:
    _write(tmp_path, "cpu/cpu.cfs_quota_us", "100000")
    _write(tmp_path, "cpu/cpu.cfs_period_us", "100000")
    assert cgroup_quota(tmp_path) == 1.0
    assert available_cores(tmp_path) == 1

    _write(tmp_path, "cpu/cpu.cfs_quota_us", "-1")
    assert cgroup_quota(tmp_path) is None


@pytest.mark.parametrize("text", ["max 100000", "max"])
def test_an_unlimited_cgroup_v2_leaves_the_affinity(tmp_path: Path, text: str) -> None:
    _write(tmp_path, "cpu.max", text)

    assert cgroup_quota(tmp_path) is None
    assert available_cores(tmp_path) == len(os.sched_getaffinity(0))


def test_a_gpu_hosts_detector_leaves_the_loader_children_their_cores() -> None:
    s = load_settings(model={"device": "cuda:0"})  # the forward pass runs on the device

    assert torch_threads(s, 16, detecting=True) == (14, "the cores the loader children leave")
