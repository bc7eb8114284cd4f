"""The persistent forkserver loader: same children across requests, explicit recovery, no leaks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from config.errors import LoaderFailure
from datasets.images import DecodePlan
from datasets.loader import LoaderConfig, LoadRequest, RequestStream, StreamingLoader
from datasets.uris import SourceConfig
from worker.commands.demo_images import image_bytes

FILES = SourceConfig(file_roots=(tempfile.gettempdir(),))  # where pytest makes tmp_path


@pytest.fixture
def images(tmp_path):
    uris = []
    for i in range(8):
        path = tmp_path / f"{i}.jpg"
        path.write_bytes(image_bytes(320 + 40 * i, 240, seed=i))
        uris.append(f"file://{path}")
    return uris


@pytest.fixture
def loader():
    loader = StreamingLoader(
        LoaderConfig(
            num_workers=2, timeout_s=2.0, plan=DecodePlan(size=64, fast=True), sources=FILES
        )
    )
    loader.start()
    yield loader
    loader.close()


def load_all(loader, uris, first_key=0):
    loader.submit([LoadRequest(first_key + i, uri) for i, uri in enumerate(uris)])
    return {item.key: item for item in (loader.next_loaded() for _ in uris)}


def run_script(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """``text`` as a script in its own Python process, from the repository root."""
    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(Path(__file__).parents[3]),
        check=False,
    )


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_same_children_serve_every_request(loader, images):
    pids = loader.child_pids()
    for round_ in range(3):
        loaded = load_all(loader, images, first_key=round_ * 100)
        assert all(item.image is not None for item in loaded.values())
        assert {item.pid for item in loaded.values()} <= set(pids)
    assert loader.child_pids() == pids
    assert loader.outstanding() == 0


def test_loaded_images_held_by_the_worker_take_no_shared_memory(tmp_path):
    """Images come back through the pipe: a container's small /dev/shm (Docker's 64 MB by
    default) does not bound how many images the worker can hold, and none is left behind."""
    from worker.health.procstats import shm_bytes

    path = tmp_path / "big.jpg"
    path.write_bytes(image_bytes(1024, 768, seed=3))
    loader = StreamingLoader(
        LoaderConfig(
            num_workers=2, timeout_s=5.0, plan=DecodePlan(size=512, fast=True), sources=FILES
        )
    )
    loader.start()
    try:
        before = shm_bytes(os.getpid(), set())
        held = load_all(loader, [f"file://{path}"] * 24)  # 24 x 786 KB, all kept
        during = shm_bytes(os.getpid(), set())
    finally:
        loader.close()

    assert all(
        item.image is not None and item.image.pixels.shape == (3, 512, 512)
        for item in held.values()
    )
    assert during - before < 512 * 512 * 3, "no loaded image is mapped from /dev/shm"


def test_stopped_children_time_out_and_are_killed_and_reaped_and_the_loader_carries_on(
    loader, images
):
    stopped = loader.child_pids()
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    expected = sorted(f"{pid}:T" for pid in stopped)
    for _ in range(100):  # a signal takes effect asynchronously; wait up to 5 s
        if sorted(loader.unhealthy_children()) == expected:
            break
        time.sleep(0.05)
    assert sorted(loader.unhealthy_children()) == expected
    loader.submit([LoadRequest(i, uri) for i, uri in enumerate(images)])
    with pytest.raises(LoaderFailure, match="timed out"):
        loader.next_loaded()
    lost = loader.restart()

    assert len(lost) == len(images), "requests held by the dead loader are reported"
    assert not any(psutil.pid_exists(pid) for pid in stopped), "stopped children are reaped"
    assert not set(stopped) & set(loader.child_pids())
    assert loader.unhealthy_children() == []
    loaded = load_all(loader, images, first_key=1000)
    assert all(item.image is not None for item in loaded.values())


def test_restarts_leak_no_descriptors_and_no_children(loader, images):
    load_all(loader, images)
    loader.restart()
    fds, children = open_fds(), len(psutil.Process().children(recursive=True))
    for n in range(5):
        loader.restart()
        load_all(loader, images[:2], first_key=10 * (n + 1))
    assert open_fds() == fds
    assert len(psutil.Process().children(recursive=True)) == children
    assert loader.restarts == 6


def test_close_reaps_every_child(images):
    loader = StreamingLoader(
        LoaderConfig(
            num_workers=2, timeout_s=2.0, plan=DecodePlan(size=64, fast=True), sources=FILES
        )
    )
    loader.start()
    load_all(loader, images[:2])
    pids = loader.child_pids()
    loader.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)


KILLED_WITH_ITS_GROUP = """
import os, signal, sys
import multiprocessing.synchronize as synchronize
from datasets.images import DecodePlan
from datasets.loader import LoaderConfig, StreamingLoader
made = []  # every named semaphore this process makes (its children only open them)
_init = synchronize.SemLock.__init__
def _recorded(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    if self._semlock.name:
        made.append(self._semlock.name)
synchronize.SemLock.__init__ = _recorded
if __name__ == "__main__":
    plan = DecodePlan(size=64, fast=True)
    loader = StreamingLoader(LoaderConfig(num_workers=2, timeout_s=10, plan=plan))
    loader.start()
    loader.restart()
    print("started", *made, flush=True)
    os.killpg(0, signal.SIGKILL)  # as supervisord's killasgroup does: the tracker dies too
"""


def sem_entries() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.mp-")}


def test_no_semaphore_is_left_in_dev_shm_even_when_the_whole_group_is_sigkilled(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "killed.py"
    script.write_text(KILLED_WITH_ITS_GROUP)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
        check=False,
        cwd=str(Path(__file__).parents[3]),
    )
    assert done.stdout.startswith("started"), done.stderr
    assert done.returncode == -9
    # The names the killed process made, not whatever other processes (the suite's other
    # runners, a loader whose children a test stopped) hold meanwhile.
    made = {f"sem.{name.lstrip('/')}" for name in done.stdout.splitlines()[0].split()[1:]}
    assert made, "the loader's queues, locks and events are named semaphores"
    deadline = time.monotonic() + 15
    while made & sem_entries() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert made & sem_entries() == set()


def test_a_running_loader_keeps_no_semaphore_names(loader, images):
    from datasets.semaphores import semlock_names

    load_all(loader, images[:2])
    loader.restart()
    load_all(loader, images[:2], first_key=100)
    ours = {f"sem.{name.lstrip('/')}" for name in semlock_names(loader._requests)}
    assert ours, "the request queue has named semaphores"
    assert not ours & sem_entries(), "their names are unlinked while the loader works"


OWNER_DIES_ALONE = """
import os, sys
from datasets.images import DecodePlan
from datasets.loader import LoaderConfig, StreamingLoader
if __name__ == "__main__":
    plan = DecodePlan(size=64, fast=True)
    loader = StreamingLoader(LoaderConfig(num_workers=2, timeout_s=10, plan=plan))
    loader.start()
    print(*loader.child_pids(), flush=True)
    os._exit(1)  # as the watchdog does: no finalisers, children not reaped
"""


def test_loader_children_and_the_fork_server_exit_when_the_main_process_dies_alone(tmp_path):
    import time

    from worker.health.procstats import living

    done = run_script(tmp_path, OWNER_DIES_ALONE)
    children = [int(pid) for pid in done.stdout.split()]
    assert len(children) == 2, done.stderr
    forkservers = {psutil.Process(pid).ppid() for pid in living(children)}
    deadline = time.monotonic() + 15
    while living(children + list(forkservers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert living(children + list(forkservers)) == []


def wait_state(pids, states, timeout_s: float = 10.0) -> None:
    from datasets import processes

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(processes.state(pid) in states for pid in pids):
            return
        time.sleep(0.02)
    raise AssertionError({pid: processes.state(pid) for pid in pids})


def test_with_every_process_under_it_stopped_the_loader_replaces_them_all(images):
    """A cgroup freeze or a debugger stops the children, the fork server and the resource
    tracker at once; a rebuild must neither raise nor wait on them, and nothing stopped is left."""
    import threading

    from datasets import processes

    loader = StreamingLoader(
        LoaderConfig(
            num_workers=2, timeout_s=2.0, plan=DecodePlan(size=64, fast=True), sources=FILES
        )
    )
    loader.start()
    try:
        load_all(loader, images[:2])
        old = [*loader.child_pids(), processes.forkserver_pid(), processes.tracker_pid()]
        for pid in old:
            os.kill(pid, signal.SIGSTOP)
        wait_state(old, ("T", "t"))
        assert loader.unhealthy_children(), "stopped children and fork server are reported"

        errors: list[BaseException] = []

        def submit_meanwhile() -> None:  # the event loop's thread keeps feeding the loader
            try:
                for key in range(200, 204):
                    loader.submit([LoadRequest(key, images[key % len(images)])])
                    time.sleep(0.05)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        feeder = threading.Thread(target=submit_meanwhile)
        feeder.start()
        lost = loader.restart()
        loader.submit([request for request in lost if request.key >= 200])  # as the engine does
        feeder.join(timeout=10)
        assert errors == []
        late = {loader.next_loaded().key for _ in range(4)}
        assert late == {200, 201, 202, 203}
        loaded = load_all(loader, images[2:4], first_key=100)
        assert all(item.image is not None for item in loaded.values())
        assert processes.forkserver_pid() not in old
        wait_state(old, (None, "Z", "X"))
    finally:
        loader.close()
    assert [pid for pid in old if processes.state(pid) in ("T", "t")] == []


CLOSES_AND_EXITS = """
from datasets import processes
from datasets.images import DecodePlan
from datasets.loader import LoaderConfig, StreamingLoader
if __name__ == "__main__":
    plan = DecodePlan(size=64, fast=True)
    loader = StreamingLoader(LoaderConfig(num_workers=2, timeout_s=10, plan=plan))
    loader.start()
    print(*loader.child_pids(), processes.forkserver_pid(), flush=True)
    loader.close()
"""


def test_when_a_closed_loaders_process_exits_its_children_and_fork_server_are_already_gone(
    tmp_path,
):

    from datasets import processes

    done = run_script(tmp_path, CLOSES_AND_EXITS)
    pids = [int(pid) for pid in done.stdout.split()]
    assert done.returncode == 0 and len(pids) == 3, done.stderr
    assert {pid: processes.state(pid) for pid in pids} == dict.fromkeys(pids)


@pytest.mark.parametrize("mp_context", ["forkserver", "spawn", "fork"])
def test_every_start_method_serves_recovers_and_leaves_no_child(mp_context, images):
    loader = StreamingLoader(
        LoaderConfig(
            num_workers=2,
            timeout_s=30.0,
            plan=DecodePlan(size=64, fast=True),
            sources=FILES,
            mp_context=mp_context,
        )
    )
    loader.start()
    try:
        first = loader.child_pids()
        assert len(first) == 2 and all(psutil.pid_exists(pid) for pid in first)
        assert all(item.image is not None for item in load_all(loader, images[:3]).values())
        loader.restart()
        assert set(loader.child_pids()).isdisjoint(first)
        loaded = load_all(loader, images[3:6], first_key=10)
        assert {item.pid for item in loaded.values()} <= set(loader.child_pids())
        every = first + loader.child_pids()
    finally:
        loader.close()
    from tests.helpers import until_gone

    assert until_gone(every) == []


class DiesOnArrival(RequestStream):
    """A stream whose children exit as they unpickle it, before they can report."""

    def __setstate__(self, state: dict) -> None:
        os._exit(3)


def test_children_that_exit_as_they_start_make_the_start_fail_and_leave_nothing():
    loader = StreamingLoader(
        LoaderConfig(
            num_workers=2, timeout_s=20.0, plan=DecodePlan(size=64, fast=True), sources=FILES
        ),
        DiesOnArrival,
    )
    try:
        with pytest.raises(LoaderFailure, match="exited as it started"):
            loader.start()
        started = loader.child_pids()
    finally:
        loader.close()
    from tests.helpers import until_gone

    assert until_gone(started) == []


class HandsOverLargeImages(RequestStream):
    """Each image is 8 MB: far more than a pipe holds, so a child is caught mid-handover."""

    def finish(self, read):
        from datasets.images import Decoded
        from datasets.loader import Loaded

        pixels = np.zeros((3, 1000, 2800), dtype=np.uint8)
        return Loaded(read.request.key, Decoded(pixels, 2800, 1000), None, 0.0, os.getpid())


def test_a_child_stopped_halfway_through_handing_over_an_image_is_recovered_not_waited_on():
    loader = StreamingLoader(
        LoaderConfig(num_workers=1, timeout_s=2.0, plan=DecodePlan(size=64), sources=FILES),
        HandsOverLargeImages,
    )
    loader.start()
    try:
        (child,) = loader.child_pids()
        loader.submit([LoadRequest(1, "file:///not-read")])
        deadline = time.monotonic() + 30
        while not loader.ready():  # the child has begun writing the image into the pipe:
            assert time.monotonic() < deadline, "the child never began handing over"
            time.sleep(0.01)
        # 8 MB do not fit in a pipe: the child waits for us to read the rest.
        os.kill(child, signal.SIGSTOP)
        # Without the guard this read would block for ever (pytest-timeout would end it).
        with pytest.raises(LoaderFailure, match="stopped halfway through handing over"):
            loader.next_loaded()
        loader.restart()
        loader.submit([LoadRequest(2, "file:///not-read")])
        assert loader.next_loaded().key == 2  # the rebuilt loader serves
    finally:
        loader.close()


def test_ready_says_a_result_waits_without_waiting_for_a_child(loader, images):
    assert not loader.ready(), "nothing was asked for"
    loader.submit([LoadRequest(1, images[0])])
    deadline = time.monotonic() + 30
    while not loader.ready():
        assert time.monotonic() < deadline, "the result never came"
        time.sleep(0.01)
    item = loader.next_loaded()
    assert item.key == 1 and item.image is not None
    assert not loader.ready() and loader.outstanding() == 0
