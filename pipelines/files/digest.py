"""What is asked of a file (a digest, a size), and how a file ends up pinned. Imports no I/O.

A stage may declare ``weights_digest`` / ``labels_digest``: a full sha256 (64 hex digits) or
a prefix of one (at least 8 hex digits, torch hub's ``name-1a2b3c4d.pth`` convention); an
operator may give a file's verified sha256 (``WORKER_MODEL__FILE_DIGESTS``); a publisher may
state its size. How a file is pinned, as ``models fetch`` and ``check`` print it:

- ``verified``: the operator gave its full sha256;
- ``published``: the pipeline declared its full sha256;
- ``prefix``: a prefix was declared, the full sha256 recorded at the first download;
- ``recorded``: nothing declared, the first download's sha256 recorded and held from then on
  (trust on first use);
- ``unpinned``: a local path with nothing declared (read as it is).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from config.errors import ConfigError
from config.redact import redact_url

Pinned = Literal["verified", "published", "prefix", "recorded", "unpinned"]
FULL_HEX = 64
MIN_PREFIX_HEX = 8
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class Wanted:
    """A declared digest (lower-case hex, full or a prefix) or none, whether the operator
    verified it, and the size its publisher states (None: not stated)."""

    hex: str = ""
    verified: bool = False
    size_bytes: int | None = None

    @classmethod
    def parse(
        cls, declared: str | None, uri: str, verified: bool = False, size_bytes: int | None = None
    ) -> Wanted:
        """``declared`` checked: ConfigError naming the file when it is no sha256 or prefix."""
        text = (declared or "").strip().lower().removeprefix("sha256:")
        if not text:
            return cls(size_bytes=size_bytes)
        if not _HEX.fullmatch(text) or not MIN_PREFIX_HEX <= len(text) <= FULL_HEX:
            raise ConfigError(
                f"digest {declared!r} of {redact_url(uri)} is not a sha256: give its 64 hex "
                f"digits or a prefix of at least {MIN_PREFIX_HEX}"
            )
        return cls(text, verified and len(text) == FULL_HEX, size_bytes)

    @property
    def full(self) -> bool:
        return len(self.hex) == FULL_HEX

    def fits(self, sha256: str) -> bool:
        """Whether a file of this sha256 is the one declared (anything fits no declaration)."""
        return sha256.startswith(self.hex)

    def sized(self, size_bytes: int) -> bool:
        """Whether a file of this size is the one published (any size when none is stated)."""
        return self.size_bytes is None or size_bytes == self.size_bytes

    def pinned(self, remote: bool) -> Pinned:
        if self.verified:
            return "verified"
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


def size_refusal(uri: str, expected_bytes: int, got: str) -> ConfigError:
    """The error for a file whose size is not the one its publisher states: the file (no
    secrets), both sizes."""
    return ConfigError(
        f"model file {redact_url(uri)} refused, its size is not the published one: expected "
        f"{expected_bytes} bytes, got {got} bytes"
    )
