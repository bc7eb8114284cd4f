"""A DataLoader whose worker processes persist for the life of the worker process.

The dataset is an endless stream: loader workers take load requests from a multiprocessing
queue, fetch several objects at once (``datasets.reads``), decode each image by the pipeline's
``DecodePlan`` as its read completes, and hand back one uint8 array (or an error) per
request. Arrays travel pickled through the result pipe, not as torch tensors in shared memory:
for an image of the pipeline's input size the copy is cheaper than torch's per-tensor /dev/shm
file and descriptor hand-over, and a child that dies mid-send leaves no shared-memory file
behind. The main process keeps a single iterator open, so the same
children serve job after job, and calls ``next`` only for requests it has submitted, each
bounded by the DataLoader ``timeout``.

When a child dies, stops or loses a batch, the timeout fires; ``restart`` then SIGKILLs
every child (stopped ones included), replaces the fork server if it is stopped or does not
report its children's exits, closes every queue, and builds a fresh loader. A child that
cannot be killed (uninterruptible sleep) is abandoned, never waited on.

Threads: every DataLoader call (start, next, restart, close) happens on the engine thread.
``submit`` may be called from any thread and never waits on a rebuild: requests made while
one is under way wait in a backlog and go to the new loader.

What of torch this relies on (tested with torch 2.14.1, forkserver, spawn and fork): a
``DataLoader`` over an ``IterableDataset`` with ``timeout``, ``worker_init_fn``,
``prefetch_factor`` and ``in_order=False``; and, in ``_Generation`` and ``ready`` only, the
iterator's ``_workers``, ``_index_queues``, ``_worker_result_queue`` (and its ``_writer``),
``_workers_done_event``, ``_shutdown`` and ``_worker_pids_set``. torch's own
``_shutdown_workers`` is not used: it sets an event whose lock a killed child may hold, and
waits 5 s per child it cannot join.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset

from config.errors import Failure, LoaderFailure, WorkerError
from datasets import http_transport, processes, rundir
from datasets.images import Decoded, DecodePlan, decode
from datasets.reads import Read, ReadPool, ReadStats
from datasets.semaphores import semlock_names, unlink_names, wait_until_mapped
from datasets.uris import SourceConfig, read_bytes

FORKSERVER_PRELOAD = ["torch", "numpy", "PIL.Image", "boto3", "botocore.config", "datasets.loader"]
_POLL_S = 0.5
_KILL_WAIT_S = 2.0
_STUCK_GRACE_S = 2.0  # after the DataLoader timeout, a read still stuck is a stopped writer


class LoadRequest(NamedTuple):
    key: int
    uri: str
    plan: DecodePlan | None = None  # its pipeline's; None: the loader's own (LoaderConfig.plan)


class Loaded(NamedTuple):
    """One request's outcome, made in a loader child: an image, or the failure."""

    key: int
    image: Decoded | None  # (3, H, W) uint8 and the source's size
    failure: Failure | None
    load_s: float
    pid: int
    retries: tuple[str, ...] = ()  # why each retry of the read was made
    reads: ReadStats | None = None  # the child's reads as it handed this one over


@dataclass(frozen=True)
class LoaderConfig:
    num_workers: int
    timeout_s: float
    plan: DecodePlan
    sources: SourceConfig = field(default_factory=SourceConfig)
    mp_context: str = "forkserver"
    # Requests a child may run ahead of the main thread's ``next`` calls. It must cover every
    # request the worker can hold, or children idle while the main thread runs the model.
    prefetch_per_worker: int = 2


def decode_read(read: Read, plan: DecodePlan) -> Loaded:
    """A finished read, decoded by ``plan`` (or its failure), as the main process gets it."""
    started = time.perf_counter()
    image, failure = None, read.failure
    if read.data is not None:
        try:
            image = decode(read.data, plan)
        except WorkerError as error:
            failure = error.failure()
        except Exception as error:  # noqa: BLE001 - one bad image must not kill a loader child
            failure = Failure("load_failed", f"{type(error).__name__}: {error}")
    load_s = read.read_s + time.perf_counter() - started
    return Loaded(read.request.key, image, failure, load_s, os.getpid(), read.retries)


class RequestStream(IterableDataset[Loaded]):
    """Endless dataset: yields one Loaded per request taken from ``requests``.

    Reads overlap (``datasets.reads``: ``sources.reads_in_flight`` at once, bounded in bytes
    by ``sources.read_bytes_in_flight``); images are decoded one at a time as reads complete.
    Picklable (its queues travel to the children when they are started). Each child reports
    its pid on ``reports`` when it starts, so the worker learns its children from them.
    """

    def __init__(
        self, requests: Any, reports: Any, plan: DecodePlan, sources: SourceConfig
    ) -> None:
        self.requests = requests
        self.reports = reports
        self.plan = plan
        self.sources = sources
        # The worker's main process. Our parent is the fork server, which lives on as long as
        # any of its children do, so "parent gone" never fires when the main process dies.
        self.owner_pid = os.getpid()
        self.owner_started = processes.start_time(self.owner_pid)

    def __iter__(self) -> Iterator[Loaded]:
        sources = self.sources
        pool = ReadPool(
            self.requests,
            lambda uri, reading: read_bytes(uri, sources, reading),
            sources.reads_in_flight,
            sources.read_bytes_in_flight,
        ).start()
        try:
            while (read := pool.next_read()) is not None:
                loaded = self.finish(read)
                yield loaded._replace(reads=pool.finished(read))
        finally:
            pool.close()
            http_transport.close_idle()

    def finish(self, read: Read) -> Loaded:
        plan = getattr(read.request, "plan", None)
        return decode_read(read, plan if plan is not None else self.plan)


MakeStream = Callable[[Any, Any, DecodePlan, SourceConfig], RequestStream]


def _exit_with_owner(owner_pid: int, owner_started: int | None) -> None:
    """Leave as soon as the worker's main process is gone (SIGKILL, watchdog exit).

    A thread, because the child's main thread may be anywhere: in our dataset, or in torch's
    worker loop, which only watches the parent, i.e. the fork server, and that lives on as
    long as any of its children do.
    """
    while processes.start_time(owner_pid) == owner_started:
        time.sleep(_POLL_S)
    os._exit(0)


def _as_is(item: Any) -> Any:
    """The DataLoader's collate step: none (its default turns arrays into shared tensors)."""
    return item


def _init_child(_worker_id: int) -> None:
    # supervisord signals the whole group on stop; the main process decides when children
    # end, so a drain can finish the batch in hand.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    rundir.mark_child()
    info = torch.utils.data.get_worker_info()
    dataset = info.dataset if info is not None else None
    if isinstance(dataset, RequestStream):
        dataset.reports.put((_worker_id, os.getpid()))
        threading.Thread(
            target=_exit_with_owner,
            args=(dataset.owner_pid, dataset.owner_started),
            name="owner-watch",
            daemon=True,
        ).start()


def _close_mp_queue(q: Any) -> None:
    """Close a multiprocessing queue without waiting on readers that may be dead."""
    q.cancel_join_thread()
    q._ignore_epipe = True  # a feeder blocked on a full pipe now gives up instead of hanging
    q._reader.close()
    q.close()
    thread = getattr(q, "_thread", None)
    if thread is not None:
        thread.join(timeout=1.0)
    q._writer.close()


class _Generation:
    """One DataLoader iterator, its queues and its children; the torch adapter."""

    def __init__(self, it: Any, requests: Any, reports: Any) -> None:
        self.it = it
        self.requests = requests
        self.reports = reports
        self.child_pids: list[int] = []  # as the children reported them
        self.unstuck = False  # set by the guard of a read stuck on a stopped child

    def await_reports(self, count: int, timeout_s: float) -> bool:
        """Learn the children's pids from the children (each reports once it runs); True when
        all did. Stops waiting as soon as a child has exited; for a silent one, the pids
        multiprocessing started stand in."""
        deadline = time.monotonic() + timeout_s
        found: dict[int, int] = {}
        while len(found) < count and time.monotonic() < deadline:
            if any(w.exitcode is not None for w in self.workers()):
                break
            try:
                worker_id, pid = self.reports.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            found[int(worker_id)] = int(pid)
        self.child_pids = [found[i] for i in sorted(found)]
        if len(found) < count:
            self.child_pids = self.known_pids()
            return False
        return True

    def unstick(self) -> None:
        """A read of the result pipe is stuck on a half-written message: kill every child
        (each holds a write end) and close ours, so the read ends with EOF."""
        self.unstuck = True
        processes.kill(self.known_pids())
        writer = getattr(self.it._worker_result_queue, "_writer", None)
        if writer is not None:
            writer.close()

    def any_exited(self) -> bool:
        return any(w.exitcode is not None for w in self.workers())

    def workers(self) -> list[Any]:
        return list(self.it._workers)

    def known_pids(self) -> list[int]:
        """Every child we know of: reported, or started but silent (a failed start)."""
        started = {w.pid for w in self.workers() if w.pid is not None}
        return sorted(started | set(self.child_pids))

    def semaphore_names(self) -> tuple[set[str], list[set[str]]]:
        it = self.it
        shared = semlock_names(self.requests) | semlock_names(it._worker_result_queue)
        shared |= semlock_names(it._workers_done_event) | semlock_names(self.reports)
        return shared, [semlock_names(q) for q in it._index_queues]

    def disown(self) -> None:
        """Before we kill the children: torch's SIGCHLD check must not take their deaths for
        a failure (they reach us as orphans once the fork server is replaced), and its
        ``__del__`` must not run its own, blocking, shutdown."""
        it = self.it
        it._shutdown = True
        if getattr(it, "_worker_pids_set", False):
            from torch.utils.data import _utils

            _utils.signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False

    def retire(self) -> list[Any]:
        """Close every queue and Process object of ours once the children are killed; return
        the Process objects multiprocessing still thinks are running (kept, closed later)."""
        it = self.it
        for q in [*it._index_queues, it._worker_result_queue, self.requests, self.reports]:
            _close_mp_queue(q)
        return close_processes(self.workers())


def close_processes(workers: list[Any]) -> list[Any]:
    """Close what can be closed; return the ones multiprocessing still believes alive."""
    left = []
    for w in workers:
        try:
            w.close()
        except ValueError:  # "Cannot close a process while it is still running"
            left.append(w)
    return left


_open_loaders: set[int] = set()  # loaders of this process that are started and not closed


class StreamingLoader:
    def __init__(self, config: LoaderConfig, make_stream: MakeStream = RequestStream) -> None:
        self.config = config
        self._make_stream = make_stream  # another only where the wiring installs a fault
        self._ctx = mp.get_context(config.mp_context)
        if config.mp_context == "forkserver":
            self._ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._lock = threading.Lock()  # guards the request side: _requests, _outstanding
        self._requests: Any = None  # None while stopped or rebuilding
        self._gen: _Generation | None = None  # touched by the engine thread only
        self._outstanding: dict[int, LoadRequest] = {}
        self._backlog: list[LoadRequest] = []
        self._abandoned: list[Any] = []  # Process objects whose end was never reported
        self.restarts = 0

    # -- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        processes.become_subreaper()
        _open_loaders.add(id(self))
        self._start_generation()

    def _start_generation(self) -> None:
        why = processes.forkserver_unfit() if self.config.mp_context == "forkserver" else None
        if why:
            processes.stop_forkserver(_KILL_WAIT_S)
        processes.replace_stopped_tracker(_KILL_WAIT_S)
        requests, reports = self._ctx.Queue(), self._ctx.Queue()
        dataset = self._make_stream(requests, reports, self.config.plan, self.config.sources)
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.config.num_workers,
            multiprocessing_context=self._ctx,
            timeout=self.config.timeout_s,
            worker_init_fn=_init_child,
            collate_fn=_as_is,
            prefetch_factor=self.config.prefetch_per_worker,
            in_order=False,
        )
        gen = _Generation(iter(loader), requests, reports)
        self._gen = gen  # from here on, a teardown kills its children whatever happens next
        if not gen.await_reports(self.config.num_workers, self.config.timeout_s):
            if gen.any_exited():
                raise LoaderFailure("a loader child exited as it started", kind="loader_failed")
        else:
            self._unlink_semaphores(gen)  # only with every child known by its worker id
        with self._lock:
            self._requests = requests
            for request in self._backlog:
                requests.put(request)
            self._backlog.clear()

    def close(self) -> None:
        """Stop every child (SIGKILL; they hold nothing we still need), the fork server too,
        and reap them all: when the worker's exit status can be read, they are gone."""
        with self._lock:
            self._requests = None
            self._outstanding.clear()
            self._backlog.clear()
        self._teardown()
        _open_loaders.discard(id(self))
        if self.config.mp_context == "forkserver" and not _open_loaders:
            processes.stop_forkserver(_KILL_WAIT_S)  # shared by every loader of the process
        self._abandoned = close_processes(self._abandoned)
        processes.replace_stopped_tracker(_KILL_WAIT_S)

    def restart(self) -> list[LoadRequest]:
        """Replace the loader; return the requests that were submitted and never came back.

        ``submit`` does not wait meanwhile: what it is given goes to the new loader.
        """
        with self._lock:
            lost = list(self._outstanding.values())
            self._outstanding.clear()
            self._requests = None
        self._teardown()
        self.restarts += 1
        self._abandoned = close_processes(self._abandoned)
        try:
            self._start_generation()
        except Exception as error:  # noqa: BLE001 - no loader: the caller gives up on it
            raise LoaderFailure(
                f"cannot start a new loader: {type(error).__name__}: {error}", kind="loader_failed"
            ) from None
        return lost

    def _unlink_semaphores(self, gen: _Generation) -> None:
        """Once the children have opened them, unlink this generation's semaphore names."""
        shared, own = gen.semaphore_names()
        wanted = {
            pid: {name.lstrip("/") for name in shared | own[i]}
            for i, pid in enumerate(gen.child_pids)
        }
        if wait_until_mapped(wanted, timeout_s=self.config.timeout_s):
            unlink_names(shared.union(*own))

    def _teardown(self) -> None:
        gen, self._gen = self._gen, None
        if gen is None:
            return
        pids = gen.known_pids()
        gen.disown()
        processes.kill(pids)
        unkillable = processes.wait_gone(pids, _KILL_WAIT_S)
        if self.config.mp_context == "forkserver" and (
            processes.forkserver_unfit() or unkillable or self._exits_unreported(gen)
        ):
            # The fork server reports its children's exits; one that does not (stopped) is
            # replaced, and the children it leaves behind become ours (subreaper) to reap.
            processes.stop_forkserver(_KILL_WAIT_S)
            processes.wait_gone(pids, _KILL_WAIT_S, reap_them=True)
        self._abandoned.extend(gen.retire())

    @staticmethod
    def _exits_unreported(gen: _Generation) -> bool:
        """Children dead by /proc whose exit multiprocessing has not heard of in time."""
        deadline = time.monotonic() + _KILL_WAIT_S
        while any(w.is_alive() for w in gen.workers()):
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.02)
        return False

    # -- data path ----------------------------------------------------------------------
    def submit(self, requests: Sequence[LoadRequest]) -> None:
        """Queue loads, from any thread; never waits on a rebuild."""
        with self._lock:
            for request in requests:
                self._outstanding[request.key] = request
            if self._requests is None:
                self._backlog.extend(requests)  # rebuilding: the new loader gets them
                return
            for request in requests:
                self._requests.put(request)

    def next_loaded(self) -> Loaded:
        """The next finished request; LoaderFailure when none came within the timeout.

        The DataLoader's timeout covers waiting for a result to start; it does not cover
        reading one. A child stopped (SIGSTOP, a cgroup freeze) halfway through writing an
        image into the result pipe leaves the reader blocked on the rest forever, so a guard
        fires ``_STUCK_GRACE_S`` after the timeout: it kills the children and closes our own
        end of that pipe, the read ends with EOF, and the loader is rebuilt as after a timeout.
        """
        gen = self._gen
        if gen is None:
            raise LoaderFailure("the loader is not running", kind="loader_stopped")
        guard = threading.Timer(self.config.timeout_s + _STUCK_GRACE_S, gen.unstick)
        guard.daemon = True
        guard.start()
        try:
            loaded: Loaded = next(gen.it)
        except Exception as error:  # noqa: BLE001 - any failure here means a broken loader
            # A timeout, a dead child (RuntimeError), or a child killed mid-handover
            # (ConnectionResetError or EOFError while unpickling): rebuild.
            why = f"{type(error).__name__}: {error}"
            if gen.unstuck:
                why = f"a loader child stopped halfway through handing over an image ({why})"
            raise LoaderFailure(f"DataLoader failed: {why}", kind="loader_failed") from None
        finally:
            guard.cancel()
        with self._lock:
            self._outstanding.pop(loaded.key, None)
        return loaded

    def ready(self) -> bool:
        """Whether a finished request waits in the result queue, so ``next_loaded`` returns it
        without waiting for a child (a poll of the queue's pipe; ``in_order=False`` keeps no
        results aside)."""
        gen = self._gen
        return gen is not None and not gen.it._worker_result_queue.empty()

    def outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    def unhealthy_children(self) -> list[str]:
        """Children (and the fork server) that are stopped, dead or zombies; from /proc."""
        found = []
        for pid in self.child_pids():
            current = processes.state(pid)
            if current is None:
                found.append(f"{pid}:gone")
            elif current in (*processes.STOPPED_STATES, *processes.DEAD_STATES):
                found.append(f"{pid}:{current}")
        if self.config.mp_context == "forkserver":
            why = processes.forkserver_unfit()
            if why:
                found.append(why)
        return found

    def child_pids(self) -> list[int]:
        gen = self._gen
        return list(gen.child_pids) if gen is not None else []

    def kill_children(self) -> None:
        """Last resort from any thread, when the loader's own thread is wedged: SIGKILL them."""
        processes.kill(self.child_pids())

    def kill_all(self) -> None:
        """Last resort before exit when the loader's thread is wedged: the children, then the
        fork server (killed and reaped), so none outlives the process."""
        pids = self.child_pids()
        processes.kill(pids)
        processes.wait_gone(pids, _KILL_WAIT_S)
        if self.config.mp_context == "forkserver":
            processes.stop_forkserver(_KILL_WAIT_S)
            processes.wait_gone(pids, _KILL_WAIT_S, reap_them=True)
