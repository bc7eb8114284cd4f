"""``inference-worker models fetch`` end to end: a built-in pipeline whose weights (and
labels.txt beside them) are served by a real HTTP server on 127.0.0.1; and ``check``'s
``model file:`` lines, which download nothing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from config.errors import ConfigError
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


@pytest.mark.parametrize("setting", ["FILES_MIRROR", "FILES_HOSTS"])
def test_run_and_check_refuse_a_plain_http_mirror_on_another_host_at_start(
    setting, monkeypatch, tmp_path, capsys
):
    """One rule for every command that loads models: a worker serving several pipelines
    (which loads none at start) refuses it at start too, before any task is taken."""
    from worker.commands.cli import main
    from worker.commands.localservers import free_port

    monkeypatch.chdir(tmp_path)  # no .env
    for name in [name for name in os.environ if name.startswith("WORKER_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("WORKER_MODEL__PIPELINES", "moth_binary,panama_moths_2024")
    monkeypatch.setenv(f"WORKER_MODEL__{setting}", "http://mirror.example.org/ami")
    monkeypatch.setenv("WORKER_MODEL__CACHE_DIR", str(tmp_path / "cache"))
    # Were it not refused, run would give up on a server that is not there.
    monkeypatch.setenv("WORKER_NATS__URL", f"nats://127.0.0.1:{free_port()}")
    refusal = (
        f"config error: WORKER_MODEL__{setting}='http://mirror.example.org/ami': plain "
        "http:// only to this host"
    )
    with pytest.raises(ConfigError, match=f"WORKER_MODEL__{setting}="):
        load_settings()
    for command in ("run", "check", "models"):
        argv = [command, "fetch"] if command == "models" else [command]
        assert main(argv) == 2, command
        assert capsys.readouterr().err.startswith(refusal), command
    monkeypatch.setenv(f"WORKER_MODEL__{setting}", "http://127.0.0.1:8080/ami")
    load_settings()  # this host's own mirror may be plain http://
    monkeypatch.setenv(f"WORKER_MODEL__{setting}", "https://mirror.example.org/ami")
    load_settings()
