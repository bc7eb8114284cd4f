"""``inference-worker models fetch`` end to end: a built-in pipeline whose weights (and
labels.txt beside them) are served by a real HTTP server on 127.0.0.1; and ``check``'s
``model file:`` lines, which download nothing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from config.settings import load_settings
from tests.served_files import Served
from worker.commands.model_files import pin_lines

ROOT = Path(__file__).parents[3]


def _env(weights: str, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env.update(
        PYTHONPATH=str(ROOT),
        WORKER_MODEL__PIPELINE="mobilenet-v3-small-classifier",
        WORKER_MODEL__WEIGHTS=weights,
        WORKER_MODEL__CACHE_DIR=str(cache),
    )
    return env


def _fetch(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker", "models", "fetch"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


def test_models_fetch_fills_the_cache_once_and_says_how_each_file_is_pinned(
    served: Served, tmp_path
):
    (served.root / "model.pt").write_bytes(b"not really weights")
    (served.root / "labels.txt").write_text("moth\n")
    sha = hashlib.sha256(b"not really weights").hexdigest()
    env = _env(served.url("model.pt"), tmp_path / "cache")

    first = _fetch(env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[0] == (
        f"{served.url('model.pt')} 18 bytes sha256 {sha} recorded (downloaded)"
    )
    assert "labels.txt 5 bytes" in first.stdout.splitlines()[1]

    served.stop()  # offline: a second fetch (a start) needs nothing from the network
    second = _fetch(env)
    assert second.returncode == 0, second.stderr
    assert second.stdout.count("recorded (cached)") == 2
    assert served.gets == 2


def test_models_fetch_exits_2_naming_a_refused_file(served: Served, tmp_path):
    (served.root / "model.pt").write_bytes(b"weights")
    (served.root / "labels.txt").write_text("moth\n")
    env = _env(served.url("model.pt"), tmp_path / "cache")
    first = _fetch(env)
    assert first.returncode == 0, first.stderr
    (tmp_path / "cache" / next(p.name for p in (tmp_path / "cache").glob("*-model.pt"))).unlink()
    (served.root / "model.pt").write_bytes(b"other weights")
    refused = _fetch(env)
    assert refused.returncode == 2
    assert "not fetched: " + served.url("model.pt") in refused.stderr
    assert "changed since its first download" in refused.stderr


def test_check_says_how_each_file_is_pinned_without_downloading(served: Served, tmp_path):
    (served.root / "model.pt").write_bytes(b"weights")
    settings = load_settings(
        for_worker=False,
        model={
            "pipeline": "mobilenet-v3-small-classifier",
            "weights": served.url("model.pt"),
            "cache_dir": str(tmp_path / "cache"),
        },
    )
    assert pin_lines(settings) == [
        f"model file: {served.url('model.pt')} recorded, not cached",
        f"model file: {served.url('labels.txt')} recorded, not cached",
    ]
    assert served.gets == 0


def test_check_says_a_plain_http_mirror_elsewhere_is_refused(tmp_path):
    settings = load_settings(
        for_worker=False,
        model={
            "pipeline": "moth_binary",
            "files_mirror": "http://mirror.example.org/ami",
            "cache_dir": str(tmp_path / "cache"),
        },
    )
    lines = pin_lines(settings)
    assert len(lines) == 3  # the detector's weights, the classifier's weights and map
    for line in lines:
        assert line.startswith("model file: http://mirror.example.org/ami/moths/")
        assert "refused: " in line and "use https://" in line
