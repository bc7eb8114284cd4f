"""Values derived from the settings, computed in one place: held-task cap, ports, deadlines,
threads, this process's device, the run directories. Pure functions of a validated ``Settings``."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from config.names import env_name

if TYPE_CHECKING:
    from config.settings import Settings


def max_held_tasks(s: Settings, image_bytes: int) -> int:
    """Tasks held at once; with ``image_bytes``, the most host bytes one loaded image of the
    pipeline can take, this bounds host memory for loaded images by construction."""
    held = s.loader.batch_size * s.loader.prefetch_batches
    if s.loader.max_inflight_bytes:
        held = min(held, s.loader.max_inflight_bytes // image_bytes)
    return max(held, s.loader.batch_size)


def port_for(base: int, index: int) -> int:
    """Process ``index``'s metrics port: the base plus the index (the rule healthwatch probes
    by, so 16 processes on a host are 9460..9475, never a port made by pasting digits)."""
    return base + index


def metrics_port(s: Settings) -> int:
    """This process's /metrics and /healthz port; 0 when turned off."""
    return port_for(s.metrics.port, s.process_index) if s.metrics.port else 0


HEALTHZ_PORT_OFFSET = 1000


def healthz_base(metrics_base: int, healthz_base: int = 0) -> int:
    """Process 0's loopback /healthz port: as set, or the metrics port + HEALTHZ_PORT_OFFSET
    (healthwatch derives it by the same rule from the same base)."""
    return healthz_base or metrics_base + HEALTHZ_PORT_OFFSET


def healthz_port(s: Settings) -> int:
    """This process's loopback /healthz port (healthwatch's); 0 when metrics are off."""
    if not s.metrics.port:
        return 0
    return port_for(healthz_base(s.metrics.port, s.metrics.healthz_port), s.process_index)


def object_deadline_s(s: Settings) -> float:
    """The per-object read deadline: as set, or three quarters of the loader timeout."""
    return s.sources.object_deadline_s or 0.75 * s.loader.timeout_s


def torch_threads(s: Settings, cores: int, detecting: bool) -> tuple[int, str]:
    """The forward pass's intra-op threads on ``cores`` (those this process may use), and why:
    as set; on a CPU device, every core when a served pipeline has a detector (its forward pass
    takes seconds an image there, decoding the image a few per cent of that: the loader children
    keep up from the gaps); else (a GPU host's too) the cores the loader children leave (at
    least 1), since a light classifier's forward pass is quicker than decoding its images."""
    if s.model.torch_threads > 0:
        return s.model.torch_threads, "set"
    if detecting and not chosen_device(s).startswith("cuda"):
        return max(1, cores), "every core: a detector's pipeline on the CPU"
    return max(1, cores - s.loader.num_workers), "the cores the loader children leave"


def chosen_device(s: Settings) -> str:
    """This process's entry of WORKER_MODEL__DEVICE (a list gives one entry per process)."""
    entries = [entry.strip() for entry in s.model.device.split(",") if entry.strip()]
    return entries[s.process_index % len(entries)]


def run_dir_base(s: Settings) -> Path:
    """Where the processes' run directories are (``process-<index>`` under it): as set, or
    this user's own ``<system temp dir>/inference-worker-<uid>`` (one user's never blocks or
    is planted for another's)."""
    if s.run_dir:
        return Path(s.run_dir)
    return Path(tempfile.gettempdir()) / f"inference-worker-{os.geteuid()}"


def run_dir_setting(s: Settings) -> str:
    """How a refused run directory is named: the setting, and TMPDIR when it is the default."""
    if s.run_dir:
        return f"{env_name('run_dir')}={s.run_dir}"
    return f"{env_name('run_dir')} (unset: its default {run_dir_base(s)} is under TMPDIR)"


def unconfigured_source(s: Settings, env_file: Path) -> str | None:
    """Why the task source was not configured, when it was not: ``WORKER_SOURCE`` and
    ``WORKER_NATS__URL`` both at their defaults, from neither the environment nor ``.env`` (a
    process started away from its ``.env`` becomes a NATS worker on localhost); None when
    either was set."""
    if "source" in s.model_fields_set or "url" in s.nats.model_fields_set:
        return None
    where = (
        f"the .env at {env_file.resolve()} sets neither"
        if env_file.is_file()
        else f"no .env in {env_file.resolve().parent}"
    )
    return (
        f"{env_name('source')} and {env_name('nats', 'url')} are at their defaults ({where}): "
        f"set {env_name('source')}=antenna with {env_name('antenna', 'base_url')}, or "
        f"{env_name('nats', 'url')}, or start it in the directory of its .env (IW_ENV_FILE "
        "under supervisord)"
    )
