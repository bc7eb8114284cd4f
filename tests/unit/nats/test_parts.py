"""The NATS source's parts: what they say of a task source nobody configured."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from config.settings import load_settings
from worker.nats.parts import NatsParts

SETTINGS = ("WORKER_SOURCE", "WORKER_NATS__URL")


def parts_for(source_delivered: int | None, **overrides: Any) -> NatsParts:
    parts = NatsParts(load_settings(for_worker=False, **overrides), None, None)  # type: ignore[arg-type]
    if source_delivered is not None:  # opened, and the feed handed over this many messages
        parts._source = SimpleNamespace(delivered=source_delivered)  # type: ignore[assignment]
    return parts


def test_a_burst_run_on_a_source_nobody_configured_that_served_nothing_is_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started away from its .env, an --until-idle run became a NATS worker on whatever NATS
    listens on localhost and exited 0 having served nothing."""
    monkeypatch.chdir(tmp_path)  # no .env here
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    why = parts_for(0).unserved()
    assert why is not None and "served no task from NATS at nats://127.0.0.1:4222" in why, why
    assert all(name in why for name in (*SETTINGS, "WORKER_ANTENNA__BASE_URL", "IW_ENV_FILE"))
    assert f"no .env in {tmp_path.resolve()}" in why
    (tmp_path / ".env").write_text("WORKER_LOADER__BATCH_SIZE=4\n")
    assert "sets neither" in (parts_for(0).unserved() or "")
    # It served tasks, or a source was configured: an idle run ends 0 as before
    assert parts_for(3).unserved() is None
    assert parts_for(0, nats={"url": "nats://127.0.0.1:4222"}).unserved() is None
    assert parts_for(0, source="nats").unserved() is None


# The modules that read the NATS settings group: the assembly, and those that use most of it.
READ_THE_GROUP = {"auth", "connection", "feed", "job_consumers", "parts", "provision"}


def test_only_the_assembly_and_its_kind_read_the_whole_nats_settings_group() -> None:
    """Each other part is given what it uses (STYLE: each part takes what it uses)."""
    import ast

    room = Path(__file__).parents[3] / "worker" / "nats"
    readers = set()
    for path in room.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module != "config.settings":
                continue
            if any(alias.name == "NatsSettings" for alias in node.names):
                readers.add(path.stem)
    assert readers == READ_THE_GROUP
