"""Where a publisher's files may be downloaded from, and what it states of them. Imports no I/O.

A publisher names its files under one base URL (``name_base``: the URIs a pipeline declares,
registers and is cached under) and serves them from one or more bases, tried in order
(``bases``: the same relative path under each). It may state each file's size in bytes, by
relative path (``sizes``). A URI not under ``name_base`` is its own only host.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Hosts:
    name_base: str = ""
    bases: tuple[str, ...] = ()
    sizes: Mapping[str, int] = field(default_factory=dict)

    def relative(self, uri: str) -> str | None:
        """``uri``'s path under ``name_base``, or None when it is not under it."""
        if not self.name_base or not uri.startswith(self.name_base):
            return None
        return uri[len(self.name_base) :]

    def candidates(self, uri: str) -> tuple[str, ...]:
        """The URLs to download ``uri`` from, in order."""
        relative = self.relative(uri)
        if relative is None or not self.bases:
            return (uri,)
        return tuple(_joined(base, relative) for base in self.bases)

    def size_of(self, uri: str) -> int | None:
        """The size in bytes the publisher states for ``uri``'s file, or None."""
        relative = self.relative(uri)
        return None if relative is None else self.sizes.get(relative)


def _joined(base: str, relative: str) -> str:
    return base.rstrip("/") + "/" + relative
