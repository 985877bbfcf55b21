"""The archive mark in the cluster metadata: ``/archive/partition/<p>``.

The value (JSON, with the metadata's ``"format"`` and ``"type"`` as every Waltz value)::

    {"format": 1, "type": "archive_mark", "partition_id": 3, "mark": 187211,
     "manifest": "manifest/00000000000000187211-b7d4e0a2.json",
     "ranges": 2, "bytes": 268502116, "url": "s3://bucket/waltz"}

``mark`` is the last archived (and verified) id, ``manifest`` the manifest that lists
every range up to it. The mark only moves forward, and only by compare-and-set on the
version the archiver read (:func:`advance_mark`): two archivers racing never both
advance it from the same state. A partition that never archived has no value (mark -1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from waltz_api.cluster import FORMAT_VERSION
from waltz_api.contracts.coordination import Coordination, join_path
from waltz_api.errors import BadVersionError, CoordinationError, NodeExistsError
from waltz_api.types import NO_TRANSACTION

ARCHIVE_DIR = "/archive/partition"
KIND = "archive_mark"


def mark_path(partition_id: int) -> str:
    return join_path(ARCHIVE_DIR, partition_id)


@dataclass(frozen=True)
class ArchiveMark:
    """A partition's archive mark as the cluster metadata holds it."""

    partition_id: int
    mark: int = NO_TRANSACTION
    manifest: str = ""
    ranges: int = 0
    archived_bytes: int = 0
    url: str = ""
    version: int = -1
    """The coordination version it was read at (-1: absent), for the compare-and-set."""

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "type": KIND,
            "partition_id": self.partition_id,
            "mark": self.mark,
            "manifest": self.manifest,
            "ranges": self.ranges,
            "bytes": self.archived_bytes,
            "url": self.url,
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes, version: int, partition_id: int) -> ArchiveMark:
        path = mark_path(partition_id)
        try:
            value = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CoordinationError(f"{path} does not hold Waltz metadata JSON: {exc}") from None
        if not isinstance(value, dict) or value.get("type", KIND) != KIND:
            raise CoordinationError(f"{path} does not hold an archive mark")
        found = value.get("format", 1)
        if not isinstance(found, int) or found > FORMAT_VERSION:
            raise CoordinationError(
                f"{path} was written in metadata format {found}, newer than this Waltz "
                f"understands ({FORMAT_VERSION}); upgrade Waltz"
            )
        try:
            return cls(
                int(value["partition_id"]),
                int(value["mark"]),
                str(value.get("manifest", "")),
                int(value.get("ranges", 0)),
                int(value.get("bytes", 0)),
                str(value.get("url", "")),
                version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CoordinationError(f"{path} holds an invalid archive mark: {exc}") from None


async def read_mark(coordination: Coordination, partition_id: int) -> ArchiveMark:
    """The partition's archive mark (mark -1, version -1 when it never archived)."""
    found = await coordination.get(mark_path(partition_id))
    if found is None:
        return ArchiveMark(partition_id)
    return ArchiveMark.decode(found.value, found.version, partition_id)


async def advance_mark(
    coordination: Coordination, current: ArchiveMark, new: ArchiveMark
) -> ArchiveMark:
    """Replace ``current`` (as read, with its version) by ``new``, only if nothing changed
    it since: raises BadVersionError on a lost race (the caller's round is void: re-read).
    The mark never moves back (CoordinationError)."""
    if new.partition_id != current.partition_id:
        raise CoordinationError(
            f"archive mark of partition {new.partition_id} written over partition "
            f"{current.partition_id}'s"
        )
    if new.mark <= current.mark:
        raise CoordinationError(
            f"partition {new.partition_id}: the archive mark only moves forward "
            f"({current.mark} -> {new.mark} refused)"
        )
    path = mark_path(new.partition_id)
    raw = new.encode()
    if current.version < 0:
        try:
            version = await coordination.create(path, raw)
        except NodeExistsError:
            raise BadVersionError(
                f"partition {new.partition_id}'s archive mark was created meanwhile"
            ) from None
    else:
        version = await coordination.set(path, raw, expected_version=current.version)
    return ArchiveMark(
        new.partition_id,
        new.mark,
        new.manifest,
        new.ranges,
        new.archived_bytes,
        new.url,
        version,
    )
