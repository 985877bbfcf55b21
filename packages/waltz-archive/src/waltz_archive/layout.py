"""Names in an archive (docs/archive.md, "What is in the archive").

::

    <root>/partition-<p>/<first:020d>-<last:020d>-<token>.parquet   a range
    <root>/partition-<p>/manifest/<mark:020d>-<token>.json           a manifest
    <root>/partition-<p>/set-aside/...                                 objects set aside

Every name ends with a random token: nothing is ever written twice under one name, so
nothing in the archive is overwritten or rewritten in place. Objects no manifest of the
current incarnation may ever name (another cluster's orphans, a restored cluster's
abandoned history) are moved under ``set-aside/`` with their names (docs/archive.md,
"Incarnations"): nothing reads them there, an operator may delete them.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

ID_DIGITS = 20
MANIFEST_DIR = "manifest"
SET_ASIDE_DIR = "set-aside"
_RANGE = re.compile(r"^(\d{20})-(\d{20})-([0-9a-f]{8,32})\.parquet$")
_MANIFEST = re.compile(r"^(\d{20})-([0-9a-f]{8,32})\.json$")


def new_token() -> str:
    return secrets.token_hex(4)


def partition_dir(partition_id: int) -> str:
    return f"partition-{partition_id}"


@dataclass(frozen=True, slots=True)
class RangeName:
    first: int
    last: int
    token: str

    @property
    def name(self) -> str:
        return f"{self.first:0{ID_DIGITS}d}-{self.last:0{ID_DIGITS}d}-{self.token}.parquet"

    @classmethod
    def parse(cls, name: str) -> RangeName | None:
        match = _RANGE.match(name.rsplit("/", 1)[-1])
        if match is None:
            return None
        first, last = int(match.group(1)), int(match.group(2))
        return cls(first, last, match.group(3)) if first <= last else None


@dataclass(frozen=True, slots=True)
class ManifestName:
    mark: int
    token: str

    @property
    def name(self) -> str:
        """Relative to the partition's directory."""
        return f"{MANIFEST_DIR}/{self.mark:0{ID_DIGITS}d}-{self.token}.json"

    @classmethod
    def parse(cls, name: str) -> ManifestName | None:
        match = _MANIFEST.match(name.rsplit("/", 1)[-1])
        if match is None:
            return None
        return cls(int(match.group(1)), match.group(2))


def set_aside(name: str) -> str:
    """Where an object of the partition's directory (``name`` relative to it) is set
    aside."""
    return f"{SET_ASIDE_DIR}/{name}"


def range_prefix(first: int) -> str:
    """The start of the name of every range object beginning at ``first``."""
    return f"{first:0{ID_DIGITS}d}-"
