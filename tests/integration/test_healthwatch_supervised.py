"""healthwatch under the project's own supervisord config, as an attacker or a careless operator
meets it (issue 23): idle connections to /metrics, a worker bound to one address, a proxy in
the environment, and several workers frozen at once. Real supervisord throughout; real workers
where one process is enough, the worker's own health listeners (``healthz_process``) where
several are frozen."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import signal
import socket
import sys
import threading
import time
import urllib.request

import pytest

from tests.helpers import client
from tests.integration.supervisord import GROUP, Supervisord
from tests.integration.test_job_consumers import _result as job_result
from tests.integration.test_job_consumers import fill_consumers, limited_nats, small_images
from tests.integration.test_supervisor import supervised_env
from worker.commands.job_client import make_tasks, publish_tasks
from worker.commands.localservers import free_port

pytestmark = [pytest.mark.integration, pytest.mark.supervisord, pytest.mark.slow]
IDLE_CONNECTIONS = 24  # over the /metrics listener's 16 slots
STOPWAITSECS = 6


@pytest.fixture
def supervisors():
    started: list[Supervisord] = []
    yield started
    for sup in started:
        assert sup.stop() == [], "supervisord left processes behind"


@pytest.fixture
def supervised_worker(tmp_path, nats_server, settings_for, supervisors):
    def start(env: dict[str, str] | None = None, **worker: str) -> Supervisord:
        settings = settings_for(nats_server.url)
        sup = Supervisord(tmp_path / "sup", supervised_env(settings, **worker), env=env)
        supervisors.append(sup.start())
        return sup

    return start


def healthwatch_probes(sup: Supervisord, host: str = "127.0.0.1", index: int = 0) -> int:
    """How many /healthz requests process ``index``'s loopback listener answered (its metric)."""
    try:
        _, text = sup.get("/metrics", host=host, index=index)
    except OSError:  # not listening (restarting): nothing counted
        return 0
    found = re.search(
        r'^inference_worker_healthz_requests_total\{listener="healthwatch"\} (\S+)$', text, re.M
    )
    return int(float(found.group(1))) if found else 0


def past_grace(sup: Supervisord, index: int = 0, host: str = "127.0.0.1") -> int:
    """Wait until healthwatch has had a healthy answer from process ``index`` (its start-up
    grace ends there: it acts on every answer from now on); the probes counted so far."""
    deadline = time.monotonic() + 90
    while (probes := healthwatch_probes(sup, host, index)) < 1:
        assert time.monotonic() < deadline, f"never probed by healthwatch:\n{sup.logs()}"
        time.sleep(0.3)
    return probes


def probed_and_never_restarted(sup: Supervisord, pid: int, probes: int, host: str = "127.0.0.1"):
    """Wait until healthwatch has probed the worker ``probes`` times (its loopback listener's
    count), the worker never restarted meanwhile."""
    deadline = time.monotonic() + 60
    while healthwatch_probes(sup, host) < probes:
        assert sup.worker_pid() == pid, f"restarted:\n{healthwatch_log(sup)}"
        assert time.monotonic() < deadline, f"not probed {probes} times:\n{sup.logs()}"
        time.sleep(0.5)
    assert sup.worker_pid() == pid, f"restarted:\n{healthwatch_log(sup)}"
    assert "restarting" not in healthwatch_log(sup), healthwatch_log(sup)


def healthwatch_log(sup: Supervisord) -> str:
    path = sup.run_dir / "healthwatch.log"
    return path.read_text(errors="replace") if path.exists() else ""


class IdleConnections:
    """``count`` connections to ``port`` that send nothing, each replaced as soon as the
    server closes it (as an attacker would), until stopped."""

    def __init__(self, port: int, count: int) -> None:
        self._port, self._count = port, count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)
        self.opened = 0

    def __enter__(self) -> IdleConnections:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _hold(self) -> None:
        held: list[socket.socket] = []
        try:
            while not self._stop.is_set():
                while len(held) < self._count:
                    with contextlib.suppress(OSError):
                        held.append(socket.create_connection(("127.0.0.1", self._port), 2))
                        self.opened += 1
                readable, _, _ = select.select(held, [], [], 0.1)
                for sock in readable:  # closed by the server (refused, or cut at its deadline)
                    held.remove(sock)
                    sock.close()
        finally:
            for sock in held:
                sock.close()


def test_idle_connections_to_metrics_do_not_make_healthwatch_restart_a_healthy_worker(
    supervised_worker,
):
    sup = supervised_worker()
    pid = sup.worker_pid()
    sup.wait_healthy()
    before = past_grace(sup)  # healthwatch acts on its answers from now on
    # When a peer holds more idle connections than /metrics has slots, for four ticks
    with IdleConnections(sup.port_base, IDLE_CONNECTIONS) as attack:
        ticks, deadline = sup.healthwatch_ticks(), time.monotonic() + 90
        while sup.healthwatch_ticks() < ticks + 4:
            assert time.monotonic() < deadline, f"healthwatch stopped ticking:\n{sup.logs()}"
            assert sup.worker_pid(timeout_s=5) == pid, f"restarted:\n{healthwatch_log(sup)}"
            time.sleep(0.5)
    assert attack.opened >= IDLE_CONNECTIONS
    # Then healthwatch kept probing, found it healthy, and restarted nothing
    assert healthwatch_probes(sup) >= before + 3
    assert sup.worker_pid() == pid
    assert "unhealthy" not in healthwatch_log(sup) and "restarting" not in healthwatch_log(sup)


def test_idle_local_connections_to_the_healthwatch_listener_do_not_get_a_worker_restarted(
    supervised_worker,
):
    sup = supervised_worker()
    pid = sup.worker_pid()
    sup.wait_healthy()
    past_grace(sup)
    before = healthwatch_probes(sup)
    # When a local process holds 10 idle connections to the loopback /healthz listener (it had
    # 8 slots), replacing each as soon as it is closed, for four ticks
    loopback = sup.port_base + 1000
    with IdleConnections(loopback, 10) as attack:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(0.5)
            assert sup.worker_pid(timeout_s=5) == pid, f"restarted:\n{healthwatch_log(sup)}"
        # Then /healthz there still answers, and healthwatch found the worker healthy
        with urllib.request.urlopen(f"http://127.0.0.1:{loopback}/healthz", timeout=5) as answer:
            assert answer.status == 200
    assert attack.opened >= 10
    assert healthwatch_probes(sup) >= before + 3
    assert sup.worker_pid() == pid
    assert "unhealthy" not in healthwatch_log(sup) and "restarting" not in healthwatch_log(sup)


def test_a_worker_serving_metrics_on_one_address_is_not_restarted_by_healthwatch(
    supervised_worker,
):
    sup = supervised_worker(WORKER_METRICS__HOST="127.0.0.2")  # "one interface"
    pid = sup.worker_pid()
    sup.wait_healthy(host="127.0.0.2")
    past_grace(sup, host="127.0.0.2")
    probed_and_never_restarted(sup, pid, probes=3, host="127.0.0.2")


def test_a_proxy_in_the_environment_does_not_answer_for_the_worker(supervised_worker):
    dead_proxy = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxies = {"http_proxy": dead_proxy, "HTTP_PROXY": dead_proxy, "all_proxy": dead_proxy}
    sup = supervised_worker(env={**proxies, "no_proxy": "", "NO_PROXY": ""})
    pid = sup.worker_pid()
    sup.wait_healthy()
    past_grace(sup)
    probed_and_never_restarted(sup, pid, probes=3)


SLOW_LOAD_S = 40  # the model build, against healthwatch's 15 s start-up grace here


def test_a_start_slower_than_the_grace_is_served_not_restarted(supervised_worker):
    # Given a worker whose model takes 40 s to build, under a start-up grace of 15 s
    sup = supervised_worker(WORKER_FAULTS__SLOW_LOAD_S=str(SLOW_LOAD_S))
    pid = sup.worker_pid()
    # When healthwatch probes it while it says `503 starting`, then it serves
    deadline = time.monotonic() + SLOW_LOAD_S + 90
    while not _healthy(sup):
        assert sup.worker_pid(timeout_s=30) == pid, f"restarted:\n{healthwatch_log(sup)}"
        assert time.monotonic() < deadline, f"never served:\n{sup.logs()}"
        time.sleep(0.5)
    # Then the first process is the one that serves: probed while starting, never restarted
    assert sup.worker_pid() == pid, f"restarted:\n{healthwatch_log(sup)}"
    assert "fault_hook_slow_model_load" in sup.worker_log()
    assert healthwatch_probes(sup) >= 2, sup.logs()  # probed past the grace, while starting
    assert "unhealthy" not in healthwatch_log(sup), healthwatch_log(sup)
    assert "restarting" not in healthwatch_log(sup), healthwatch_log(sup)


def _healthy(sup: Supervisord) -> bool:
    try:
        return sup.get("/healthz")[0] == 200
    except OSError:
        return False


def test_workers_frozen_together_are_restarted_together_within_one_stop(tmp_path, supervisors):
    processes = 4
    sup = Supervisord(
        tmp_path / "sup",
        {},
        stopwaitsecs=STOPWAITSECS,
        numprocs=processes,
        command=f"{sys.executable} -m tests.integration.healthz_process",
    )
    supervisors.append(sup.start())
    pids = [sup.worker_pid(index=n) for n in range(processes)]
    rpc = sup.rpc()
    # Past their start-up grace (healthwatch acts on their answers from then on), all frozen
    for n in range(processes):
        past_grace(sup, index=n)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    restarted_at: dict[int, float] = {}
    deadline = frozen_at + 120
    while len(restarted_at) < processes:
        assert time.monotonic() < deadline, f"restarted: {restarted_at}\n{sup.logs()}"
        for n in set(range(processes)) - set(restarted_at):
            info = rpc.supervisor.getProcessInfo(f"{GROUP}:{GROUP}_{n:02d}")
            if info["statename"] == "RUNNING" and info["pid"] != pids[n]:
                restarted_at[n] = time.monotonic() - frozen_at
        time.sleep(0.2)
    spread_s = max(restarted_at.values()) - min(restarted_at.values())
    print(f"\nrestarted after {sorted(round(t, 1) for t in restarted_at.values())} s")
    # One stop for all: the old listener, waiting for each, started them STOPWAITSECS apart
    assert spread_s < STOPWAITSECS / 2, restarted_at
    log = healthwatch_log(sup)
    assert all(f"restarting {GROUP}:{GROUP}_{n:02d}" in log for n in range(processes))
    assert "overflowed" not in (sup.run_dir / "supervisord.log").read_text(errors="replace")


# -- liveness apart from readiness (issue 41) ------------------------------------------------
REFUSED_TICKS = 12  # healthwatch's TICK_5: a minute of the server refusing


@pytest.mark.timeout(420)
async def test_a_server_refusing_a_job_consumer_gets_no_restart_and_a_stall_still_does(
    tmp_path, s3_server, bucket, settings_for, supervisors
):
    uris = small_images(s3_server.client(), bucket, REFUSED_TICKS + 4)
    wedge = tmp_path / "wedge"
    wedge.touch()  # held: the process that creates it wedges its engine, so none does yet
    with limited_nats(tmp_path) as url:
        settings = settings_for(url)
        n, pipeline = settings.nats, settings.model.pipeline
        env = supervised_env(
            settings,
            WORKER_NATS__JOB_DISCOVERY_S="0.2",
            WORKER_NATS__JOB_CONSUMER_LINGER_S="300",
            WORKER_HEALTH__WATCHDOG_TIMEOUT_S="0",  # healthwatch alone acts on the stall
            WORKER_FAULTS__WEDGE_ONCE_FILE=str(wedge),
            WORKER_FAULTS__WEDGE_MODE="sleep",
        )
        sup = Supervisord(tmp_path / "sup", env)
        supervisors.append(sup.start())
        pid = sup.worker_pid()
        sup.wait_healthy()
        past_grace(sup)  # healthwatch acts on its answers from now on
        async with client(settings) as js:
            # Given a job being served, then another client's consumers filling the limit
            served = iter(make_tasks("job-served", uris))
            first = next(served)
            await publish_tasks(js, n, pipeline, [first])
            assert (await job_result(js, settings, first, 30))["status"] == "ok"
            other, _ = await fill_consumers(url, n.tasks_stream)
            try:
                # When a new job comes, its consumer refused: the worker is not ready
                await publish_tasks(js, n, pipeline, make_tasks("job-waiting", uris[:1]))
                await refused_on_healthz(sup)
                # Then for a minute of healthwatch's ticks the served job goes on, the
                # refusal lasts, and the worker is never restarted
                first_probe = healthwatch_probes(sup)
                for probed in range(first_probe + 1, first_probe + REFUSED_TICKS + 1):
                    deadline = time.monotonic() + 30
                    while healthwatch_probes(sup) < probed:  # one task served per tick
                        assert sup.worker_pid(timeout_s=5) == pid, healthwatch_log(sup)
                        assert time.monotonic() < deadline, f"not probed:\n{sup.logs()}"
                        await asyncio.sleep(0.5)
                    task = next(served)
                    await publish_tasks(js, n, pipeline, [task])
                    assert (await job_result(js, settings, task, 30))["status"] == "ok"
                    await refused_on_healthz(sup)
                assert sup.worker_pid() == pid, f"restarted:\n{healthwatch_log(sup)}"
                assert sup.get("/livez") == (200, "ok\n")
                assert "unhealthy" not in healthwatch_log(sup), healthwatch_log(sup)
                # When its engine stalls on the served job's next batch
                wedge.unlink()
                await publish_tasks(js, n, pipeline, [next(served)])
                stalled_at, deadline = time.monotonic(), time.monotonic() + 90
                while sup.worker_pid(timeout_s=30) == pid:
                    assert time.monotonic() < deadline, f"never restarted:\n{sup.logs()}"
                    await asyncio.sleep(0.5)
            finally:
                await other.close()
    # Then healthwatch restarted it for the stall, at its second strike as ever
    log = healthwatch_log(sup)
    print(f"\nrestarted {time.monotonic() - stalled_at:.1f}s after the stall began:\n{log}")
    strikes = re.findall(r"unhealthy \((\d)/2\): HTTP 503: (\w+)", log)
    assert strikes == [("1", "stalled"), ("2", "stalled")], log
    assert f"restarting {GROUP}:{GROUP}_00" in log and "refused" not in log, log


async def refused_on_healthz(sup: Supervisord) -> None:
    """Wait until /healthz (readiness, as it always answered) names the refusal."""
    deadline = time.monotonic() + 30
    while (answer := await asyncio.to_thread(sup.get, "/healthz"))[0] != 503:
        assert time.monotonic() < deadline, f"/healthz: {answer}"
        await asyncio.sleep(0.2)
    assert "refused a job consumer" in answer[1], answer
