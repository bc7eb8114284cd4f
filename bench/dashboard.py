"""The Grafana dashboard's panels filled with a real run, as a PNG for the README.

No Grafana renders here, so this plots the dashboard's own queries (deploy/grafana/
inference-worker.json, `$instance` as every process) from a real Prometheus's query API with
matplotlib: two workers (process index 0 and 1, one with a loader fault injected once) serve
a job of generated images with some corrupt ones, scraped every second.

    .venv/bin/python -m bench.dashboard [--images 400] [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common.world import PIPELINE, nats_settings, start_worker, stop_worker, upload, world
from testing.prometheus import PrometheusServer
from worker.commands.client import make_tasks, publish_tasks
from worker.commands.demo_images import corrupt_bytes
from worker.commands.localservers import free_port
from worker.nats.connection import connect

DASHBOARD = Path(__file__).parents[1] / "deploy/grafana/inference-worker.json"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def free_port_base() -> int:
    """A free port with a free one after it."""
    import socket

    for _ in range(100):
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two free ports in a row")


def panels() -> list[dict[str, Any]]:
    def walk(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for item in items:
            if item.get("targets"):
                yield item
            yield from walk(item.get("panels", []))

    return list(walk(json.loads(DASHBOARD.read_text())["panels"]))


def query_range(url: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    expr = expr.replace('=~"$instance"', '=~".*"').replace('="$instance"', '=~".*"')
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": 2})
    return _get(f"{url}/api/v1/query_range?{params}")["data"]["result"]


def legend(template: str, metric: dict[str, str]) -> str:
    text = template
    for key, value in metric.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def plot(url: str, start: float, end: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = panels()
    cols = 4
    rows = -(-len(shown) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(20, 3.6 * rows))
    for ax, panel in zip(axes.flat, shown, strict=False):
        drawn = 0
        for target in panel["targets"]:
            for series in query_range(url, target["expr"], start, end):
                times = [float(t) - start for t, _ in series["values"]]
                values = [float(v) for _, v in series["values"]]
                ax.plot(times, values, label=legend(target["legendFormat"], series["metric"]))
                drawn += 1
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.tick_params(labelsize=7)
        if drawn:
            ax.legend(fontsize=6, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data (CPU: no device)", ha="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    fig.suptitle("inference-worker dashboard panels (Prometheus, 2 workers, bench.dashboard)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


async def run(images: int, out: Path) -> None:
    with world() as w:
        s3 = w.s3.client()
        uris = upload(s3, "dashboard", [(640, 480), (1920, 1080), (1280, 720)], images)
        for i in range(0, images, 25):  # one in 25 corrupt: the error outcome has data
            s3.put_object(Bucket="dashboard", Key=f"img/{i:05d}-corrupt.jpg", Body=corrupt_bytes(i))
            uris[i] = f"s3://dashboard/img/{i:05d}-corrupt.jpg"
        base = free_port_base()
        ports = [base, base + 1]  # process N listens on the base + N
        workers = [
            start_worker(
                w,
                f"worker-{index}.log",
                WORKER_PROCESS_INDEX=str(index),
                WORKER_METRICS__PORT=str(base),
                WORKER_LOADER__TIMEOUT_S="10",  # a dropped result shows as a restart soon
                WORKER_S3__CONNECT_TIMEOUT_S="1",
                WORKER_S3__READ_TIMEOUT_S="2",
                WORKER_S3__MAX_ATTEMPTS="2",
                **(
                    {"WORKER_FAULTS__DROP_ONCE_FILE": str(w.workdir / "drop")} if index == 1 else {}
                ),
            )
            for index in (0, 1)
        ]
        prometheus = PrometheusServer(
            w.workdir / "prometheus", [f"127.0.0.1:{port}" for port in ports]
        ).start()
        try:
            start = time.time()
            await asyncio.sleep(20)  # workers start; an idle stretch on the charts
            settings = nats_settings(w)
            nc = await connect(settings, name="bench-dashboard")
            js = nc.jetstream()
            for wave in range(3):
                part = uris[wave::3]
                await publish_tasks(js, settings, PIPELINE, make_tasks(f"dash-{wave}", part))
                await asyncio.sleep(40)
            await nc.close()
            await asyncio.sleep(20)
            plot(prometheus.url, start, time.time(), out)
        finally:
            prometheus.stop()
            for proc in workers:
                stop_worker(proc)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = parser.parse_args()
    asyncio.run(run(args.images, args.out))


if __name__ == "__main__":
    main()
