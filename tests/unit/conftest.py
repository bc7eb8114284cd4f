"""Fixtures of the unit tests: the toy plugin pipelines (tests/plugin/toy_moths)."""

from __future__ import annotations

from pathlib import Path

import pytest

PLUGIN = Path(__file__).parents[1] / "plugin"


@pytest.fixture
def toy(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(PLUGIN))
    import toy_moths

    monkeypatch.setenv("TOY_MOTHS_WEIGHTS", toy_moths.colour_weights(str(tmp_path / "colour.pt")))
    return toy_moths


@pytest.fixture
def served(tmp_path):
    """A directory (``served.root``) on a real HTTP server on 127.0.0.1, stopped at the end."""
    from tests.served_files import Served

    (tmp_path / "www").mkdir()
    server = Served(tmp_path / "www")
    yield server
    server.stop()
