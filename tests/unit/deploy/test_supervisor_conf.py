"""The supervisord example rendered by supervisor's own parser for 16 processes over 8 GPUs
and 14 over 7 MIG slices: every process its name, its metrics port (the same rule healthwatch
probes), its device, and a named unprivileged user."""

from __future__ import annotations

import getpass
import shutil
import sys
from pathlib import Path

import pytest

from config.derived import metrics_port
from config.settings import load_settings
from pipelines.device import visibility
from worker.commands.healthwatch import process_port

DEPLOY = Path(__file__).parents[3] / "deploy" / "supervisor"
GPUS = [f"cuda:{i}" for i in range(8)]
MIGS = [f"MIG-{i}a3e7c5e-0c4f-5b5e-9d2f-1b6a2f7d9c0{i}" for i in range(7)]


def render(tmp_path: Path, monkeypatch, numprocs: int, devices: list[str]):
    from supervisor.options import ServerOptions

    for name in ("supervisord.conf", "inference-worker.conf"):
        shutil.copy(DEPLOY / name, tmp_path / name)
    for key, value in {
        "IW_BIN": str(Path(sys.executable).parent),
        "IW_RUN_DIR": str(tmp_path),
        "IW_ENV_FILE": str(tmp_path),
        "IW_NUMPROCS": str(numprocs),
        "IW_DEVICES": ",".join(devices),
        "IW_USER": getpass.getuser(),
        "IW_METRICS_PORT_BASE": "9460",
    }.items():
        monkeypatch.setenv(key, value)
    options = ServerOptions()
    options.realize(args=["-c", str(tmp_path / "supervisord.conf")])
    (group,) = [g for g in options.process_group_configs if g.name == "inference-worker"]
    (listener,) = [g for g in options.process_group_configs if g.name != "inference-worker"]
    return group.process_configs, listener.process_configs[0]


@pytest.mark.parametrize(
    ("numprocs", "devices"), [(16, GPUS), (14, MIGS)], ids=["16-over-8-gpus", "14-over-7-migs"]
)
def test_every_process_gets_its_own_name_port_and_device(tmp_path, monkeypatch, numprocs, devices):
    processes, listener = render(tmp_path, monkeypatch, numprocs, devices)

    assert [p.name for p in processes] == [f"inference-worker_{i:02d}" for i in range(numprocs)]
    ports, chosen = [], []
    for index, process in enumerate(processes):
        env = process.environment
        settings = load_settings(
            for_worker=False,
            process_index=int(env["WORKER_PROCESS_INDEX"]),
            metrics={"port": int(env["WORKER_METRICS__PORT"])},
            model={"device": env["WORKER_MODEL__DEVICE"]},
        )
        from config.derived import chosen_device

        assert settings.process_index == index
        ports.append(metrics_port(settings))
        chosen.append(chosen_device(settings))
        assert metrics_port(settings) == process_port(process.name, 9460), "healthwatch agrees"
        assert process.uid is not None or getpass.getuser() == "root"
    assert ports == [9460 + i for i in range(numprocs)]
    assert chosen == [devices[i % len(devices)] for i in range(numprocs)]
    # ... and what each process sets as CUDA_VISIBLE_DEVICES before CUDA starts.
    visible = [visibility(entry) for entry in chosen]
    expected = [devices[i % len(devices)].removeprefix("cuda:") for i in range(numprocs)]
    assert visible == [(e, "cuda:0") for e in expected]
    assert len(set(chosen)) == len(devices) and numprocs == 2 * len(devices)
    assert "--port-base 9460" in listener.command


def test_the_programs_run_as_the_named_user(tmp_path, monkeypatch):
    processes, _ = render(tmp_path, monkeypatch, 2, GPUS[:1])
    program = (DEPLOY / "inference-worker.conf").read_text()
    assert "user=%(ENV_IW_USER)s" in program
    import pwd

    assert all(p.uid == pwd.getpwnam(getpass.getuser()).pw_uid for p in processes)


def test_the_antenna_example_runs_the_same_processes_with_antenna_as_the_source(
    tmp_path, monkeypatch
):
    from supervisor.options import ServerOptions

    shutil.copy(
        DEPLOY / "inference-worker-antenna.conf", tmp_path / "inference-worker-antenna.conf"
    )
    conf = (DEPLOY / "supervisord.conf").read_text()
    included = conf.replace("/inference-worker.conf", "/inference-worker-antenna.conf")
    (tmp_path / "supervisord.conf").write_text(included)
    for key, value in {
        "IW_BIN": str(Path(sys.executable).parent),
        "IW_RUN_DIR": str(tmp_path),
        "IW_ENV_FILE": str(tmp_path),
        "IW_NUMPROCS": "2",
        "IW_DEVICES": "cuda:0",
        "IW_USER": getpass.getuser(),
        "IW_METRICS_PORT_BASE": "9460",
    }.items():
        monkeypatch.setenv(key, value)
    options = ServerOptions()
    options.realize(args=["-c", str(tmp_path / "supervisord.conf")])
    groups = {g.name: g for g in options.process_group_configs}
    workers = groups["inference-worker-antenna"].process_configs
    assert [p.name for p in workers] == [
        "inference-worker-antenna_00",
        "inference-worker-antenna_01",
    ]
    env = workers[1].environment
    settings = load_settings(
        for_worker=False,
        source=env["WORKER_SOURCE"],
        antenna={"base_url": "https://antenna.example.org/api/v2"},
        process_index=int(env["WORKER_PROCESS_INDEX"]),
        metrics={"port": int(env["WORKER_METRICS__PORT"])},
    )
    assert settings.source == "antenna"
    assert _own_cache(env)
    assert metrics_port(settings) == process_port(workers[1].name, 9460) == 9461
    listener = groups["inference-worker-antenna-healthwatch"].process_configs[0]
    assert "--group inference-worker-antenna " in listener.command


def _own_cache(env: dict[str, str]) -> bool:
    """The model-file cache is set, and not under HOME=/tmp, where another account could
    plant the files served as a model's (docs/model-files.md, The cache directory)."""
    cache = Path(env["WORKER_MODEL__CACHE_DIR"])
    return cache.is_absolute() and Path("/tmp") not in (cache, *cache.parents)


def test_the_model_cache_is_a_lasting_directory_outside_tmp(tmp_path, monkeypatch):
    processes, _listener = render(tmp_path, monkeypatch, 2, GPUS[:2])
    for process in processes:
        assert process.environment["HOME"] == "/tmp"  # a system account has no home
        assert _own_cache(process.environment), process.environment
