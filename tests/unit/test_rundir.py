"""The run directory: a slot per process index, emptied of dead processes' leftovers by the
next process with that index, never of a live one's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from datasets import rundir


def holder(base: Path, index: int) -> subprocess.Popen[str]:
    """A live process that claimed ``index``'s slot and uses it until its stdin closes."""
    script = textwrap.dedent(
        f"""
        import sys, tempfile
        from pathlib import Path
        from datasets import rundir
        run = rundir.claim(Path({str(base)!r}), {index})
        rundir.use(run)
        Path(tempfile.mkdtemp(prefix="pymp-"))
        print("PATH=" + str(run.path), flush=True)
        sys.stdin.read()
        """
    )
    return subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def claimed_path(proc: subprocess.Popen[str]) -> Path:
    for _ in range(20):  # the log lines, then ours
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if line.startswith("PATH="):
            return Path(line.removeprefix("PATH=").strip())
    raise AssertionError("the holder said no path")


def test_a_dead_processs_leftovers_are_removed_by_the_next_claim_of_its_index(tmp_path):
    dead = holder(tmp_path, 3)
    path = claimed_path(dead)
    dead.kill()
    dead.wait(10)
    (path / "pymp-left").mkdir(exist_ok=True)
    semaphore = Path("/dev/shm") / f"sem.{rundir.semprefix_for(path).lstrip('/')}-left"
    torch_segment = Path("/dev/shm") / f"torch_{dead.pid}_1_1"
    semaphore.touch()
    torch_segment.touch()

    run = rundir.claim(tmp_path, 3)
    try:
        assert run.path == path == tmp_path / "process-3"
        assert sorted(os.listdir(path)) == sorted(["owner.lock", f"pid-{os.getpid()}-" + _start()])
        assert not semaphore.exists() and not torch_segment.exists()
    finally:
        run.release()
        semaphore.unlink(missing_ok=True)
        torch_segment.unlink(missing_ok=True)


def test_a_live_process_keeps_its_slot_and_its_files(tmp_path):
    live = holder(tmp_path, 0)
    try:
        path = claimed_path(live)
        before = sorted(os.listdir(path))
        run = rundir.claim(tmp_path, 0)
        try:
            assert run.path == tmp_path / "process-0.1"
            assert sorted(os.listdir(path)) == before
            assert any(name.startswith("pymp-") for name in before)
            assert run.semprefix != rundir.semprefix_for(path)
        finally:
            run.release()
    finally:
        live.stdin.close()  # type: ignore[union-attr]
        live.wait(10)


def test_a_slot_is_not_emptied_while_a_marked_process_of_it_still_lives(tmp_path):
    path = tmp_path / "process-5"
    path.mkdir()
    (path / "pymp-in-use").mkdir()
    rundir.mark_self(path)  # this test process: alive, like a loader child outliving its parent
    run = rundir.claim(tmp_path, 5)
    try:
        assert run.path == path and (path / "pymp-in-use").is_dir()
    finally:
        run.release()


def _start() -> str:
    from datasets.processes import start_time

    return str(start_time(os.getpid()))
