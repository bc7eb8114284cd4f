"""deploy/slurm/: the batch script is valid shell (bash -n; shellcheck where installed), it
sets only real settings, and SLURM's SIGTERM comes with the drain's time before the kill."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from config.settings import Settings
from config.unknown import known_names

ROOT = Path(__file__).parents[3]
SCRIPT = ROOT / "deploy" / "slurm" / "inference-worker.sbatch"
CLOSE_DOWN_S = 30  # after the drain: loader children reaped, the process gone


def exported() -> dict[str, str]:
    """``export NAME=${NAME:-default}``: each setting the script sets, with its default."""
    found = re.findall(r"^export (WORKER_\w+)=\$\{\1:-([^}]*)\}$", SCRIPT.read_text(), re.M)
    return dict(found)


def test_the_batch_script_is_valid_shell():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)
    tool = shutil.which("shellcheck")
    if tool is None:  # optional, in CI too: bash -n above is the check every machine runs
        pytest.skip("shellcheck not on PATH (apt-get install shellcheck)")
    done = subprocess.run([tool, str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout


def test_sigterm_comes_with_the_drains_time_and_reaches_the_worker():
    text = SCRIPT.read_text()
    (signal,) = re.findall(r"^#SBATCH --signal=(\S+)$", text, re.M)
    to_batch_shell, _, lead = signal.partition("TERM@")
    assert to_batch_shell == "B:", "SIGTERM to the batch shell, which exec makes the worker"
    drain = {"drain_timeout_s": exported()["WORKER_HEALTH__DRAIN_TIMEOUT_S"]}
    settings = Settings(_env_file=None, health=drain)  # type: ignore[call-arg]
    assert int(lead) >= settings.health.drain_timeout_s + CLOSE_DOWN_S
    commands = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert commands[-1] == "exec inference-worker run --until-idle"


def test_it_sets_only_settings_the_worker_knows():
    names = set(exported())
    assert "WORKER_MODEL__CACHE_DIR" in names
    assert names <= known_names(Settings), sorted(names - known_names(Settings))
