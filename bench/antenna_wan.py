"""The Antenna source across a WAN: a fake Antenna and an image host behind a delayed link.

    .venv/bin/python -m bench.antenna_wan [--tasks 300] [--rtt-ms 60] [--http] [--nats]
                                          [--rounds 3] [--smoke]

Antenna at a public site and GPU hosts on a university cluster, 30-80 ms apart, HTTPS
(issue 33, "The WAN between"). Here: the fake Antenna (``tests/antenna_fake.py``) and an image
host (a second one serving ``/media/``), each over HTTPS with a CA of its own (``SSL_CERT_FILE``)
and each behind a TCP relay that delays every chunk by half the RTT each way (``relay``, a
child process), against the same with no relay. One job of ``--tasks`` tasks of 1280x720
JPEGs (20 distinct, cycled: the loader keeps no cache), the demo detector and colour classifier, one
``worker run --until-idle``.

Reported per case: end-to-end tasks/s (from the first result saved to the last), Antenna
requests per task, Antenna connections (TCP and TLS handshakes) per task, image connections
per task; and the shaped/direct ratio. The two cases run alternately ``--rounds`` times (a
single pair varied from 0.72 to 1.08 on one machine within two hours): each figure reported is
the median of its rounds, the ratio the median of the rounds' ratios. ``--nats``: the same
two cases with the tasks from a local NATS server instead (the same images, behind the same
relay). Every task must have exactly one result, saved (Antenna) or ``ok`` (NATS), before a
rate is reported.
Writes bench/results/antenna_wan.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common.meters import machine
from bench.common.records import save
from bench.outcomes import BenchmarkFailed, Outcomes, refusing
from tests.antenna_fake import FakeAntenna
from worker.commands.demo_images import image_bytes

PIPELINE = "worker.commands.demo_models:boxes_and_colours"  # Antenna keeps a detector's
SLUG = "boxes-and-colours"
TOKEN = "bench-wan-token-0f3a9c"
_DISTINCT = 20


def make_ca(where: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate for 127.0.0.1 signed by it (openssl): (ca, cert, key)."""
    ca_key, ca, key, csr, cert = (
        where / n for n in ("ca.key", "ca.pem", "s.key", "s.csr", "s.pem")
    )
    ext = where / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", str(ca_key), "-out", str(ca), "-days", "2", "-subj", "/CN=bench CA")  # fmt: skip
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
        str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")  # fmt: skip
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))  # fmt: skip
    return ca, cert, key


# -- the delayed link ---------------------------------------------------------------------
async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Every chunk from ``reader`` written to ``writer`` ``delay_s`` after it came, in order."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def later() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                writer.close()
                return
            writer.write(data)
            await writer.drain()

    sending = asyncio.create_task(later())
    try:
        while True:
            data = await reader.read(256 * 1024)
            await queue.put((time.monotonic() + delay_s, data))
            if not data:
                break
        await sending
    except (ConnectionError, OSError):
        sending.cancel()
        writer.close()


async def _relay(listen: int, upstream: int, delay_s: float) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            _pipe(reader, up_writer, delay_s), _pipe(up_reader, writer, delay_s),
            return_exceptions=True,
        )  # fmt: skip

    server = await asyncio.start_server(serve, "127.0.0.1", listen)
    parent = os.getppid()
    async with server:
        while os.getppid() == parent:  # noqa: ASYNC110 - no event tells a parent is gone
            await asyncio.sleep(0.5)


def start_relay(upstream: int, rtt_s: float) -> tuple[subprocess.Popen[bytes], int]:
    from worker.commands.localservers import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.antenna_wan",
            "relay",
            str(port),
            str(upstream),
            str(rtt_s / 2),
        ]
    )
    deadline = time.monotonic() + 20
    import socket

    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the relay did not start")


# -- one case -----------------------------------------------------------------------------
def relayed(url: str, rtt_s: float, relays: list[subprocess.Popen[bytes]]) -> str:
    """``url`` through a new relay delaying by ``rtt_s`` (the relay added to ``relays``)."""
    relay, port = start_relay(int(url.split(":")[2].split("/")[0]), rtt_s)
    relays.append(relay)
    return url.replace(url.split("/")[2], f"127.0.0.1:{port}")


def worker_env(settings: dict[str, str], ca: Path | None) -> dict[str, str]:
    """This process's environment without worker settings, then the case's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "AMI_"))}
    env.update(
        {
            "WORKER_SOURCES__ALLOWED_HOSTS": "127.0.0.1",
            "WORKER_MODEL__PIPELINE": PIPELINE,
            "WORKER_MODEL__DEVICE": "cpu",
            "WORKER_METRICS__PORT": "0",
            "WORKER_LOG_LEVEL": "WARNING",
            **settings,
        }
    )
    if ca is not None:
        env["SSL_CERT_FILE"] = str(ca)
    return env


def run_case(
    tasks: int,
    rtt_s: float,
    tls: ssl.SSLContext | None,
    ca: Path | None,
    shape: str = "both",
    extra: dict[str, str] | None = None,
) -> dict[str, Any]:
    antenna = FakeAntenna(token=TOKEN)
    images = FakeAntenna(token="unused")
    antenna.tls = images.tls = tls
    relays: list[subprocess.Popen[bytes]] = []
    with antenna.running(), images.running():
        base = antenna.url
        media = images.media_url("x").rsplit("/", 1)[0]
        try:
            if rtt_s > 0 and shape in ("both", "antenna"):
                base = relayed(base, rtt_s, relays)
            if rtt_s > 0 and shape in ("both", "images"):
                media = relayed(media, rtt_s, relays)
            for i in range(_DISTINCT):
                images.images[f"{i}.jpg"] = image_bytes(1280, 720, seed=i)
            settings = {
                "WORKER_SOURCE": "antenna",
                "WORKER_ANTENNA__BASE_URL": base,
                "WORKER_ANTENNA__TOKEN": TOKEN,
                "WORKER_ANTENNA__PROJECT_IDS": "1",
                "WORKER_ANTENNA__POLL_INTERVAL_S": "1",
            }
            env = worker_env({**settings, **(extra or {})}, ca)
            figures = antenna_job(antenna, images, env, media, tasks, rtt_s)
        finally:
            for relay in relays:
                relay.kill()
                relay.wait(10)
    return {"tls": tls is not None, "shaped": shape if rtt_s > 0 else "none", **figures}


def antenna_job(
    antenna: FakeAntenna,
    images: FakeAntenna,
    env: dict[str, str],
    media: str,
    tasks: int,
    rtt_s: float,
) -> dict[str, Any]:
    """``worker register``, then one job of ``tasks`` images served by ``worker run
    --until-idle``; every task saved once, or ``BenchmarkFailed``. Its rate and connections."""
    done = subprocess.run(
        [sys.executable, "-m", "worker", "register"], env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"register failed: {done.stdout}{done.stderr}")
    job = antenna.add_job(SLUG, [(f"t{n}", f"{media}/{n % _DISTINCT}.jpg") for n in range(tasks)])
    calls_before, conns_before = len(antenna.requests), antenna.connections
    image_conns_before = images.connections
    run = subprocess.run(
        [sys.executable, "-m", "worker", "run", "--until-idle"], env=env,
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    found = antenna.jobs[job]
    if run.returncode != 0 or found.status != "SUCCESS":
        raise BenchmarkFailed(f"run {run.returncode}, job {found.status}: {run.stderr[-2000:]}")
    outcomes = Outcomes(f"Antenna job, RTT {rtt_s * 1000:.0f} ms")
    for n in range(tasks):
        saved = found.saved.get(f"t{n}", [])
        if len(saved) == 1 and f"t{n}" not in found.failed:
            outcomes.good()
        else:
            outcomes.bad("not_saved_once", f"t{n}: {len(saved)} saved")
    outcomes.check(tasks)
    times = sorted(found.result_times)
    span_s = times[-1] - times[0]
    return {
        "tasks": tasks,
        "rtt_ms": round(rtt_s * 1000),
        "tasks_per_s": round((len(times) - 1) / span_s, 2) if span_s > 0 else None,
        "antenna_requests_per_task": round((len(antenna.requests) - calls_before) / tasks, 3),
        "antenna_connections_per_task": round((antenna.connections - conns_before) / tasks, 4),
        "image_connections_per_task": round((images.connections - image_conns_before) / tasks, 3),
    }


# -- the NATS source on the same images ---------------------------------------------------
def run_nats_case(
    tasks: int, rtt_s: float, tls: ssl.SSLContext | None, ca: Path | None
) -> dict[str, Any]:
    """The same job's images, behind the same relay, with the tasks from a local NATS server."""
    from worker.commands.localservers import NatsServer, stop_process

    images = FakeAntenna(token="unused")
    images.tls = tls
    relays: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="iw-wan-nats-") as tmp, images.running():
        nats = NatsServer(store_dir=str(Path(tmp) / "nats")).start()
        media = images.media_url("x").rsplit("/", 1)[0]
        try:
            if rtt_s > 0:
                media = relayed(media, rtt_s, relays)
            for i in range(_DISTINCT):
                images.images[f"{i}.jpg"] = image_bytes(1280, 720, seed=i)
            env = worker_env({"WORKER_NATS__URL": nats.url}, ca)
            log = open(Path(tmp) / "worker.log", "ab")  # noqa: SIM115 - closed below
            proc = subprocess.Popen(
                [sys.executable, "-m", "worker", "run"], env=env, stdout=log, stderr=log
            )
            uris = [f"{media}/{n % _DISTINCT}.jpg" for n in range(tasks)]
            try:
                times, outcomes = asyncio.run(_nats_job(nats.url, uris))
            finally:
                stop_process(proc, wait_s=60.0)
                log.close()
            outcomes.check(tasks)
        finally:
            for relay in relays:
                relay.kill()
                relay.wait(10)
            nats.stop()
    span_s = times[-1] - times[0]
    return {
        "source": "nats",
        "tasks": tasks,
        "rtt_ms": round(rtt_s * 1000),
        "tls": tls is not None,
        "tasks_per_s": round((len(times) - 1) / span_s, 2) if span_s > 0 else None,
        "image_connections_per_task": round(images.connections / tasks, 3),
    }


async def _nats_job(url: str, uris: list[str]) -> tuple[list[float], Outcomes]:
    """Publish one job of ``uris``; when each task's first result came, and what they said."""
    from bench.common.job_runs import Job, client, run_jobs
    from config.settings import load_settings

    settings = load_settings(for_worker=False, nats={"url": url}).nats
    async with client(settings, SLUG) as nc:
        (job,) = await run_jobs(nc, settings, [Job(f"wan-{time.time_ns()}", uris, SLUG)])
    outcomes = Outcomes("NATS job")
    for result in job.received():
        if result.get("status") == "ok":
            outcomes.good()
        else:
            outcomes.bad(str(result.get("status")), str(result.get("error"))[:200])
    return sorted(job.arrivals.values()), outcomes


def ratio_of(direct: dict[str, Any], shaped: dict[str, Any]) -> float | None:
    if direct["tasks_per_s"] and shaped["tasks_per_s"]:
        return round(shaped["tasks_per_s"] / direct["tasks_per_s"], 3)
    return None


def median_case(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's rounds as one: each figure the median of the rounds'."""
    summary = dict(cases[0])
    for key, value in cases[0].items():
        if isinstance(value, float) or key == "tasks_per_s":
            figures = [case[key] for case in cases if case[key] is not None]
            summary[key] = round(statistics.median(figures), 3) if figures else None
    return summary


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.antenna_wan")
    parser.add_argument("--tasks", type=int, default=300)
    parser.add_argument("--rtt-ms", type=float, default=60.0)
    parser.add_argument("--http", action="store_true", help="plain HTTP instead of HTTPS")
    parser.add_argument("--nats", action="store_true", help="also the NATS source, same images")
    parser.add_argument("--smoke", action="store_true", help="a small run: 40 tasks, with --nats")
    parser.add_argument(
        "--shape", choices=("both", "antenna", "images"), default="both", help="Antenna cases"
    )
    parser.add_argument("--set", action="append", default=[], help="WORKER_X=Y for the worker")
    parser.add_argument(
        "--rounds", type=int, default=3, help="direct then shaped, this many times; medians"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.tasks, args.nats, args.rounds = 40, True, 1
    return args


def alternated(case_of: Any, args: argparse.Namespace, tls: Any, ca: Path | None) -> dict[str, Any]:
    """Direct then shaped, ``--rounds`` times (so a quiet or a busy spell of the machine falls
    on both cases): the medians, the rounds and their ratios."""
    rounds = []
    for _ in range(args.rounds):
        pair = []
        for rtt_s in (0.0, args.rtt_ms / 1000):
            case = case_of(args.tasks, rtt_s, tls, ca)
            print(json.dumps(case), flush=True)
            pair.append(case)
        rounds.append(pair)
    ratios = [r for r in (ratio_of(*pair) for pair in rounds) if r is not None]
    return {
        "cases": [median_case([pair[i] for pair in rounds]) for i in (0, 1)],
        "rounds": rounds,
        "round_ratios": ratios,
        "shaped_over_direct": round(statistics.median(ratios), 3) if ratios else None,
    }


@refusing
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["relay"]:
        asyncio.run(_relay(int(argv[1]), int(argv[2]), float(argv[3])))
        return
    args = parse(argv)
    tls: ssl.SSLContext | None = None
    ca: Path | None = None
    extra = dict(item.split("=", 1) for item in args.set)
    payload: dict[str, Any] = {"machine": machine(), "http": args.http, "worker_settings": extra}
    with tempfile.TemporaryDirectory(prefix="iw-wan-") as tmp:
        if not args.http:
            ca, cert, key = make_ca(Path(tmp))
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.load_cert_chain(str(cert), str(key))

        def antenna_case(tasks: int, rtt_s: float, tls: Any, ca: Path | None) -> dict[str, Any]:
            return run_case(tasks, rtt_s, tls, ca, args.shape, extra)

        runs = [("antenna", antenna_case)] + ([("nats", run_nats_case)] if args.nats else [])
        for source, case_of in runs:
            payload[source] = alternated(case_of, args, tls, ca)
            ratios = {k: payload[source][k] for k in ("round_ratios", "shaped_over_direct")}
            print(json.dumps({source: ratios}))
    save("antenna_wan", payload)


if __name__ == "__main__":
    main()
