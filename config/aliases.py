"""AMI's own names for settings we have (``ami worker``'s ``.env``), read as aliases of ours.

Ours win when both are set; ``check`` prints which alias was used. Imports nothing of ours
but the naming rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from config.names import env_name

# AMI's name -> ours (group, field).
AMI_ALIASES: dict[str, tuple[str, str]] = {
    "AMI_ANTENNA_API_BASE_URL": ("antenna", "base_url"),
    "AMI_ANTENNA_API_AUTH_TOKEN": ("antenna", "token"),
    "AMI_ANTENNA_SERVICE_NAME": ("antenna", "service_name"),
    "AMI_ANTENNA_API_BATCH_SIZE": ("antenna", "reservation_size"),
    "AMI_NUM_WORKERS": ("loader", "num_workers"),
}


def read_env_file(path: str | Path = ".env") -> dict[str, str]:
    """The ``.env`` file's variables (none when there is no file)."""
    if not Path(path).is_file():
        return {}
    from dotenv import dotenv_values

    return {k: v for k, v in dotenv_values(path).items() if v is not None}


def alias_overrides(
    environ: Mapping[str, str], env_file: Mapping[str, str]
) -> tuple[dict[str, dict[str, Any]], tuple[str, ...]]:
    """Settings to pass on from AMI's names, and one line per alias used.

    The environment wins over the ``.env`` file, as for our own names; one of our names set
    in either place wins over any alias.
    """
    seen = {k.upper(): v for k, v in env_file.items()}
    seen.update({k.upper(): v for k, v in environ.items()})
    overrides: dict[str, dict[str, Any]] = {}
    used: list[str] = []
    for alias, (group, name) in AMI_ALIASES.items():
        mine = env_name(group, name)
        if alias not in seen:
            continue
        if mine in seen:
            used.append(f"{mine} set, {alias} ignored")
            continue
        overrides.setdefault(group, {})[name] = seen[alias]
        used.append(f"{mine} from {alias}")
    return overrides, tuple(used)
