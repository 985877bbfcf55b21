"""The end of a run: the cluster read back, the clients' histories loaded (the checker's model).

- :func:`read_back`: each partition's committed high-water mark and log as the
  cluster serves them (a ``waltz_client`` reading ranges), and every replica read
  from its storage node (the storage protocol, with the session id the replica
  itself holds), waiting a bounded time for replicas still catching up;
- :func:`load_histories`: each client's SQLite database (its ops, the transactions it
  applied, its state at the end) as the checker's
  :class:`~waltz_sim.checker.History`, one per workload; an op left in flight by a
  client that was killed ends ``unknown`` at the kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waltz_api.contracts.transport import Transport
from waltz_api.errors import SessionFencedError, StorageError, TransportError, WaltzError
from waltz_api.storage_client import StorageClient
from waltz_api.types import Record
from waltz_chaos.cluster import ProcessEvent
from waltz_client import AsyncWaltzClient, ClientConfig
from waltz_sim.checker import (
    INVOKE,
    UNKNOWN,
    ClientSnapshot,
    ClusterSnapshot,
    FeedEvent,
    OpEvent,
    PartitionSnapshot,
    StoredRecord,
)
from waltz_sim.workloads import ReadOnlyCallbacks, stored_record

log = logging.getLogger(__name__)


@dataclass
class ReadBack:
    snapshot: ClusterSnapshot
    notes: list[str] = field(default_factory=list)


async def read_back(
    *,
    coordination: str,
    coordination_options: Mapping[str, Any],
    transport_options: Mapping[str, Any],
    transport: Transport,
    partitions: Sequence[int],
    storage: Mapping[str, str],
    cluster_key: uuid.UUID,
    num_partitions: int,
    timeout: float = 60.0,
) -> ReadBack:
    """The cluster as the end finds it (``storage``: node name -> endpoint)."""
    result = ReadBack(ClusterSnapshot())
    served: dict[int, tuple[int | None, list[StoredRecord] | None]] = {}
    client = AsyncWaltzClient(
        ReadOnlyCallbacks(),
        ClientConfig(
            coordination=coordination,
            coordination_options=dict(coordination_options),
            transport="zmq",
            transport_options=dict(transport_options),
            partitions=list(partitions),
        ),
    )
    try:
        await asyncio.wait_for(client.start(), timeout)
        for partition in partitions:
            served[partition] = await _served(client, partition, result.notes)
    except (WaltzError, TimeoutError) as exc:
        result.notes.append(f"the read-back client failed: {type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(Exception):
            await client.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for partition in partitions:
        high, records = served.get(partition, (None, None))
        replicas: dict[str, list[StoredRecord]] = {}
        for name, endpoint in sorted(storage.items()):
            replicas[name] = await _replica(
                transport,
                endpoint,
                cluster_key,
                num_partitions,
                partition,
                want=None if high is None else high + 1,
                deadline=deadline,
                notes=result.notes,
                name=name,
            )
        result.snapshot.partitions[partition] = PartitionSnapshot(
            partition, high, replicas, records
        )
    return result


async def _served(
    client: AsyncWaltzClient, partition: int, notes: list[str]
) -> tuple[int | None, list[StoredRecord] | None]:
    high: int | None = None
    for _attempt in range(5):
        try:
            high = await client.high_water_mark(partition, timeout=15.0)
            break
        except (WaltzError, TimeoutError) as exc:
            notes.append(f"partition {partition}: high-water mark: {type(exc).__name__}: {exc}")
            await asyncio.sleep(1.0)
    if high is None:
        return None, None
    records: list[StoredRecord] = []
    try:
        while len(records) <= high:
            _, batch = await client.range_read(partition, len(records), max_records=1000)
            if not batch:
                break
            records.extend(stored_record(r) for r in batch)
    except (WaltzError, TimeoutError) as exc:
        notes.append(f"partition {partition}: range read failed: {type(exc).__name__}: {exc}")
        return high, None
    return high, records[: high + 1]


async def _replica(
    transport: Transport,
    endpoint: str,
    cluster_key: uuid.UUID,
    num_partitions: int,
    partition: int,
    *,
    want: int | None,
    deadline: float,
    notes: list[str],
    name: str,
) -> list[StoredRecord]:
    """Every record of one replica; read again (until ``deadline``) while it holds fewer
    than ``want`` (catching up) or the read fails (fenced by a newer session, restarting)."""
    loop = asyncio.get_running_loop()
    records: list[Record] = []
    failure = ""
    while True:
        try:
            records = await _read_replica(
                transport, endpoint, cluster_key, num_partitions, partition
            )
            failure = ""
            if want is None or len(records) >= want:
                break
        except (StorageError, TransportError, TimeoutError, OSError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        if loop.time() >= deadline:
            break
        await asyncio.sleep(0.5)
    if failure:
        notes.append(f"replica {name} of partition {partition}: could not be read: {failure}")
    return [stored_record(r) for r in records]


async def _read_replica(
    transport: Transport, endpoint: str, cluster_key: uuid.UUID, num_partitions: int, partition: int
) -> list[Record]:
    client = await StorageClient.connect(transport, endpoint, sender="chaos", timeout=10.0)
    try:
        await client.open(cluster_key, num_partitions)
        # the session id the replica holds (a newer one would fence it: a read is a request)
        try:
            await client.max_transaction_id(0, partition)
            session = 0
        except SessionFencedError as exc:
            session = exc.highest_session_id
        records: list[Record] = []
        while True:
            batch = await client.records(session, partition, len(records), 1000)
            if not batch:
                return records
            records.extend(batch)
    finally:
        await client.close()


@dataclass
class ClientRecords:
    """One client's database, as the checker's model."""

    name: str
    ops: list[OpEvent] = field(default_factory=list)
    feed: list[FeedEvent] = field(default_factory=list)
    snapshots: list[ClientSnapshot] = field(default_factory=list)
    marks: list[tuple[int, str, float]] = field(default_factory=list)


def load_client(name: str, path: Path, events: Iterable[ProcessEvent]) -> ClientRecords:
    """A client's database (read after its process ended). Ops an incarnation left in
    flight end ``unknown`` when it was killed (or exited on its own)."""
    out = ClientRecords(name)
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        ended: dict[str, OpEvent] = {}
        invoked: dict[str, tuple[int, OpEvent]] = {}
        for incarnation, kind, op, time, partition, txid, detail in conn.execute(
            "SELECT incarnation, kind, op, time, partition, txid, detail FROM ops ORDER BY seq"
        ):
            event = OpEvent(kind, op, name, time, partition, txid, detail)
            out.ops.append(event)
            if kind == INVOKE:
                invoked[op] = (incarnation, event)
            else:
                ended[op] = event
        for incarnation, partition, txid, op, time in conn.execute(
            "SELECT incarnation, partition, txid, op, time FROM feed ORDER BY seq"
        ):
            out.feed.append(FeedEvent(name, incarnation, partition, txid, op, time))
        for partition, hwm, state in conn.execute(
            "SELECT partition, hwm, state FROM state ORDER BY partition"
        ):
            out.snapshots.append(ClientSnapshot(name, partition, hwm, json.loads(state)))
        out.marks = [
            (i, what, t)
            for i, what, t in conn.execute("SELECT incarnation, what, time FROM marks ORDER BY seq")
        ]
    finally:
        conn.close()
    ends: dict[int, ProcessEvent] = {}
    for happened in events:
        if happened.member == name and happened.what in ("kill", "exit"):
            ends.setdefault(happened.incarnation, happened)
    for op, (incarnation, invoke) in invoked.items():
        if op in ended or incarnation not in ends:
            continue
        end = ends[incarnation]
        why = "killed (kill -9)" if end.what == "kill" else "exited on its own"
        out.ops.append(
            OpEvent(
                UNKNOWN,
                op,
                name,
                max(end.time, invoke.time),
                invoke.partition,
                detail=f"the client was {why} with the op in flight",
            )
        )
    return out


__all__ = ["ClientRecords", "ReadBack", "load_client", "read_back"]
