"""Settings: the SPEC's names from the environment, and combinations that cannot work refused."""

from __future__ import annotations

import pytest

from config.settings import ConfigError, load_settings
from pipelines.setup import choose


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"x")
    return str(path)


def test_spec_names_are_read_from_the_environment(monkeypatch, weights):
    monkeypatch.setenv("WORKER_NATS__URL", "nats://10.0.0.5:4222")
    monkeypatch.setenv("WORKER_NATS__ACK_WAIT_S", "600")
    monkeypatch.setenv("WORKER_NATS__MAX_DELIVER", "2")
    monkeypatch.setenv("WORKER_LOADER__NUM_WORKERS", "6")
    monkeypatch.setenv("WORKER_LOADER__MP_CONTEXT", "spawn")
    monkeypatch.setenv("WORKER_MODEL__WEIGHTS", weights)
    monkeypatch.setenv("WORKER_MODEL__DEVICE", "cuda:1")
    monkeypatch.setenv("WORKER_METRICS__PORT", "0")
    s = load_settings()
    assert (s.nats.url, s.nats.ack_wait_s, s.nats.max_deliver) == ("nats://10.0.0.5:4222", 600, 2)
    assert (s.loader.num_workers, s.loader.mp_context) == (6, "spawn")
    assert (s.model.device, s.metrics.port) == ("cuda:1", 0)


def test_defaults_match_the_spec(monkeypatch, weights):
    monkeypatch.setenv("WORKER_MODEL__WEIGHTS", weights)
    s = load_settings()
    assert s.nats.url == "nats://127.0.0.1:4222"
    assert (s.nats.tasks_stream, s.nats.results_stream) == ("INFERENCE_TASKS", "INFERENCE_RESULTS")
    assert (s.nats.consumer, s.nats.ack_wait_s, s.nats.max_deliver) == ("inference-worker", 300, 5)
    assert s.nats.dead_letter_subject == "dead.tasks"
    assert (s.loader.mp_context, s.model.device, s.metrics.port) == ("forkserver", "auto", 9464)


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (
            {"loader": {"timeout_s": 120}, "health": {"stall_timeout_s": 120}},
            ["WORKER_LOADER__TIMEOUT_S", "WORKER_HEALTH__STALL_TIMEOUT_S"],
        ),
        (
            {"health": {"stall_timeout_s": 300}},
            ["WORKER_HEALTH__STALL_TIMEOUT_S", "WORKER_NATS__ACK_WAIT_S"],
        ),
        ({"loader": {"batch_size": 0}}, ["WORKER_LOADER__BATCH_SIZE"]),
        ({"loader": {"num_workers": -1}}, ["WORKER_LOADER__NUM_WORKERS"]),
        ({"model": {"device": "tpu"}}, ["WORKER_MODEL__DEVICE"]),
        ({"s3": {"read_timeout_s": 50}}, ["WORKER_S3__READ_TIMEOUT_S", "WORKER_LOADER__TIMEOUT_S"]),
        (
            {"health": {"drain_timeout_s": 300}},
            ["WORKER_HEALTH__DRAIN_TIMEOUT_S", "WORKER_NATS__ACK_WAIT_S"],
        ),
        (
            {"nats": {"store_retry_s": 300}},
            ["WORKER_NATS__STORE_RETRY_S", "WORKER_NATS__ACK_WAIT_S"],
        ),
        (
            {"health": {"watchdog_timeout_s": 120}},  # not after the stall timeout (120 s)
            ["WORKER_HEALTH__WATCHDOG_TIMEOUT_S", "WORKER_HEALTH__STALL_TIMEOUT_S"],
        ),
        (
            {"health": {"watchdog_timeout_s": 300}},  # not before the ack wait (300 s)
            ["WORKER_HEALTH__WATCHDOG_TIMEOUT_S", "WORKER_NATS__ACK_WAIT_S"],
        ),
        (
            {"health": {"drain_timeout_s": 180}},  # not before the watchdog (180 s)
            ["WORKER_HEALTH__DRAIN_TIMEOUT_S", "WORKER_HEALTH__WATCHDOG_TIMEOUT_S"],
        ),
        (
            {"loader": {"fast_decode": True, "exact_decode": True}},
            ["WORKER_LOADER__FAST_DECODE", "WORKER_LOADER__EXACT_DECODE"],
        ),
    ],
)
def test_impossible_settings_are_refused_naming_the_fields(weights, overrides, names):
    with pytest.raises(ConfigError) as refused:
        load_settings(model={"weights": weights, **overrides.pop("model", {})}, **overrides)
    message = str(refused.value)
    for name in names:
        assert name in message


def test_each_start_up_rule_holds_just_inside_its_bound_and_the_watchdog_can_be_off(weights):
    load_settings(  # accepted: every bound strict, none crossed
        model={"weights": weights},
        nats={"ack_wait_s": 300, "store_retry_s": 299},
        health={"stall_timeout_s": 120, "drain_timeout_s": 298, "watchdog_timeout_s": 299},
    )
    no_room = {"ack_wait_s": 121}  # no room for the watchdog between 120 s and 121 s
    with pytest.raises(ConfigError, match="WORKER_HEALTH__WATCHDOG_TIMEOUT_S"):
        load_settings(model={"weights": weights}, nats=no_room, health={"stall_timeout_s": 120})
    load_settings(
        model={"weights": weights},
        nats=no_room,
        health={"stall_timeout_s": 120, "watchdog_timeout_s": 0},  # off: no rule for it
    )
    load_settings(  # the watchdog off: a drain as long as the ack wait allows
        model={"weights": weights}, health={"drain_timeout_s": 299, "watchdog_timeout_s": 0}
    )


def test_a_watchdog_shorter_than_a_drains_longest_bounded_wait_is_refused_naming_it(weights):
    """Past the drain's timeout each bounded wait begins a fresh watchdog window; a watchdog
    within the longest of them (the cancelled run's give-backs) would fire mid-drain."""
    quick = {  # the chaos suite's timeouts, whose 7.5 s watchdog still holds
        "model": {"weights": weights},
        "s3": {"connect_timeout_s": 0.5, "read_timeout_s": 1, "max_attempts": 2},
        "loader": {"timeout_s": 4},
    }
    short = {"stall_timeout_s": 5, "drain_timeout_s": 3, "watchdog_timeout_s": 6.5}
    with pytest.raises(ConfigError, match=r"WORKER_HEALTH__WATCHDOG_TIMEOUT_S.*7s"):
        load_settings(**quick, health=short)
    load_settings(**quick, health={**short, "watchdog_timeout_s": 7.5})


def test_the_drains_longest_bounded_wait_is_the_one_the_drain_makes():
    from config.cross_checks import DRAIN_LONGEST_WAIT_S
    from worker.core import claims, drain

    assert DRAIN_LONGEST_WAIT_S == drain._PROCESSOR_END_S
    assert DRAIN_LONGEST_WAIT_S >= claims.GIVE_BACK_WAIT_S


def test_missing_weights_are_refused_for_a_worker_but_not_for_a_client():
    with pytest.raises(ConfigError, match=r"WORKER_MODEL__WEIGHTS.*no such file"):
        load_settings(model={"weights": "/nonexistent/model.pt"})
    with pytest.raises(ConfigError, match="WORKER_MODEL__WEIGHTS is not set"):
        choose(load_settings())
    assert load_settings(for_worker=False).model.weights == ""


def test_an_unknown_pipeline_is_refused_naming_the_setting(weights):
    with pytest.raises(ConfigError, match="WORKER_MODEL__PIPELINE='no-such-pipeline'"):
        choose(load_settings(model={"weights": weights, "pipeline": "no-such-pipeline"}))


def test_every_problem_is_its_own_line(weights):
    with pytest.raises(ConfigError) as refused:
        load_settings(model={"weights": weights}, loader={"batch_size": 0, "num_workers": 0})
    assert len(str(refused.value).splitlines()) == 2


def test_the_inflight_byte_cap_bounds_the_tasks_held(weights):
    from config.derived import max_held_tasks

    per_image = 3 * 224 * 224
    s = load_settings(model={"weights": weights}, loader={"batch_size": 8, "prefetch_batches": 4})
    assert max_held_tasks(s, per_image) == 32
    capped = load_settings(
        model={"weights": weights},
        loader={"batch_size": 8, "prefetch_batches": 4, "max_inflight_bytes": 12 * per_image},
    )
    assert max_held_tasks(capped, per_image) == 12
    with pytest.raises(ConfigError, match="MAX_INFLIGHT_BYTES"):
        choose(
            load_settings(
                model={"weights": weights},
                loader={"batch_size": 8, "max_inflight_bytes": 7 * per_image},
            )
        )


@pytest.mark.parametrize("entry", ["minio:90OO", "a b", "[::1]:x"])
def test_a_malformed_allowed_host_is_refused_at_start(weights, entry):
    with pytest.raises(ConfigError, match="WORKER_SOURCES__ALLOWED_HOSTS"):
        load_settings(model={"weights": weights}, sources={"allowed_hosts": entry})


def test_allowed_hosts_take_names_ports_and_bracketed_v6(weights):
    s = load_settings(
        model={"weights": weights},
        sources={"allowed_hosts": "minio.internal:9000, 10.0.0.5, [::1]:9000, fd00::1"},
    )
    assert len(s.sources.hosts()) == 4


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        ("WORKER_GUARD__MAX_TREE_RSS_BYTES", "WORKER_GUARDS__MAX_TREE_RSS_BYTES"),  # the group
        ("WORKER_SOURCES__MAX_BYTE", "WORKER_SOURCES__MAX_BYTES"),  # a field of a real group
        ("worker_loader__timeout", "WORKER_LOADER__TIMEOUT_S"),  # any case, as pydantic reads
    ],
)
def test_a_misspelt_setting_in_the_environment_is_refused_naming_the_closest(
    monkeypatch, tmp_path, name, closest
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, "1000")
    with pytest.raises(ConfigError) as error:
        load_settings(for_worker=False)
    assert str(error.value) == f"{name.upper()} is not a setting; did you mean {closest}?"


def test_a_misspelt_setting_in_the_env_file_stops_every_command_with_exit_2(
    monkeypatch, tmp_path, capsys
):
    from worker.commands.cli import main
    from worker.commands.localservers import free_port

    monkeypatch.chdir(tmp_path)
    # Were it not refused, the command would give up on a server that is not there.
    (tmp_path / ".env").write_text(
        "WORKER_SOURCE__MAX_BYTES=1000\nOTHER_THING=1\n"
        f"WORKER_NATS__URL=nats://127.0.0.1:{free_port()}\n"
        "WORKER_NATS__COMMAND_CONNECT_TIMEOUT_S=1\n"
    )
    assert main(["provision"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "config error: WORKER_SOURCE__MAX_BYTES is not a setting; "
        "did you mean WORKER_SOURCES__MAX_BYTES?"
    ]


def test_every_name_the_docs_document_is_a_setting():
    import re
    from pathlib import Path

    from config.settings import Settings
    from config.unknown import hook_names, known_names

    root = Path(__file__).parents[3]
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    documented = set(re.findall(r"`(WORKER_[A-Z0-9_]+)`", "".join(d.read_text() for d in docs)))
    assert documented and documented <= known_names(Settings) | hook_names()


@pytest.mark.parametrize("given", ["moths.toml, orders.toml", '["moths.toml", "orders.toml"]'])
def test_several_pipelines_are_a_list_comma_separated_or_json(monkeypatch, given):
    monkeypatch.setenv("WORKER_MODEL__PIPELINES", given)
    settings = load_settings(for_worker=False)
    assert settings.model.pipeline_entries() == ["moths.toml", "orders.toml"]


def test_one_pipeline_keeps_working_when_no_list_is_given(monkeypatch):
    monkeypatch.delenv("WORKER_MODEL__PIPELINES", raising=False)
    monkeypatch.setenv("WORKER_MODEL__PIPELINE", "moths.toml")
    assert load_settings(for_worker=False).model.pipeline_entries() == ["moths.toml"]


def test_weights_named_in_a_refusal_never_show_a_presigned_signature():
    presigned = "ftp://bucket.example/w.pt?X-Amz-Signature=deadbeefcafe&X-Amz-Credential=AKIA"
    with pytest.raises(ConfigError) as refused:
        load_settings(model={"weights": presigned})
    assert "WORKER_MODEL__WEIGHTS" in str(refused.value)
    assert "deadbeefcafe" not in str(refused.value) and "AKIA" not in str(refused.value)


def test_verified_digests_and_amis_hosts_are_read_and_checked(tmp_path, monkeypatch):
    from config.settings import load_settings

    monkeypatch.chdir(tmp_path)  # no .env
    sha = "AB" * 32
    model = {
        "file_digests": f"m.pth={sha}, https://h.example/dl?model=a=sha256:{sha.lower()}",
        "files_hosts": "https://a.example/ami/, https://b.example/ami/",
        "cache_dir": str(tmp_path / "cache"),
    }
    settings = load_settings(model=model)
    assert settings.model.file_digests == {
        "m.pth": sha.lower(),
        "https://h.example/dl?model=a": sha.lower(),
    }
    assert settings.model.files_hosts == ["https://a.example/ami/", "https://b.example/ami/"]
    with pytest.raises(ConfigError, match=r"WORKER_MODEL__FILE_DIGESTS: 'm\.pth': give name="):
        load_settings(model={**model, "file_digests": "m.pth=1234"})
    with pytest.raises(
        ConfigError, match="WORKER_MODEL__FILES_MIRROR and WORKER_MODEL__FILES_HOSTS are both"
    ):
        load_settings(model={**model, "files_mirror": "/srv/ami"})
