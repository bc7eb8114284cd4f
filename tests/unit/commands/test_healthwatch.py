"""The supervisord event listener: which processes it restarts, and its wire protocol."""

from __future__ import annotations

import io
import threading

from worker.commands.healthwatch import RUNNING, HealthWatch, Probe, process_port, serve


class FakeSupervisor:
    def __init__(self, processes):
        self.processes = processes
        self.calls = []

    def getAllProcessInfo(self):
        return self.processes

    def stopProcess(self, name, wait):
        self.calls.append(("stop", name, wait))

    def startProcess(self, name, wait):
        self.calls.append(("start", name, wait))


class FakeRPC:
    def __init__(self, processes):
        self.supervisor = FakeSupervisor(processes)


def proc(name, state=RUNNING, start=0.0, group="inference-worker"):
    return {"name": name, "group": group, "state": state, "start": start}


def watch_with(processes, answers):
    rpc = FakeRPC(processes)
    asked = []

    def probe(url, _timeout):
        asked.append(url)
        return answers[url]

    watch = HealthWatch(
        rpc,
        "inference-worker",
        9460,
        failures=2,
        startup_grace_s=60,
        probe=probe,
        log=io.StringIO(),
    )
    return watch, rpc.supervisor.calls, asked


def test_a_stalled_or_silent_process_is_restarted_after_two_bad_ticks_and_a_healthy_one_is_not():
    ok, stalled, silent = Probe(True, "200"), Probe(False, "HTTP 503"), Probe(False, "no answer")
    answers = {  # the loopback listeners' /livez: the metrics ports + 1000
        "http://127.0.0.1:10460/livez": ok,
        "http://127.0.0.1:10461/livez": stalled,
        "http://127.0.0.1:10462/livez": silent,
    }
    procs = [proc("inference-worker_00"), proc("inference-worker_01"), proc("inference-worker_02")]
    watch, calls, _ = watch_with(procs, answers)

    assert watch.tick(now=1000) == []  # one strike each: not yet
    assert watch.tick(now=1005) == ["inference-worker_01", "inference-worker_02"]
    # Both stops asked at once, neither waited for
    assert calls == [
        ("stop", "inference-worker:inference-worker_01", False),
        ("stop", "inference-worker:inference-worker_02", False),
    ]
    # Still stopping (SIGKILL after stopwaitsecs): not started, not probed
    procs[1]["state"] = procs[2]["state"] = 40
    assert watch.tick(now=1010) == [] and len(calls) == 2
    # Stopped: both started at the next tick
    procs[1]["state"], procs[2]["state"] = 0, 100
    watch.tick(now=1015)
    assert calls[2:] == [
        ("start", "inference-worker:inference-worker_01", False),
        ("start", "inference-worker:inference-worker_02", False),
    ]


def test_every_process_is_probed_at_once_within_one_timeout():
    procs = [proc(f"inference-worker_{n:02d}") for n in range(16)]
    together = threading.Barrier(16, timeout=5)

    def probe(_url, _timeout):
        together.wait()  # all sixteen must be waiting at once, or this breaks
        return Probe(False, "no answer")

    watch = HealthWatch(FakeRPC(procs), "inference-worker", 9460, probe=probe, log=io.StringIO())
    watch.tick(now=1000)
    assert watch.strikes == {p["name"]: 1 for p in procs}


def test_the_probe_goes_to_the_worker_past_any_proxy(monkeypatch):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from worker.commands.healthwatch import probe

    class Answer(BaseHTTPRequestHandler):
        status = 503

        def do_GET(self):
            self.send_response(self.status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    class Proxy(Answer):
        status = 200

    worker, proxy = (
        ThreadingHTTPServer(("127.0.0.1", 0), Answer),
        ThreadingHTTPServer(("127.0.0.1", 0), Proxy),
    )
    for server in (worker, proxy):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in ("http_proxy", "HTTP_PROXY", "all_proxy"):
            monkeypatch.setenv(name, f"http://127.0.0.1:{proxy.server_address[1]}")
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        answer = probe(f"http://127.0.0.1:{worker.server_address[1]}/healthz", 5)
    finally:
        for server in (worker, proxy):
            server.shutdown()
            server.server_close()
    assert not answer.healthy and answer.reason.startswith("HTTP 503")


def test_a_recovering_process_loses_its_strikes():
    url = "http://127.0.0.1:10460/livez"
    answers = {url: Probe(False, "HTTP 503")}
    watch, calls, _ = watch_with([proc("inference-worker_00")], answers)
    watch.tick(now=1000)
    answers[url] = Probe(True, "200")
    watch.tick(now=1005)
    answers[url] = Probe(False, "HTTP 503")
    watch.tick(now=1010)
    assert calls == []


def test_starting_stopped_and_foreign_processes_are_left_alone():
    procs = [
        proc("inference-worker_00", start=990),
        proc("inference-worker_01", state=0),
        proc("other_00", group="other"),
    ]
    starting = "http://127.0.0.1:10460/livez"
    watch, calls, asked = watch_with(procs, {starting: Probe(False, "no answer")})
    for now in (1000, 1005, 1010):
        watch.tick(now=now)
    # the starting one is asked (its grace ends at its first healthy answer), never struck
    assert asked == [starting] * 3 and calls == [] and watch.strikes == {}


def test_a_process_that_answered_healthy_once_is_restarted_within_its_start_up_grace():
    url = "http://127.0.0.1:10460/livez"
    answers = {url: Probe(True, "200")}
    watch, calls, _ = watch_with([proc("inference-worker_00", start=990)], answers)
    assert watch.tick(now=1000) == []  # 10 s into a 60 s grace: up, so probed from now on
    answers[url] = Probe(False, "no answer")  # then frozen
    assert watch.tick(now=1005) == []
    assert watch.tick(now=1010) == ["inference-worker_00"]
    assert calls == [("stop", "inference-worker:inference-worker_00", False)]


def test_a_restarted_process_has_its_grace_again():
    url = "http://127.0.0.1:10460/livez"
    answers = {url: Probe(True, "200")}
    procs = [proc("inference-worker_00", start=990)]
    watch, calls, _ = watch_with(procs, answers)
    watch.tick(now=1000)
    procs[0] = proc("inference-worker_00", start=1020)  # started anew: not answering yet
    answers[url] = Probe(False, "no answer")
    for now in (1025, 1030, 1035):
        watch.tick(now=now)
    assert calls == [] and watch.strikes == {}


def test_ports_follow_the_process_name_convention():
    assert process_port("inference-worker_03", 9460) == 9463
    assert process_port("inference-worker", 9460) is None


def test_it_speaks_supervisors_event_listener_protocol():
    watch, _, _ = watch_with([], {})
    payload = "ver:3.0 server:supervisor serial:1 pool:hw poolserial:1 eventname:TICK_5 len:15\n"
    stdin = io.StringIO(payload + "when:1700000000")
    stdout = io.StringIO()
    serve(watch, stdin, stdout)
    assert stdout.getvalue() == "READY\nRESULT 2\nOKREADY\n"


def test_a_process_that_says_starting_is_given_up_to_max_start_s_and_then_struck():
    starting = Probe(False, "HTTP 503: starting: not serving tasks yet", starting=True)
    url = "http://127.0.0.1:10460/livez"
    answers = {url: starting}
    procs = [proc("inference-worker_00", start=0.0)]
    watch, calls, _ = watch_with(procs, answers)
    watch.max_start_s = 600
    # A slow start, long past the grace (60 s): no strike, whatever the number of ticks
    for now in range(100, 600, 5):
        assert watch.tick(now=now) == []
    assert calls == [] and watch.strikes == {}
    # Still starting past max_start_s: struck, then restarted
    assert watch.tick(now=605) == []
    assert watch.tick(now=610) == ["inference-worker_00"]
    assert "still starting 605s after it was started (--max-start-s 600)" in watch.log.getvalue()


def test_a_process_that_answered_once_and_then_says_starting_is_struck():
    url = "http://127.0.0.1:10460/livez"
    answers = {url: Probe(True, "HTTP 200")}
    procs = [proc("inference-worker_00", start=0.0)]
    watch, _calls, _ = watch_with(procs, answers)
    assert watch.tick(now=100) == []
    answers[url] = Probe(False, "HTTP 503: starting: not serving tasks yet", starting=True)
    assert watch.tick(now=105) == []
    assert watch.tick(now=110) == ["inference-worker_00"]
    # Its next run (a new start time) is given its start again
    procs[0]["start"] = 200.0
    watch.stopping.clear()
    assert [watch.tick(now=now) for now in (300, 305, 310)] == [[], [], []]


def test_the_probe_tells_a_starting_answer_from_a_stall():
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from worker.commands.healthwatch import probe

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self):
            body = self.path.strip("/").encode()
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert probe(f"{base}/starting:%20loading", 5).starting
        assert not probe(f"{base}/stalled:%20no%20batch", 5).starting
    finally:
        server.shutdown()
        server.server_close()


def test_a_worker_live_but_not_ready_is_never_struck_and_a_stalled_one_is():
    from config.settings import load_settings
    from worker.commands.localservers import free_port
    from worker.health.compose import ProcessHealth
    from worker.health.liveness import Liveness

    # Given a worker whose source is refused (not ready), on its own health listeners
    settings = load_settings(
        for_worker=False, metrics={"port": free_port(), "healthz_port": free_port()}
    )
    health = ProcessHealth(settings)
    health.listen()
    clock = [1000.0]
    liveness = Liveness(stall_timeout_s=30.0, clock=lambda: clock[0])
    refused = "NATS refused a job consumer on stream TASKS: maximum consumers limit reached"
    health.serve(liveness, lambda: refused)
    rpc = FakeRPC([proc("inference-worker_00", start=0.0)])
    log = io.StringIO()
    watch = HealthWatch(
        rpc,
        "inference-worker",
        health.port,
        failures=2,
        startup_grace_s=60,
        log=log,
        healthz_port_base=health.healthz_port,
    )
    try:
        # When healthwatch probes it tick after tick: no strike, no restart
        assert [watch.tick(now=t) for t in range(1000, 1060, 5)] == [[]] * 12
        assert watch.strikes == {} and rpc.supervisor.calls == [], log.getvalue()
        # When it stalls: restarted at the second strike, as ever
        liveness.set_held(2)
        clock[0] += 31
        assert watch.tick(now=1060) == []
        assert watch.tick(now=1065) == ["inference-worker_00"]
    finally:
        health.close()
    assert "(1/2): HTTP 503: stalled: 2 tasks held" in log.getvalue()


def test_a_worker_without_livez_is_probed_on_healthz_as_before():
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from worker.commands.healthwatch import probe

    healthz = [503]

    class Older(BaseHTTPRequestHandler):  # a worker of a release before /livez
        def do_GET(self):
            status = healthz[0] if self.path == "/healthz" else 404
            body = b"stalled: 1 task held" if status == 503 else b""
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Older)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/livez"
        stalled = probe(url, 5)
        healthz[0] = 200
        ok = probe(url, 5)
    finally:
        server.shutdown()
        server.server_close()
    assert not stalled.healthy and stalled.reason == "HTTP 503: stalled: 1 task held"
    assert ok.healthy
