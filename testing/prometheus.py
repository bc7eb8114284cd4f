"""A local Prometheus with the project's alert rules, for the alert tests (Debian's
``prometheus`` package; not part of the installed package)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from config.errors import ServerNotFound
from worker.commands.localservers import free_port, stop_process, wait_port

READY_WAIT_S = 20.0


class PrometheusServer:
    """A Prometheus (Debian's ``prometheus`` package) scraping ``targets`` every second with
    the project's alert rules, its ``for:`` durations replaced by ``rule_for`` when given (so a
    test need not wait minutes)."""

    def __init__(self, work_dir: Path, targets: list[str], rule_for: str | None = None) -> None:
        self.work_dir = Path(work_dir)
        self.targets = targets
        self.rule_for = rule_for
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self) -> PrometheusServer:
        binary = shutil.which("prometheus")
        if binary is None:
            raise ServerNotFound("prometheus not found: `apt-get install prometheus`")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        rules = (Path(__file__).parents[1] / "deploy/prometheus/alerts.yml").read_text()
        if self.rule_for:
            rules = re.sub(r"(?m)^(\s+for:) \S+$", rf"\1 {self.rule_for}", rules)
        (self.work_dir / "alerts.yml").write_text(rules)
        config = {
            "global": {
                "scrape_interval": "1s",
                "evaluation_interval": "1s",
                "scrape_timeout": "1s",
            },
            "rule_files": [str(self.work_dir / "alerts.yml")],
            "scrape_configs": [
                {"job_name": "inference-worker", "static_configs": [{"targets": self.targets}]}
            ],
        }
        (self.work_dir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self._log = open(self.work_dir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.work_dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.work_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_port(self.port, self.proc, "prometheus")
            self._wait_ready()
        except RuntimeError:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        """Listening is not ready: /-/ready answers 200 once rules and storage are loaded."""
        import urllib.request

        deadline = time.monotonic() + READY_WAIT_S
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"prometheus not ready within {READY_WAIT_S:g}s") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        if self._log is not None:
            self._log.close()
            self._log = None
