"""What a declared digest asks of a file, and how a file ends up pinned. Imports no I/O.

A stage may declare ``weights_digest`` / ``labels_digest``: a full sha256 (64 hex digits) or
a prefix of one (at least 8 hex digits, torch hub's ``name-1a2b3c4d.pth`` convention). How a
file is pinned, as ``models fetch`` and ``check`` print it:

- ``published``: the full sha256 was declared;
- ``prefix``: a prefix was declared, the full sha256 recorded at the first download;
- ``recorded``: nothing declared, the first download's sha256 recorded and held from then on;
- ``unpinned``: a local path with nothing declared (read as it is).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from config.errors import ConfigError
from config.redact import redact_url

Pinned = Literal["published", "prefix", "recorded", "unpinned"]
FULL_HEX = 64
MIN_PREFIX_HEX = 8
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class Wanted:
    """A declared digest (lower-case hex, full or a prefix), or none."""

    hex: str = ""

    @classmethod
    def parse(cls, declared: str | None, uri: str) -> Wanted:
        """``declared`` checked: ConfigError naming the file when it is no sha256 or prefix."""
        text = (declared or "").strip().lower().removeprefix("sha256:")
        if not text:
            return cls()
        if not _HEX.fullmatch(text) or not MIN_PREFIX_HEX <= len(text) <= FULL_HEX:
            raise ConfigError(
                f"digest {declared!r} of {redact_url(uri)} is not a sha256: give its 64 hex "
                f"digits or a prefix of at least {MIN_PREFIX_HEX}"
            )
        return cls(text)

    @property
    def full(self) -> bool:
        return len(self.hex) == FULL_HEX

    def fits(self, sha256: str) -> bool:
        """Whether a file of this sha256 is the one declared (anything fits no declaration)."""
        return sha256.startswith(self.hex)

    def pinned(self, remote: bool) -> Pinned:
        if self.full:
            return "published"
        if self.hex:
            return "prefix"
        return "recorded" if remote else "unpinned"


def refusal(uri: str, expected: str, got: str, why: str = "checksum mismatch") -> ConfigError:
    """The error for a file whose content is not the one expected: the file (no secrets) and
    both digests."""
    return ConfigError(
        f"model file {redact_url(uri)} refused, {why}: expected sha256 {expected}, got {got}"
    )
