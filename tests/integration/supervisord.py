"""Run the project's own deploy/supervisor config under a real supervisord, paths filled in."""

from __future__ import annotations

import getpass
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from worker.health.procstats import living

DEPLOY = Path(__file__).parents[2] / "deploy" / "supervisor"
_CACHE = 'WORKER_MODEL__CACHE_DIR="/var/cache/inference-worker/models"'
GROUP = "inference-worker"
# healthwatch's, in these tests (120 in the deploy config); it ends at a worker's first healthy
# answer, so it bounds only a start that never answers (a slow start on a busy machine is none)
STARTUP_GRACE_S = 60
LISTENER = "inference-worker-healthwatch"


def free_port_base(processes: int = 3) -> int:
    """A free port with free ones after it, and the same 1000 above (the loopback /healthz
    listeners): process N listens on base + N and base + 1000 + N."""
    for _ in range(200):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        base = port - port % 10
        ports = [base + offset + n for offset in (0, 1000) for n in range(max(processes, 3))]
        if 20000 < base < 60000 and all(_free(p) for p in ports):
            return base
    raise RuntimeError("no free port range found")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Supervisord:
    """supervisord with deploy/supervisor/*.conf, tightened timings for a test run."""

    def __init__(
        self,
        run_dir: Path,
        worker_env: dict[str, str],
        *,
        stopwaitsecs: int = 8,
        numprocs: int = 1,
        command: str = "",
        env: dict[str, str] | None = None,
        healthwatch_failures: int = 2,
    ) -> None:
        """``command`` replaces the worker's (``python -m ...``, run from the repository);
        ``env`` is added to supervisord's own environment (its children inherit it)."""
        self.run_dir = run_dir
        self.port_base = free_port_base(numprocs)
        self.conf_dir = run_dir / "conf"
        self.conf_dir.mkdir(parents=True)
        main = (DEPLOY / "supervisord.conf").read_text()
        assert "\n[supervisord]\n" in main, "deploy config changed: no [supervisord] section"
        # debug: supervisord logs each event its listeners processed (healthwatch's ticks)
        main = main.replace("\n[supervisord]\n", "\n[supervisord]\nloglevel=debug\n", 1)
        (self.conf_dir / "supervisord.conf").write_text(main)
        program = (DEPLOY / "inference-worker.conf").read_text()
        for old, new in (
            ("--failures 2", f"--failures {healthwatch_failures} --timeout-s 2"),
            ("--startup-grace-s 120", f"--startup-grace-s {STARTUP_GRACE_S}"),
            ("stopwaitsecs=60", f"stopwaitsecs={stopwaitsecs}"),
            ("startsecs=10", "startsecs=2"),
            (_CACHE, f'WORKER_MODEL__CACHE_DIR="{run_dir}/models"'),
            *(
                [("command=%(ENV_IW_BIN)s/inference-worker run", f"command={command}")]
                if command
                else []
            ),
        ):
            assert old in program, f"deploy config changed: {old!r} not found"
            program = program.replace(old, new)
        (self.conf_dir / "inference-worker.conf").write_text(program)
        work_dir = run_dir / "work"
        work_dir.mkdir()
        (work_dir / ".env").write_text("".join(f"{k}={v}\n" for k, v in worker_env.items()))
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("WORKER_")},
            "IW_BIN": str(Path(sys.executable).parent),
            "IW_RUN_DIR": str(run_dir),
            "IW_ENV_FILE": str(work_dir),
            "IW_NUMPROCS": str(numprocs),
            "IW_DEVICES": "cpu",
            "IW_USER": getpass.getuser(),
            "IW_METRICS_PORT_BASE": str(self.port_base),
            "PYTHONPATH": str(DEPLOY.parents[1]),
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Supervisord:
        self.proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "supervisord"),
                "-c",
                str(self.conf_dir / "supervisord.conf"),
            ],
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    def rpc(self) -> Any:
        from supervisor import childutils

        return childutils.getRPCInterface(
            {"SUPERVISOR_SERVER_URL": f"unix://{self.run_dir}/supervisor.sock"}
        )

    def worker_pid(self, timeout_s: float = 60, index: int = 0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                info = self.rpc().supervisor.getProcessInfo(f"{GROUP}:{GROUP}_{index:02d}")
                if info["statename"] == "RUNNING" and info["pid"]:
                    return int(info["pid"])
            except (OSError, Exception):  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.2)
        raise AssertionError(f"worker not RUNNING within {timeout_s}s:\n{self.logs()}")

    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port_base}/healthz"

    def get(
        self, path: str, timeout_s: float = 2, host: str = "127.0.0.1", index: int = 0
    ) -> tuple[int, str]:
        """GET ``path`` from process ``index``'s /metrics listener."""
        url = f"http://{host}:{self.port_base + index}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def wait_healthy(self, timeout_s: float = 90, host: str = "127.0.0.1") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.get("/healthz", host=host)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"worker never healthy:\n{self.logs()}")

    def healthwatch_ticks(self) -> int:
        """TICK events healthwatch has processed (probed every worker and acted) so far."""
        path = self.run_dir / "supervisord.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return len(re.findall(rf"{LISTENER}\S*: event was processed", text))

    def logs(self, tail_chars: int | None = 4000) -> str:
        """Every log of the run, each cut to its last ``tail_chars`` (for a message; None: all
        of it, for an assertion: supervisord logs at debug level, so a line soon scrolls out)."""
        out = []
        for path in sorted(self.run_dir.glob("*.log")):
            text = path.read_text(errors="replace")
            out.append(f"--- {path.name}\n{text if tail_chars is None else text[-tail_chars:]}")
        return "\n".join(out)

    def worker_log(self) -> str:
        path = self.run_dir / f"{GROUP}_00.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> list[int]:
        """Stop supervisord and everything under it; returns pids still alive (should be none)."""
        if self.proc is None:
            return []
        tree = [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
        deadline = time.monotonic() + 10
        alive = tree
        while alive and time.monotonic() < deadline:
            alive = living(alive)
            time.sleep(0.2)
        for pid in alive:
            os.kill(pid, signal.SIGKILL)
        return alive
