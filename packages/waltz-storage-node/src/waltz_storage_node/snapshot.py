"""``waltz storage snapshot`` and ``waltz storage restore``: a consistent, verifiable
copy of a running storage node's partitions, and putting it back.

A snapshot is taken through the node's public surface only: the admin command
``list`` (each partition's max transaction id and session info) and ordinary
record reads (``RecordListRequest``), made with each partition's current store
session id, so they fence nothing. Per partition it reads the marks, copies
records 0..max, and reads the marks again; if the store session changed
meanwhile (a recovery may have truncated an uncommitted tail) or the node
fenced the reads, the partition is copied again (at most ``attempts`` times).
Each partition's copy is therefore the replica as it was at one point in time
(records and session info together), exactly what a restart of the node would
have found on its disk: the servers' recovery treats a restored replica like
any replica that was down (its session info says what it last took part in).

The snapshot is a directory:

- ``data/``: a storage directory of the chosen engine (``fs`` by default),
  written through the engine's own API (``waltz storage verify`` checks an
  ``fs`` one file by file);
- ``manifest.json`` (written last: a snapshot without it is incomplete):
  cluster key, number of partitions, engine, source endpoint, time, and per
  partition its max transaction id, record count, session info and the SHA-256
  of its records (id, request id, header, data, checksum in order).

:func:`verify_snapshot` reads every record back through the engine and checks
it against the manifest; :func:`restore_snapshot` verifies, then copies
``data/`` into an empty data directory for the node to start on, and marks every
restored partition *restored*: its low-water marks read ``LOST_SESSION``
(:func:`mark_restored`). What the node acknowledged after the snapshot was taken is
gone from the copy, and nothing in the copy says so (its marks may name the very
session still running); marked, the replica rejoins as a suspect one, never counted as
a voter until it holds the committed log again (docs/server.md, "Storage faults: the
guarantee"). ``keep_marks`` (``--keep-marks``) leaves the marks as copied: only for a
whole cluster restored from snapshots, where no replica holds more than its copy.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import shutil
import struct
import typing
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from waltz_api.contracts.storage import StorageEngine, StoragePartition
from waltz_api.errors import SessionFencedError, StorageError, WaltzError
from waltz_api.features import MIN_FEATURE_LEVEL
from waltz_api.plugins import get_registry
from waltz_api.storage_client import StorageAdminClient, StorageClient
from waltz_api.types import LOST_SESSION, NO_SESSION, Record, SessionInfo

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
DATA = "data"
FORMAT = 1
BATCH_RECORDS = 2000
_RECORD_HEAD = struct.Struct(">qqqqqiI")


class SnapshotError(WaltzError):
    """A snapshot could not be taken, verified or restored (the message says why)."""


def _digest(records: Iterable[Record], digest: Any) -> int:
    count = 0
    for r in records:
        rid = r.req_id
        digest.update(
            _RECORD_HEAD.pack(
                r.transaction_id,
                rid.client_id,
                rid.generation,
                rid.partition_id,
                rid.seq_num,
                r.header,
                r.checksum,
            )
        )
        digest.update(struct.pack(">I", len(r.data)))
        digest.update(r.data)
        count += 1
    return count


def _session_info(raw: dict[str, Any]) -> SessionInfo:
    fields = {f.name for f in dataclasses.fields(SessionInfo)}
    return SessionInfo(**{k: int(v) for k, v in raw.items() if k in fields})


def _same_session(stored: SessionInfo, expected: SessionInfo) -> bool:
    """Whether the copy holds the session info taken. An engine that does not keep
    ``low_water_mark_session_id`` (it reads back as NO_SESSION after a reopen, as the
    contract allows) still holds the rest."""
    if stored.low_water_mark_session_id == NO_SESSION:
        expected = dataclasses.replace(expected, low_water_mark_session_id=NO_SESSION)
    return stored == expected


async def _open_engine(
    engine: str,
    location: Path,
    cluster_key: uuid.UUID,
    num_partitions: int,
    feature_level: int | None = None,
) -> StorageEngine:
    """``feature_level``: the level a new storage is created at (a snapshot: the source
    node's, so that a node of the release that wrote it can be restored from it)."""
    engine_class = typing.cast(type[StorageEngine], get_registry().get("storage", engine).factory)
    return await engine_class.open(
        str(location),
        cluster_key=cluster_key,
        num_partitions=num_partitions,
        feature_level=feature_level,
    )


async def _copy_partition(
    client: StorageClient,
    admin: StorageAdminClient,
    target: StoragePartition,
    partition_id: int,
    attempts: int,
) -> dict[str, Any]:
    """Copy one partition into ``target`` (emptied first); its manifest entry."""
    for attempt in range(1, attempts + 1):
        before = await _row(admin, partition_id)
        info = before["session_info"]
        highest = int(before["max_transaction_id"])
        if before["missing_ranges"]:
            raise SnapshotError(
                f"partition {partition_id} has ranges lost to damage "
                f"{before['missing_ranges']}; let the servers repair it from a peer first"
            )
        await target.truncate(-1)
        digest = hashlib.sha256()
        count = 0
        try:
            next_id = 0
            while next_id <= highest:
                records = await client.records(
                    int(info["session_id"]),
                    partition_id,
                    next_id,
                    min(BATCH_RECORDS, highest - next_id + 1),
                )
                if not records:
                    raise SnapshotError(
                        f"partition {partition_id}: the node returned no record at "
                        f"{next_id} below its max transaction id {highest}"
                    )
                await target.append(records)
                count += _digest(records, digest)
                next_id = records[-1].transaction_id + 1
        except SessionFencedError as exc:
            log.info("partition %d: a new store session during the copy (%s)", partition_id, exc)
            continue
        after = await _row(admin, partition_id)
        if after["session_info"] != info or int(after["max_transaction_id"]) < highest:
            log.info(
                "partition %d: the store session changed during the copy (attempt %d)",
                partition_id,
                attempt,
            )
            continue
        await target.set_session_info(_session_info(info))
        return {
            "max_transaction_id": highest,
            "records": count,
            "session_info": info,
            "sha256": digest.hexdigest(),
        }
    raise SnapshotError(
        f"partition {partition_id}: its store session changed during each of {attempts} "
        "copies; try again when the partition is not recovering"
    )


async def _row(admin: StorageAdminClient, partition_id: int) -> dict[str, Any]:
    for row in await admin.list_partitions_raw():
        if row["partition_id"] == partition_id:
            if row["error"] or row["session_info"] is None:
                raise SnapshotError(f"partition {partition_id}: {row['error'] or 'unreadable'}")
            return row
    raise SnapshotError(f"partition {partition_id} is no longer hosted by the node")


async def take_snapshot(
    client: StorageClient,
    out: str | os.PathLike[str],
    *,
    engine: str = "fs",
    attempts: int = 5,
) -> dict[str, Any]:
    """Copy every partition the node behind ``client`` hosts into the new directory
    ``out``; the manifest (also written to ``out/manifest.json``)."""
    out_path = Path(out)
    _require_empty(out_path, "give a new directory for the snapshot")
    admin = StorageAdminClient(client)
    node = await admin.info()
    cluster_key = uuid.UUID(node["cluster_key"])
    num_partitions = int(node["num_partitions"])
    await client.open(cluster_key, num_partitions)
    partial = _fresh(out_path.with_name(out_path.name + ".partial"))
    # a node of 0.1.0 reports no level: it writes level 1's formats
    level = int(node.get("feature_level", MIN_FEATURE_LEVEL))
    target = await _open_engine(engine, partial / DATA, cluster_key, num_partitions, level)
    partitions: dict[str, Any] = {}
    try:
        for partition_id in sorted(int(p) for p in node["partitions"]):
            copy = await target.add_partition(partition_id)
            partitions[str(partition_id)] = await _copy_partition(
                client, admin, copy, partition_id, attempts
            )
    finally:
        await target.close()
    manifest = {
        "format": FORMAT,
        "cluster_key": str(cluster_key),
        "num_partitions": num_partitions,
        "engine": engine,
        "source": node.get("endpoint"),
        "taken": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "partitions": partitions,
    }
    _write_manifest(partial / MANIFEST, manifest)
    _move_into_place(partial, out_path)
    return manifest


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    with path.open("w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifest(snapshot: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(snapshot) / MANIFEST
    try:
        manifest: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SnapshotError(
            f"{path} is missing: {snapshot} is not a snapshot, or an incomplete one"
        ) from None
    except ValueError as exc:
        raise SnapshotError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("format") != FORMAT:
        raise SnapshotError(
            f"{path} is snapshot format {manifest.get('format')!r}; this Waltz reads {FORMAT}"
        )
    return manifest


async def verify_snapshot(snapshot: str | os.PathLike[str]) -> dict[str, Any]:
    """Read every record of the snapshot back through its engine and compare with the
    manifest (ids, count, SHA-256, session info); the manifest, or SnapshotError."""
    manifest = read_manifest(snapshot)
    engine = await _open_engine(
        manifest["engine"],
        Path(snapshot) / DATA,
        uuid.UUID(manifest["cluster_key"]),
        int(manifest["num_partitions"]),
    )
    problems: list[str] = []
    try:
        hosted = set(engine.partition_ids())
        expected = {int(p) for p in manifest["partitions"]}
        if hosted != expected:
            problems.append(f"partitions {sorted(hosted)} in data/, {sorted(expected)} listed")
        for key, entry in sorted(manifest["partitions"].items(), key=lambda kv: int(kv[0])):
            partition_id = int(key)
            if partition_id not in hosted:
                continue
            partition = engine.partition(partition_id)
            highest = partition.max_transaction_id()
            if highest != entry["max_transaction_id"]:
                problems.append(
                    f"partition {partition_id}: max transaction id {highest}, "
                    f"manifest says {entry['max_transaction_id']}"
                )
                continue
            digest = hashlib.sha256()
            count = 0
            next_id = 0
            while next_id <= highest:
                records = await partition.read_records(next_id, BATCH_RECORDS)
                if not records:
                    problems.append(f"partition {partition_id}: no record at {next_id}")
                    break
                count += _digest(records, digest)
                next_id = records[-1].transaction_id + 1
            if count != entry["records"] or digest.hexdigest() != entry["sha256"]:
                problems.append(
                    f"partition {partition_id}: {count} records whose SHA-256 is "
                    f"{digest.hexdigest()[:16]}..., manifest says {entry['records']} and "
                    f"{entry['sha256'][:16]}..."
                )
            if not _same_session(partition.session_info(), _session_info(entry["session_info"])):
                problems.append(
                    f"partition {partition_id}: session info {partition.session_info()}, "
                    f"manifest says {entry['session_info']}"
                )
    except StorageError as exc:
        problems.append(str(exc))
    finally:
        await engine.close()
    if problems:
        raise SnapshotError(f"snapshot {snapshot} is damaged: " + "; ".join(problems))
    return manifest


async def restore_snapshot(
    snapshot: str | os.PathLike[str],
    data_dir: str | os.PathLike[str],
    *,
    keep_marks: bool = False,
) -> dict[str, Any]:
    """Verify ``snapshot`` and copy its storage into ``data_dir`` (absent or empty): the
    storage node then starts on it (with the snapshot's cluster key and partitions).
    Every partition is marked restored (:func:`mark_restored`) unless ``keep_marks``."""
    target = Path(data_dir)
    _require_empty(
        target, "restore into an empty directory (stop the node and move its old data away)"
    )
    manifest = await verify_snapshot(snapshot)
    partial = _fresh(target.with_name(target.name + ".restoring"))
    partial.rmdir()
    shutil.copytree(Path(snapshot) / DATA, partial)
    if not keep_marks:
        await mark_restored(
            manifest["engine"],
            partial,
            uuid.UUID(manifest["cluster_key"]),
            int(manifest["num_partitions"]),
        )
    _fsync_tree(partial)
    _move_into_place(partial, target)
    return manifest


async def mark_restored(
    engine_name: str, data_dir: Path, cluster_key: uuid.UUID, num_partitions: int
) -> list[int]:
    """Record in a stopped node's storage that it was restored from a copy: every
    partition's low-water marks read ``LOST_SESSION`` (durably, through the engine), as an
    engine does for a damaged tail it moved aside. Returns the partitions marked."""
    engine = await _open_engine(engine_name, data_dir, cluster_key, num_partitions)
    try:
        marked = []
        for partition_id in engine.partition_ids():
            partition = engine.partition(partition_id)
            info = partition.session_info()
            if info.low_water_mark_session_id != LOST_SESSION:
                await partition.set_session_info(
                    dataclasses.replace(info, low_water_mark_session_id=LOST_SESSION)
                )
            marked.append(partition_id)
        return marked
    finally:
        await engine.close()


def _require_empty(path: Path, what_to_do: str) -> None:
    if path.exists() and any(path.iterdir()):
        raise SnapshotError(f"{path} is not empty; {what_to_do}")


def _fresh(path: Path) -> Path:
    """An empty directory at ``path`` (what an interrupted run left there is removed)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _move_into_place(partial: Path, target: Path) -> None:
    if target.exists():
        target.rmdir()  # empty: checked before
    os.replace(partial, target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
