"""A stand-in for a worker process under supervisord, for healthwatch's tests with many
processes: the worker's own HealthServer on the worker's own ports (``config.derived``, from
the same WORKER_* settings), its probes answering 200 until SIGTERM. What healthwatch sees of
a worker, without a model and loader children per process on a shared test machine.

    python -m tests.integration.healthz_process
"""

from __future__ import annotations

import signal

from prometheus_client import CollectorRegistry

from config.derived import healthz_port, metrics_port
from config.settings import load_settings
from worker.health.server import HealthServer, Probes


def main() -> int:
    settings = load_settings(for_worker=False)
    server = HealthServer(
        settings.metrics.host,
        metrics_port(settings),
        CollectorRegistry(),
        Probes(lambda: None, lambda: None),
        healthz_port=healthz_port(settings),
    )
    server.start()
    print(f"serving the probes on {server.port} and {server.healthz_port}", flush=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
