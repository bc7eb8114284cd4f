"""Who is asking: the ``client_info`` this worker sends with each reservation and result post.

Antenna's ``POST jobs/{id}/tasks/`` and ``POST jobs/{id}/result/`` take an optional
``client_info`` (``ProcessingServiceClientInfo`` in RolnickLab/antenna ``ami/ml/schemas.py``:
an object of any keys, meant to tell apart the workers, pods or machines behind one processing
service). Built once from the settings; it holds no secret: no token, no URL, no environment.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
from typing import Any

SOFTWARE = "inference-worker"


def _version() -> str:
    try:
        return importlib.metadata.version(SOFTWARE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def client_info(
    service_name: str, pipelines: tuple[str, ...], process_index: int
) -> dict[str, Any]:
    """This process as Antenna may log it: host, process, software, version, pipelines."""
    return {
        "software": SOFTWARE,
        "version": _version(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "process_index": process_index,
        "service_name": service_name,
        "pipelines": list(pipelines),
    }
