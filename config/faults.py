"""Test hooks: the faults the chaos and integration tests ask for, as ``WORKER_FAULTS__*``.

They are not settings an operator sets: the production schema (``config/settings.py``) has no
such group and docs/configuration.md no row for them. Only ``run`` reads them, once
(``load_faults``), and the assembly installs the wrappers they ask for
(``worker/engine/faults.py``, ``worker/nats/faults.py``, ``datasets/faults.py``), never the
parts themselves. Off unless a test sets one; free when off (``FaultSettings()``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from config.errors import ConfigError
from config.names import NESTED_DELIMITER, PREFIX, env_name


class FaultSettings(BaseModel):
    """Fault hooks for chaos tests. Off (empty) unless a test turns them on; free when off."""

    drop_once_file: str = Field(
        "",
        description="testing only: the first loader child to create this file loses its next "
        "result in the queue's feeder thread (a pickling error), as seen in production",
    )
    wedge_once_file: str = Field(
        "",
        description="testing only: the first process to create this file wedges its engine "
        "thread at its next batch (see WORKER_FAULTS__WEDGE_MODE)",
    )
    wedge_mode: Literal["gil", "sleep", "raise"] = Field(
        "gil",
        description="testing only: gil = spin holding the GIL (only the watchdog can act), "
        "sleep = block without it (/healthz reports the stall), raise = fail the batch with "
        "an unexpected error (a part of the worker failed: exit 1)",
    )
    slow_load_s: float = Field(
        0.0,
        ge=0,
        description="testing only: every model load takes this many seconds longer (a big "
        "model from S3, a slow build): a start as slow as it makes it",
    )
    slow_store_s: float = Field(
        0.0,
        ge=0,
        description="testing only: every result written to the NATS results stream takes this "
        "many seconds longer first (a slow results stream): settles as slow as it makes them",
    )
    slow_forward_s: float = Field(
        0.0,
        ge=0,
        description="testing only: in every batch, each model stage's forward pass takes this "
        "many seconds longer per image or crop it is given (a slow host whose passes advance "
        "chunk by chunk; the start's warm pass is not slowed)",
    )
    freeze_forward_at: int = Field(
        0,
        ge=0,
        description="testing only: the forward pass given this input of the process's batches "
        "(1 = the first image or crop) never returns, as a wedged device's; 0 = never",
    )
    device_error_once_file: str = Field(
        "",
        description="testing only: the first process to create this file, at its batch "
        "WORKER_FAULTS__DEVICE_ERROR_AT_BATCH, has its device fail for good: that forward pass "
        "and every later one raise a sticky CUDA error (see WORKER_FAULTS__DEVICE_ERROR_TYPE)",
    )
    device_error_at_batch: int = Field(
        1, ge=1, description="testing only: the batch (1 = the process's first) that fails"
    )
    device_error_type: Literal["accelerator", "runtime"] = Field(
        "accelerator",
        description="testing only: accelerator = torch.AcceleratorError with CUDA's code 700 "
        "(an illegal memory access), as current torch raises it; runtime = the plain "
        "RuntimeError `CUDA error: an illegal memory access was encountered` of older torch",
    )


class FaultEnv(BaseSettings):
    """Where the hooks are read from: ``WORKER_FAULTS__*`` in the environment or ``.env``, as
    a settings group would be (``WORKER_FAULTS`` as JSON too)."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, env_nested_delimiter=NESTED_DELIMITER, env_file=".env", extra="ignore"
    )

    faults: FaultSettings = Field(default_factory=FaultSettings)


def load_faults() -> FaultSettings:
    """The hooks a test set; ConfigError, one line per problem, naming each variable."""
    try:
        return FaultEnv().faults
    except ValidationError as error:
        lines = [
            f"{env_name(*(str(p) for p in item['loc']))}: {item['msg']}" for item in error.errors()
        ]
        raise ConfigError("\n".join(lines)) from None
