"""The fake Antenna (a real HTTP server on 127.0.0.1) each Antenna unit test runs against."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.antenna_fake import FakeAntenna
from tests.unit.antenna.common import SERVED, TOKEN


@pytest.fixture
def fake() -> Iterator[FakeAntenna]:
    antenna = FakeAntenna(token=TOKEN, ttr_s=0.4)
    antenna.register_direct(1, SERVED.config())
    with antenna.running():
        yield antenna
