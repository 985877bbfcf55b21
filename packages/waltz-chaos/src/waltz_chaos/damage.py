"""Storage faults: what is done to a storage node's files, and how its repair is judged.

The file operations act on a node's ``fs`` data directory (the ``data`` directory in
its member's ``data_dir``): while the node is stopped (:func:`corrupt_segment`,
:func:`truncate_segment`, :func:`wipe`, :func:`restore`, and :class:`Copies`, the copies
of its directory taken whenever the nemesis stops it, for a rollback), or while it runs
(:func:`flip_sealed`: a sealed segment is never written again, so the damage stays until
a read, a scrub (:func:`scrub`) or a verifying start-up finds it). Each returns what it
did, for the run's timeline.

A damaged node is *repaired* (:func:`repaired`) when, for every partition, its replica
has no missing range, its low-water-mark session is not ``LOST``, and its log reaches
the partition's high-water mark at the node's restart: the cluster holds on it again
everything that was committed when it came back.
"""

from __future__ import annotations

import logging
import random
import shutil
from collections.abc import Mapping
from pathlib import Path

from waltz_api.contracts.transport import Transport
from waltz_api.errors import StorageError, TransportError
from waltz_api.storage_client import StorageAdminClient
from waltz_api.types import LOST_SESSION
from waltz_chaos.errors import ChaosError
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools

log = logging.getLogger(__name__)

KEEP_COPIES = 3
"""Copies of a node's data directory kept (the oldest is what a rollback restores)."""


def _segments(data: Path) -> list[tuple[int, list[Path]]]:
    """(partition, its segment data files in log order) for every partition directory
    whose newest segment holds records."""
    found = []
    for child in sorted(data.iterdir()) if data.is_dir() else []:
        if not child.name.isdigit() or not child.is_dir():
            continue
        paths = [
            child / fmt.segment_file_name(first, fmt.SEGMENT_SUFFIX)
            for first in tools.segment_firsts(child)
        ]
        if paths and paths[-1].stat().st_size > fmt.HEADER_SIZE:
            found.append((int(child.name), paths))
    return found


def _where(data: Path, path: Path) -> str:
    return str(path.relative_to(data))


def _flip(path: Path, rng: random.Random) -> str:
    """XOR a few bytes of a segment's records (after its header) with 0xFF."""
    size = path.stat().st_size
    if size <= fmt.HEADER_SIZE:
        raise ChaosError(f"{path.name} holds no record to damage")
    offset = rng.randrange(fmt.HEADER_SIZE, size)
    count = min(rng.randint(1, 4), size - offset)
    with path.open("r+b") as f:
        f.seek(offset)
        old = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))
    return f"{count} bytes at offset {offset} of"


def corrupt_segment(data: Path, rng: random.Random) -> str:
    """Flip bytes of one segment of one partition (any segment, the newest too)."""
    partitions = _segments(data)
    if not partitions:
        raise ChaosError(f"no segment in {data} to corrupt")
    _, paths = rng.choice(partitions)
    path = rng.choice(paths)
    return f"{_flip(path, rng)} {_where(data, path)} flipped"


def truncate_segment(data: Path, rng: random.Random) -> str:
    """Cut the newest segment of one partition somewhere in its second half (at a record's
    end or inside a record): what it acknowledged there is gone, and start-up recovery
    takes the cut for a torn write, or an end."""
    partitions = _segments(data)
    if not partitions:
        raise ChaosError(f"no segment in {data} to cut")
    _, paths = rng.choice(partitions)
    path = paths[-1]
    size = path.stat().st_size
    cut = rng.randrange(max(fmt.HEADER_SIZE, size // 2), size)
    with path.open("r+b") as f:
        f.truncate(cut)
    return f"{_where(data, path)} cut from {size} to {cut} bytes"


def flip_sealed(data: Path, rng: random.Random) -> str:
    """Flip bytes of a sealed segment (one that is not its partition's newest): the node
    runs on, a read of the damaged record finds it."""
    sealed = [path for _, paths in _segments(data) for path in paths[:-1]]
    if not sealed:
        raise ChaosError(f"no sealed segment in {data} yet")
    path = rng.choice(sealed)
    return f"{_flip(path, rng)} {_where(data, path)} flipped"


def wipe(data: Path) -> str:
    """Remove the data directory (a new, empty disk)."""
    count = sum(1 for p in data.rglob("*") if p.is_file()) if data.exists() else 0
    shutil.rmtree(data, ignore_errors=True)
    return f"{count} files removed"


def restore(data: Path, copy: Path) -> None:
    """Replace the data directory with ``copy`` (a rollback)."""
    shutil.rmtree(data, ignore_errors=True)
    shutil.copytree(copy, data)


class Copies:
    """Copies of the storage nodes' data directories, each taken while the node was
    stopped (a copy of a running node's directory would not be a consistent state of
    it); the last :data:`KEEP_COPIES` per node are kept, under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._taken: dict[str, list[tuple[Path, float]]] = {}
        self._count = 0

    def take(self, node: str, data: Path, when: float) -> None:
        """Copy ``node``'s data directory (stopped), taken at ``when`` (run seconds)."""
        if not data.exists():
            return
        kept = self._taken.setdefault(node, [])
        self._count += 1
        target = self.root / f"{self._count:03d}-{node}-{when:.1f}s"
        shutil.copytree(data, target)
        kept.append((target, when))
        while len(kept) > KEEP_COPIES:
            old, _ = kept.pop(0)
            shutil.rmtree(old, ignore_errors=True)

    def oldest(self, node: str) -> tuple[Path, float] | None:
        """The oldest copy of ``node`` kept, and when it was taken."""
        kept = self._taken.get(node)
        return kept[0] if kept else None


async def scrub(transport: Transport, endpoint: str, timeout: float = 60.0) -> str:
    """A scrub pass now on the running node at ``endpoint`` (``waltz storage scrub
    --endpoint``, unbounded rate): the damage it finds becomes a hole the server repairs.
    Returns what it found; raises StorageError or TransportError when it could not run."""
    admin = await StorageAdminClient.connect(transport, endpoint, sender="chaos", timeout=5.0)
    try:
        result = await admin.command("scrub", timeout=timeout, rate_bytes_per_second=0)
    finally:
        await admin.close()
    found = [
        f"{first}..{last} of partition {row['partition_id']}"
        for row in result.get("partitions", [])
        for first, last in row.get("damaged") or []
    ]
    if not found:
        return "a scrub pass found no damage"
    return f"a scrub pass found transactions {', '.join(found)} damaged"


async def repaired(
    transport: Transport, endpoint: str, high_water_marks: Mapping[int, int]
) -> str | None:
    """None once the node at ``endpoint`` is repaired (see the module docstring), else
    what it still lacks."""
    try:
        admin = await StorageAdminClient.connect(transport, endpoint, sender="chaos", timeout=5.0)
    except (StorageError, TransportError, TimeoutError, OSError) as exc:
        return f"not answering ({type(exc).__name__})"
    try:
        rows = await admin.list_partitions_raw()
    except (StorageError, TransportError, TimeoutError, OSError) as exc:
        return f"no partition list ({type(exc).__name__}: {exc})"
    finally:
        await admin.close()
    by_id = {row["partition_id"]: row for row in rows}
    for partition, high in sorted(high_water_marks.items()):
        row = by_id.get(partition)
        if row is None or row.get("error") or row.get("max_transaction_id") is None:
            return f"partition {partition} not open ({(row or {}).get('error')})"
        if row["missing_ranges"]:
            return f"partition {partition} misses {row['missing_ranges']}"
        info = row.get("session_info") or {}
        if info.get("low_water_mark_session_id") == LOST_SESSION:
            return f"partition {partition} is LOST (not caught up)"
        if row["max_transaction_id"] < high:
            return f"partition {partition} at {row['max_transaction_id']} of {high}"
    return None


__all__ = [
    "KEEP_COPIES",
    "Copies",
    "corrupt_segment",
    "flip_sealed",
    "repaired",
    "restore",
    "scrub",
    "truncate_segment",
    "wipe",
]
