"""The one results writer: where results go, the command and date a result records, and its
JSON saved (and printed).

A smoke run (the test suite's) sets ``BENCH_RESULTS_DIR``: its results go there, never over
the real ones in bench/results/.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parents[1] / "results"
RESULTS_ENV = "BENCH_RESULTS_DIR"


def results_dir() -> Path:
    return Path(os.environ.get(RESULTS_ENV) or RESULTS)


def date_utc() -> str:
    """Now, as a result records its date (``2026-12-01 10:49 UTC``)."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def stamp(module: str, argv: list[str] | None = None) -> dict[str, str]:
    """The ``command`` that ran ``bench.<module>`` (with ``argv``, this process's arguments
    unless given) and the ``date``, as every result records them."""
    args = sys.argv[1:] if argv is None else argv
    return {"command": " ".join(["python -m", f"bench.{module}", *args]), "date": date_utc()}


def result_path(filename: str) -> Path:
    """Where a result file of that name goes (its folder made)."""
    results = results_dir()
    results.mkdir(parents=True, exist_ok=True)
    return results / filename


def save(name: str, payload: dict[str, Any], *, echo: bool = False) -> Path:
    """``payload`` as ``<results>/<name>.json``; printed too when ``echo``. The path saved."""
    path = result_path(f"{name}.json")
    path.write_text(json.dumps(payload, indent=2) + "\n")
    if echo:
        print(json.dumps(payload, indent=2))
    return path
