"""Which device this process runs on, claimed through the environment before CUDA starts."""

from __future__ import annotations

import os

from config.derived import chosen_device
from config.errors import ConfigError, PermanentError
from config.settings import Settings
from pipelines.device import visibility
from pipelines.models import resolve_device


def claim_device(s: Settings) -> str:
    """The device this process runs on; a GPU by index or UUID, or a MIG slice, becomes the
    only one it sees (CUDA_VISIBLE_DEVICES, indexed as nvidia-smi's). First: CUDA reads
    CUDA_VISIBLE_DEVICES once, and a plugin imported while pipelines are chosen may touch it."""
    visible, device = visibility(chosen_device(s))
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # index as nvidia-smi's
    return device


def device_type(device: str) -> str:
    """``cuda`` or ``cpu``; a CUDA device that is not there is a configuration error (exit 2),
    as the pipeline's loading would say a moment later."""
    try:
        return resolve_device(device).type
    except PermanentError as error:
        raise ConfigError(str(error)) from None
