"""The supervisord event listener: which processes it restarts, and its wire protocol."""

from __future__ import annotations

import io

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
    answers = {
        "http://127.0.0.1:9460/healthz": ok,
        "http://127.0.0.1:9461/healthz": stalled,
        "http://127.0.0.1:9462/healthz": silent,
    }
    procs = [proc("inference-worker_00"), proc("inference-worker_01"), proc("inference-worker_02")]
    watch, calls, _ = watch_with(procs, answers)

    assert watch.tick(now=1000) == []  # one strike each: not yet
    assert watch.tick(now=1005) == ["inference-worker_01", "inference-worker_02"]
    assert calls == [
        ("stop", "inference-worker:inference-worker_01", True),
        ("start", "inference-worker:inference-worker_01", False),
        ("stop", "inference-worker:inference-worker_02", True),
        ("start", "inference-worker:inference-worker_02", False),
    ]


def test_a_recovering_process_loses_its_strikes():
    url = "http://127.0.0.1:9460/healthz"
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
    watch, calls, asked = watch_with(procs, {})
    for now in (1000, 1005, 1010):
        watch.tick(now=now)
    assert asked == [] and calls == []


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
