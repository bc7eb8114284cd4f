"""``WORKER_*`` names that are no setting: refused at start, each with the closest real one.

pydantic-settings reads only the names it knows: with ``env_nested_delimiter="__"`` a variable
whose group is misspelt (``WORKER_GUARD__...``) matches no field, and one whose group is right
but whose field is misspelt (``WORKER_SOURCES__MAX_BYTE``) lands in that group's dict, where
the group model drops it. Both load silently, the setting left at its default; this module
finds them, in the environment and in the ``.env`` file, before the settings are read. Names
are compared as pydantic-settings compares them: case-insensitively.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel

from config.names import PREFIX, env_name

# WORKER_* names read by the command line rather than the settings model.
NOT_SETTINGS = frozenset({env_name("log_level")})


def hook_names() -> frozenset[str]:
    """The test hooks' names (``config/faults.py``): read by ``run`` alone, outside the
    settings model, and still checked here, so a misspelt hook is refused too."""
    from config.faults import FaultEnv

    return known_names(FaultEnv)


def known_names(model: type[BaseModel]) -> frozenset[str]:
    """Every environment name that sets a field of ``model``: each group as a whole (JSON)
    and each of its fields."""
    names = set(NOT_SETTINGS)
    for name, field in model.model_fields.items():
        names.add(env_name(name))
        group = field.annotation
        if isinstance(group, type) and issubclass(group, BaseModel):
            names.update(env_name(name, inner) for inner in group.model_fields)
    return frozenset(names)


def env_file_names(path: Path) -> list[str]:
    """The variable names a ``.env`` file sets (nothing when there is none)."""
    if not path.is_file():
        return []
    from dotenv import dotenv_values

    return [name for name in dotenv_values(path) if name]


def unknown_names(names: Iterable[str], known: frozenset[str]) -> list[str]:
    """One line per ``WORKER_*`` name among ``names`` that is no setting, naming the closest."""
    problems = []
    for name in sorted({name.upper() for name in names if name.upper().startswith(PREFIX)}):
        if name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else "see docs/configuration.md"
        problems.append(f"{name} is not a setting; {hint}")
    return problems


def unknown_settings(
    model: type[BaseModel], environ: Mapping[str, str], env_file: Path
) -> list[str]:
    """Names in ``environ`` and ``env_file`` that look like settings of ``model`` and are not."""
    known = known_names(model) | hook_names()
    return unknown_names([*environ, *env_file_names(env_file)], known)
