"""The run directory: a slot per process index, emptied of dead processes' leftovers by the
next process with that index, never of a live one's."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from config.derived import run_dir_base, run_dir_setting
from config.errors import ConfigError
from config.settings import load_settings
from datasets import rundir
from tests.helpers import claimed_path, run_dir_holder


def claimed(base: Path, index: int) -> rundir.RunDir:
    """A slot claimed and cleared, as by a worker whose start was not refused."""
    run = rundir.claim(base, index)
    rundir.clear_leftovers(run)
    return run


def test_a_dead_processs_leftovers_are_removed_by_the_next_claim_of_its_index(short):
    dead = run_dir_holder(short, 3)
    path = claimed_path(dead)
    dead.kill()
    dead.wait(10)
    (path / "pymp-left").mkdir(exist_ok=True)
    semaphore = Path("/dev/shm") / f"sem.{rundir.semprefix_for(path).lstrip('/')}-left"
    torch_segment = Path("/dev/shm") / f"torch_{dead.pid}_1_1"
    semaphore.touch()
    torch_segment.touch()

    run = claimed(short, 3)
    try:
        assert run.path == path == short / "process-3"
        assert sorted(os.listdir(path)) == sorted(["owner.lock", f"pid-{os.getpid()}-" + _start()])
        assert not semaphore.exists() and not torch_segment.exists()
    finally:
        run.release()
        semaphore.unlink(missing_ok=True)
        torch_segment.unlink(missing_ok=True)


def test_a_claim_alone_removes_nothing_until_its_process_clears_the_leftovers(short):
    # Given a dead process's leftovers in the first slot of index 0 and in an overflow slot
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    slots = [short / "process-0", short / "process-0.1"]
    for slot in slots:
        slot.mkdir(mode=0o700)
        (slot / "pymp-left").mkdir()
        (slot / f"pid-{dead.pid}-1").touch()
    # When a process claims the index (a start refused after this goes no further)
    run = rundir.claim(short, 0)
    try:
        # Then nothing is removed...
        assert run.path == slots[0]
        assert all((slot / "pymp-left").is_dir() for slot in slots)
        # ...until the process, going on, clears them
        rundir.clear_leftovers(run)
        assert sorted(os.listdir(short)) == ["process-0"]
        assert sorted(os.listdir(slots[0])) == ["owner.lock", f"pid-{os.getpid()}-{_start()}"]
    finally:
        run.release()


def test_a_live_process_keeps_its_slot_and_its_files(short):
    live = run_dir_holder(short, 0)
    try:
        path = claimed_path(live)
        before = sorted(os.listdir(path))
        run = claimed(short, 0)
        try:
            assert run.path == short / "process-0.1"
            assert sorted(os.listdir(path)) == before
            assert any(name.startswith("pymp-") for name in before)
            assert run.semprefix != rundir.semprefix_for(path)
        finally:
            run.release()
    finally:
        live.stdin.close()  # type: ignore[union-attr]
        live.wait(10)


def test_a_slot_is_not_emptied_while_a_marked_process_of_it_still_lives(short):
    path = short / "process-5"
    path.mkdir()
    (path / "pymp-in-use").mkdir()
    rundir.mark_self(path)  # this test process: alive, like a loader child outliving its parent
    run = claimed(short, 5)
    try:
        assert run.path == path and (path / "pymp-in-use").is_dir()
    finally:
        run.release()


def _start() -> str:
    from datasets.processes import start_time

    return str(start_time(os.getpid()))


@pytest.fixture
def short(request) -> Path:
    """A short directory (pytest's own are too long for a run dir's socket room)."""
    path = Path(tempfile.mkdtemp(prefix="iw-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(path, ignore_errors=True))
    return path


def _refused(base: Path, index: int = 0, named: str = "") -> str:
    with pytest.raises(ConfigError) as refused:
        rundir.claim(base, index, named)
    assert str(refused.value).startswith(named or f"WORKER_RUN_DIR={base}: ")
    return str(refused.value)


def _victim(short: Path) -> Path:
    victim = short / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "db.sqlite").write_text("important")
    return victim


def test_a_planted_symlink_slot_is_refused_and_its_target_kept(short):
    victim = _victim(short)
    base = short / "base"
    base.mkdir(mode=0o700)
    (base / "process-0").symlink_to(victim)
    assert "symlink" in _refused(base)
    assert sorted(os.listdir(victim)) == ["db.sqlite", "sub"]


def test_a_symlinked_base_is_refused_and_its_target_kept(short):
    victim = _victim(short)
    (victim / "process-0").mkdir(mode=0o700)
    (victim / "process-0" / "keep").write_text("mine")
    (short / "base").symlink_to(victim)
    assert "symlink" in _refused(short / "base")
    assert (victim / "process-0" / "keep").read_text() == "mine"


def test_a_base_others_can_write_is_refused(short):
    base = short / "base"
    base.mkdir()
    base.chmod(0o777)
    assert "written by group or others" in _refused(base)
    assert os.listdir(base) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_another_users_slot_is_refused_and_kept(short):
    base = short / "base"
    (base / "process-0").mkdir(parents=True, mode=0o700)
    base.chmod(0o700)
    (base / "process-0" / "theirs").write_text("x")
    os.chown(base / "process-0", 65534, 65534)
    assert "belongs to uid 65534" in _refused(base)
    assert (base / "process-0" / "theirs").exists()


def test_a_symlink_left_in_a_slot_is_removed_not_its_target(short):
    victim = _victim(short)
    slot = short / "process-0"
    slot.mkdir(mode=0o700)
    (slot / "link").symlink_to(victim)
    (slot / "dir").mkdir()
    (slot / "dir" / "inner-link").symlink_to(victim / "db.sqlite")
    run = claimed(short, 0)
    try:
        assert not (slot / "link").exists() and not (slot / "dir").exists()
        assert sorted(os.listdir(victim)) == ["db.sqlite", "sub"]
        assert (victim / "db.sqlite").read_text() == "important"
    finally:
        run.release()


def test_the_default_base_is_this_users_own_and_private(short, monkeypatch):
    monkeypatch.delenv("WORKER_RUN_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    settings = load_settings(for_worker=False)
    base = run_dir_base(settings)
    assert base == short / f"inference-worker-{os.geteuid()}"
    assert "TMPDIR" in run_dir_setting(settings)
    run = rundir.claim(base, 0, run_dir_setting(settings))
    try:
        assert stat.S_IMODE(os.lstat(base).st_mode) & 0o077 == 0
        assert stat.S_IMODE(os.lstat(run.path).st_mode) & 0o077 == 0
    finally:
        run.release()


def test_a_run_dir_too_long_for_the_fork_servers_socket_is_refused(short, monkeypatch):
    long_tmp = short / ("t" * (108 - len(str(short)) - len("/inference-worker-0/process-0")))
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    monkeypatch.delenv("WORKER_RUN_DIR", raising=False)
    settings = load_settings(for_worker=False)
    message = _refused(run_dir_base(settings), 0, run_dir_setting(settings))
    assert "WORKER_RUN_DIR" in message and "TMPDIR" in message and "too long" in message
    assert not long_tmp.exists()  # refused before anything was made
    # A path that fits works: the slot plus the socket's 32 bytes within 107.
    fits = short / "s"
    assert len(str(fits / "process-0")) + 32 <= 107
    rundir.claim(fits, 0).release()


def test_unusable_places_are_config_errors_naming_the_setting(short):
    assert "/proc/iw" in _refused(Path("/proc/iw"))
    (short / "process-0").write_text("a file")
    assert "not a directory" in _refused(short)


def test_all_slots_in_use_is_a_config_error(short, monkeypatch):
    monkeypatch.setattr(rundir, "_MAX_SLOTS", 1)
    run = rundir.claim(short, 0)  # flock: a second open of the lock, even ours, is refused
    try:
        assert "in use" in _refused(short)
    finally:
        run.release()


def test_a_killed_overflow_slots_leftovers_go_with_the_next_claim(short):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    overflow = short / "process-0.1"
    overflow.mkdir(mode=0o700)
    (overflow / "pymp-left").mkdir()
    (overflow / f"pid-{dead.pid}-1").touch()
    semaphore = Path("/dev/shm") / f"sem.{rundir.semprefix_for(overflow).lstrip('/')}-left"
    semaphore.touch()
    run = claimed(short, 0)
    try:
        assert run.path == short / "process-0"
        assert sorted(os.listdir(short)) == ["process-0"]
        assert not semaphore.exists()
    finally:
        run.release()
        semaphore.unlink(missing_ok=True)


def test_a_live_overflow_slot_is_kept_by_the_next_claim(short):
    live = run_dir_holder(short, 0)
    first_path = claimed_path(live)
    second = run_dir_holder(short, 0)
    try:
        second_path = claimed_path(second)
        assert second_path == short / "process-0.1"
        before = sorted(os.listdir(second_path))
        live.stdin.close()  # type: ignore[union-attr]
        live.wait(10)
        run = claimed(short, 0)
        try:
            assert run.path == first_path
            assert sorted(os.listdir(second_path)) == before
        finally:
            run.release()
    finally:
        for proc in (live, second):
            if not proc.stdin.closed:  # type: ignore[union-attr]
                proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(10)
