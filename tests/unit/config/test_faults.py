"""The tests' fault hooks live outside the settings an operator sets: read by ``run`` alone,
still checked for misspellings, and absent from the production schema."""

from __future__ import annotations

import pytest

from config.errors import ConfigError
from config.faults import FaultSettings, load_faults
from config.settings import Settings, load_settings


def test_the_production_schema_has_no_test_hooks():
    assert "faults" not in Settings.model_fields
    assert not hasattr(load_settings(for_worker=False), "faults")


def test_a_hook_set_in_the_environment_is_read_by_the_hooks_and_accepted_by_the_settings(
    monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)  # no .env
    assert load_faults() == FaultSettings()  # none set: every hook off
    monkeypatch.setenv("WORKER_FAULTS__WEDGE_MODE", "sleep")
    monkeypatch.setenv("WORKER_FAULTS__SLOW_STORE_S", "2.5")
    load_settings(for_worker=False)  # not refused as "not a setting"
    faults = load_faults()
    assert (faults.wedge_mode, faults.slow_store_s) == ("sleep", 2.5)


def test_a_hook_in_the_env_file_is_read_as_the_settings_are(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("WORKER_FAULTS__DEVICE_ERROR_AT_BATCH=3\n")
    assert load_faults().device_error_at_batch == 3


def test_a_misspelt_hook_is_refused_naming_the_closest(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORKER_FAULTS__WEDGE_MOD", "sleep")
    with pytest.raises(ConfigError) as error:
        load_settings(for_worker=False)
    assert str(error.value) == (
        "WORKER_FAULTS__WEDGE_MOD is not a setting; did you mean WORKER_FAULTS__WEDGE_MODE?"
    )


def test_a_hook_that_cannot_work_is_refused_naming_its_variable(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORKER_FAULTS__WEDGE_MODE", "melt")
    with pytest.raises(ConfigError, match=r"^WORKER_FAULTS__WEDGE_MODE: Input should be"):
        load_faults()
