"""The storage node's admin commands (StorageAdminRequest, JSON arguments and results).

Commands (``command``: arguments -> result):

- ``info``: {} -> {cluster_key, num_partitions, endpoint, partitions: [ids], feature_level,
  max_feature_level, version} (the level the storage writes at, the highest it can, and
  the node's Waltz version: a node of 0.1.0 answers none of the three, it is at level 1)
- ``set_feature_level``: {level, cluster_key} -> {feature_level, max_feature_level}: write
  the formats of the cluster feature ``level`` from now on (``waltz cluster features
  --raise``, and a server at connection; :mod:`waltz_api.features`); idempotent, never
  lowers, refused above ``max_feature_level`` (a node of 0.1.0 answers "unknown admin
  command")
- ``list``: {} -> {partitions: [{partition_id, max_transaction_id, session_info:
  {session_id, low_water_mark, local_low_water_mark, low_water_mark_session_id},
  missing_ranges: [[first, last]] (lost to damage, to repair from a peer), available, error}]}
- ``max_transaction_id``: {partition_id} -> {partition_id, max_transaction_id}
- ``add_partition``: {partition_id, cluster_key} -> {partition_id}
- ``remove_partition``: {partition_id, cluster_key} -> {partition_id}  (deletes its data)
- ``set_availability``: {partition_id, available, cluster_key} -> {partition_id, available,
  persisted}
- ``stats``: {} -> {partitions: [{partition_id, queued, requests, append_requests,
  engine_appends, records_appended, fenced}]} (counters since the node started)
- ``local_log``: {partition_id} -> {partition_id, log_start, max_transaction_id,
  local_bytes, extents: [[first, last, bytes, created_ms]]} (the local log's pieces:
  segments; what an archiver's retention reads)
- ``prune``: {partition_id, through, session_id, cluster_key} -> {partition_id,
  log_start}: delete the local records up to ``through`` (whole segments), which the
  owner of store session ``session_id`` archived and verified; fenced like a storage
  request (a newer session refuses it), in the partition's order (docs/archive.md)
- ``scrub``: {partition_id (optional: every hosted one), rate_bytes_per_second (optional:
  the background scrub's rate; 0: no bound)} -> {partitions: [{partition_id, records,
  bytes, damaged: [[first, last]], complete, error, missing_ranges}], seconds}: a scrub
  pass now (engines with the ``scrub`` capability; :mod:`waltz_storage_node.scrub`);
  the answer comes when the pass ends

The archive's two commands ride on the admin request so that the wire protocol stays
at version 1: a storage node of an older release answers them "unknown admin command",
and its data is then simply never deleted.

Mutating commands carry the cluster key, so a tool pointed at the wrong node
or cluster changes nothing. An unavailable partition refuses every storage
request (``PARTITION_CLOSED``) until marked available again; the engine keeps
the choice across restarts (``persisted`` is false for an engine that cannot:
then a restart makes the partition available).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from waltz_api import __version__
from waltz_api.errors import ClusterKeyMismatchError, PartitionClosedError, StorageError
from waltz_api.storage_failures import StorageRequestError
from waltz_storage_node.scrub import ScrubbedNode, Scrubber


class AdminNode(ScrubbedNode, Protocol):
    """What the admin commands use of their node
    (:class:`~waltz_storage_node.node.StorageNode`, which runs them: this module
    does not import it)."""

    @property
    def endpoint(self) -> str: ...

    @property
    def capabilities(self) -> frozenset[str]: ...

    @property
    def scrubber(self) -> Scrubber | None: ...

    def check_partition_id(self, partition_id: Any) -> int: ...

    async def add_partition(self, partition_id: int) -> None: ...

    async def remove_partition(self, partition_id: int) -> None: ...


log = logging.getLogger(__name__)

AdminCommand = Callable[[AdminNode, dict[str, Any]], Awaitable[dict[str, Any]]]


def _require_key(node: AdminNode, arguments: dict[str, Any]) -> None:
    raw = arguments.get("cluster_key")
    if not isinstance(raw, str):
        raise StorageRequestError(
            "this admin command changes the storage: pass the cluster key (cluster_key)"
        )
    try:
        key = uuid.UUID(raw)
    except ValueError:
        raise StorageRequestError(f"cluster_key {raw!r} is not a UUID") from None
    if key != node.engine.cluster_key:
        raise ClusterKeyMismatchError(
            f"cluster key {key} does not match this storage node's key; "
            "is the tool pointed at the right node and cluster?"
        )


def _partition_id(node: AdminNode, arguments: dict[str, Any]) -> int:
    if "partition_id" not in arguments:
        raise StorageRequestError("this admin command needs partition_id")
    return node.check_partition_id(arguments["partition_id"])


async def _info(node: AdminNode, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "cluster_key": str(node.engine.cluster_key),
        "num_partitions": node.engine.num_partitions,
        "endpoint": node.endpoint,
        "partitions": node.engine.partition_ids(),
        "feature_level": node.engine.feature_level,
        "max_feature_level": node.engine.max_feature_level,
        "version": __version__,
    }


async def _set_feature_level(node: AdminNode, arguments: dict[str, Any]) -> dict[str, Any]:
    _require_key(node, arguments)
    level = _int_argument(arguments, "level", 1)
    before = node.engine.feature_level
    await node.engine.raise_feature_level(level)
    after = node.engine.feature_level
    if after != before:
        log.info("feature level %d (was %d): the storage writes its formats now", after, before)
    return {"feature_level": after, "max_feature_level": node.engine.max_feature_level}


async def _list(node: AdminNode, arguments: dict[str, Any]) -> dict[str, Any]:
    workers = node.hosted_workers()
    rows = []
    for partition_id in node.engine.partition_ids():
        worker = workers.get(partition_id)
        row: dict[str, Any] = {
            "partition_id": partition_id,
            "available": worker.available if worker is not None else False,
            "max_transaction_id": None,
            "session_info": None,
            "missing_ranges": [],
            "error": None,
        }
        try:
            partition = node.engine.partition(partition_id)
            info = partition.session_info()
            row["max_transaction_id"] = partition.max_transaction_id()
            row["missing_ranges"] = [list(r) for r in partition.missing_ranges()]
            row["session_info"] = {
                "session_id": info.session_id,
                "low_water_mark": info.low_water_mark,
                "local_low_water_mark": info.local_low_water_mark,
                "low_water_mark_session_id": info.low_water_mark_session_id,
            }
        except StorageError as exc:
            row["error"] = str(exc)
        rows.append(row)
    return {"partitions": rows}


async def _max_transaction_id(node: AdminNode, arguments: dict[str, Any]) -> dict[str, Any]:
    partition_id = _partition_id(node, arguments)
    node.worker_of(partition_id)
    partition = node.engine.partition(partition_id)
    return {"partition_id": partition_id, "max_transaction_id": partition.max_transaction_id()}


async def _add_partition(node: AdminNode, arguments: dict[str, Any]) -> dict[str, Any]:
    _require_key(node, arguments)
    partition_id = _partition_id(node, arguments)
    await node.add_partition(partition_id)
    return {"partition_id": partition_id}


async def _remove_partition(node: AdminNode, arguments: dict[str, Any]) -> dict[str, Any]:
    _require_key(node, arguments)
    partition_id = _partition_id(node, arguments)
    await node.remove_partition(partition_id)
    return {"partition_id": partition_id}


async def _set_availability(node: AdminNode, arguments: dict[str, Any]) -> dict[str, Any]:
    _require_key(node, arguments)
    partition_id = _partition_id(node, arguments)
    available = arguments.get("available")
    if not isinstance(available, bool):
        raise StorageRequestError(f"available must be true or false, got {available!r}")
    worker = node.worker_of(partition_id)
    persisted = True

    async def apply() -> None:
        nonlocal persisted
        try:
            await node.engine.partition(partition_id).set_available(available)
        except PartitionClosedError:
            raise
        except StorageError as exc:
            persisted = False
            log.warning(
                "partition %d: availability %s holds until the node restarts only: %s",
                partition_id,
                available,
                exc,
            )
        worker.available = available

    # In the partition's order: requests queued before this are served as before.
    await worker.run_in_order(apply)
    return {"partition_id": partition_id, "available": available, "persisted": persisted}


async def _stats(node: AdminNode, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "partitions": [
            {
                "partition_id": partition_id,
                "queued": worker.queued,
                **dataclasses.asdict(worker.stats),
            }
            for partition_id, worker in sorted(node.hosted_workers().items())
        ]
    }


async def _local_log(node: AdminNode, arguments: dict[str, Any]) -> dict[str, Any]:
    partition_id = _partition_id(node, arguments)
    node.worker_of(partition_id)
    partition = node.engine.partition(partition_id)
    extents = partition.local_extents()
    return {
        "partition_id": partition_id,
        "log_start": partition.log_start(),
        "max_transaction_id": partition.max_transaction_id(),
        "local_bytes": sum(max(e.size, 0) for e in extents),
        "extents": [[e.first, e.last, e.size, e.created_ms] for e in extents],
    }


def _int_argument(arguments: dict[str, Any], name: str, minimum: int) -> int:
    value = arguments.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise StorageRequestError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


async def _prune(node: AdminNode, arguments: dict[str, Any]) -> dict[str, Any]:
    _require_key(node, arguments)
    partition_id = _partition_id(node, arguments)
    through = _int_argument(arguments, "through", -1)
    session_id = _int_argument(arguments, "session_id", 0)
    start = await node.worker_of(partition_id).drop_prefix(session_id, through)
    return {"partition_id": partition_id, "log_start": start}


async def _scrub(node: AdminNode, arguments: dict[str, Any]) -> dict[str, Any]:
    from waltz_api.capabilities import SCRUB

    if SCRUB not in node.capabilities:
        raise StorageRequestError(
            "this node's storage engine does not scrub (no 'scrub' capability): damage is "
            "found when a record is read, or at start-up"
        )
    partitions = None
    if arguments.get("partition_id") is not None:
        partition_id = _partition_id(node, arguments)
        node.worker_of(partition_id)
        partitions = [partition_id]
    background = node.scrubber
    rate = background.rate if background is not None else None
    if arguments.get("rate_bytes_per_second") is not None:
        rate = _int_argument(arguments, "rate_bytes_per_second", 0) or None
    scrubber = Scrubber(node, rate_bytes_per_second=rate, interval=0.0)
    started = time.monotonic()
    results = await scrubber.run_pass(partitions)
    rows = []
    for result in results:
        row = result.as_dict()
        try:
            row["missing_ranges"] = [
                list(r) for r in node.engine.partition(result.partition_id).missing_ranges()
            ]
        except StorageError as exc:
            row["missing_ranges"] = []
            row["error"] = row["error"] or str(exc)
        rows.append(row)
    return {"partitions": rows, "seconds": round(time.monotonic() - started, 3)}


COMMANDS: dict[str, AdminCommand] = {
    "local_log": _local_log,
    "prune": _prune,
    "info": _info,
    "set_feature_level": _set_feature_level,
    "list": _list,
    "max_transaction_id": _max_transaction_id,
    "add_partition": _add_partition,
    "remove_partition": _remove_partition,
    "set_availability": _set_availability,
    "stats": _stats,
    "scrub": _scrub,
}


async def run_admin_command(
    node: AdminNode, command: str, arguments: dict[str, Any]
) -> dict[str, Any]:
    handler = COMMANDS.get(command)
    if handler is None:
        raise StorageRequestError(
            f"unknown admin command {command!r}; valid commands: {', '.join(sorted(COMMANDS))}"
        )
    return await handler(node, arguments)
