"""A partition's manifest: every archived range from id 0 up to its mark.

A manifest is an immutable JSON object in the archive (``manifest/<mark>-<token>.json``
under the partition's directory); each archived range writes a new one holding the
previous ranges and itself. The cluster metadata's archive mark names the current one.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from typing import Any

from waltz_api.errors import ArchiveError
from waltz_api.types import NO_TRANSACTION

MANIFEST_FORMAT = 1


@dataclass(frozen=True, slots=True)
class ArchivedRange:
    """One archived range: ids ``first..last`` in the object ``name`` (relative to the
    partition's directory), with its record count, object bytes, data bytes and
    digest (:class:`waltz_archive.records.Digest`)."""

    first: int
    last: int
    name: str
    size: int
    data_bytes: int
    digest: int

    @property
    def records(self) -> int:
        return self.last - self.first + 1

    def to_json(self) -> dict[str, Any]:
        return {
            "first": self.first,
            "last": self.last,
            "object": self.name,
            "records": self.records,
            "bytes": self.size,
            "data_bytes": self.data_bytes,
            "digest": self.digest,
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> ArchivedRange:
        archived = cls(
            int(value["first"]),
            int(value["last"]),
            str(value["object"]),
            int(value["bytes"]),
            int(value.get("data_bytes", 0)),
            int(value["digest"]),
        )
        if int(value.get("records", archived.records)) != archived.records:
            raise ValueError(f"range {archived.first}..{archived.last} counts {value['records']}")
        return archived


@dataclass(frozen=True)
class Manifest:
    """Every archived range of one partition, dense from id 0."""

    partition_id: int
    ranges: tuple[ArchivedRange, ...] = ()
    previous: str = ""
    """The manifest this one extends (its name), "" for the first."""
    _firsts: list[int] = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        expected = 0
        for archived in self.ranges:
            if archived.first != expected or archived.last < archived.first:
                raise ArchiveError(
                    f"manifest of partition {self.partition_id}: range "
                    f"{archived.first}..{archived.last} does not follow {expected - 1}"
                )
            expected = archived.last + 1
        self._firsts.extend(r.first for r in self.ranges)

    @property
    def mark(self) -> int:
        """The last archived id (-1: nothing archived)."""
        return self.ranges[-1].last if self.ranges else NO_TRANSACTION

    @property
    def total_bytes(self) -> int:
        return sum(r.size for r in self.ranges)

    def find(self, transaction_id: int) -> ArchivedRange | None:
        """The range holding ``transaction_id``, or None when it is not archived."""
        if not 0 <= transaction_id <= self.mark:
            return None
        return self.ranges[bisect.bisect_right(self._firsts, transaction_id) - 1]

    def extended(self, archived: ArchivedRange, previous: str) -> Manifest:
        return Manifest(self.partition_id, (*self.ranges, archived), previous)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "format": MANIFEST_FORMAT,
                "type": "waltz_archive_manifest",
                "partition_id": self.partition_id,
                "mark": self.mark,
                "previous": self.previous,
                "ranges": [r.to_json() for r in self.ranges],
            },
            indent=1,
        ).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes, where: str, partition_id: int | None = None) -> Manifest:
        try:
            value = json.loads(raw.decode("utf-8"))
            if not isinstance(value, dict) or value.get("type") != "waltz_archive_manifest":
                raise ValueError("not a Waltz archive manifest")
            if int(value.get("format", 0)) > MANIFEST_FORMAT:
                raise ValueError(
                    f"manifest format {value['format']} is newer than this Waltz reads "
                    f"({MANIFEST_FORMAT}): upgrade Waltz"
                )
            manifest = cls(
                int(value["partition_id"]),
                tuple(ArchivedRange.from_json(r) for r in value["ranges"]),
                str(value.get("previous", "")),
            )
            if int(value["mark"]) != manifest.mark:
                raise ValueError(f"its mark {value['mark']} is not its last range's end")
        except ArchiveError:
            raise
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise ArchiveError(f"archive manifest {where} is not valid: {exc}") from None
        if partition_id is not None and manifest.partition_id != partition_id:
            raise ArchiveError(
                f"archive manifest {where} is partition {manifest.partition_id}'s, "
                f"not partition {partition_id}'s"
            )
        return manifest
