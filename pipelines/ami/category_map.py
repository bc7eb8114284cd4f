"""AMI's category maps: JSON objects ``{label: index}``, read as labels in index order."""

from __future__ import annotations

import json

from config.errors import ConfigError


def labels_of(text: str, where: str) -> tuple[str, ...]:
    """The labels of a category map, ``labels[index] == label``; ConfigError naming ``where``
    when it is not a map of labels to the indices 0..n-1, each once."""
    try:
        found = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"category map {where} is not JSON: {error}") from None
    if not isinstance(found, dict) or not found:
        raise ConfigError(f"category map {where} must be a non-empty JSON object label: index")
    by_index: dict[int, str] = {}
    for label, index in found.items():
        if not isinstance(index, int) or isinstance(index, bool):
            raise ConfigError(f"category map {where}: {label!r} has index {index!r}, not an int")
        if index in by_index:
            raise ConfigError(f"category map {where}: index {index} is given twice")
        by_index[index] = label
    if sorted(by_index) != list(range(len(by_index))):
        raise ConfigError(f"category map {where}: indices must be 0..{len(by_index) - 1}")
    return tuple(by_index[i] for i in range(len(by_index)))
