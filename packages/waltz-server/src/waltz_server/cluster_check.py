"""A cluster checked as a whole: its coordination metadata against its storage nodes and
servers (``waltz cluster verify``), and its replicas' progress (``waltz cluster show
--replicas``, ``waltz cluster add-replica --wait``).

:func:`collect` reads everything once, in an order that keeps the comparisons sound
while the cluster runs: each partition's committed high-water mark is asked of its
owner before the storage nodes are read and again after, so a replica found below the
first mark really lacks committed transactions, and one found above the second really
holds transactions that were not committed when it was read. :func:`check` is a pure
function of what was collected; it returns findings, each a *problem* (the cluster is
inconsistent or degraded: ``verify`` exits 1) or a *note* (worth knowing, e.g. a
replica still catching up, a membership change the owner has not applied yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from waltz_api import wire
from waltz_api.cluster import (
    NO_SERVER,
    ClusterConfig,
    ClusterMetadata,
    PartitionAssignment,
    PartitionStoreMetadata,
    ReplicaAssignments,
    ServerInfo,
    validate_storage_node,
)
from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConfigError, WaltzError
from waltz_api.features import MIN_FEATURE_LEVEL
from waltz_api.messages import ErrorResponse, HighWaterMarkRequest, HighWaterMarkResponse
from waltz_api.storage_client import StorageAdminClient
from waltz_api.types import ReqId
from waltz_server.server.voting import quorum_of

log = logging.getLogger(__name__)

PROBLEM = "problem"
NOTE = "note"
DEFAULT_STORAGE_ENDPOINT = "tcp://{}"
ROUND_SHARE = 0.3
"""The share of :func:`collect`'s timeout one round (owners before, storage nodes,
owners after) may wait for a process."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing ``verify`` found: ``severity`` is PROBLEM or NOTE; ``kind`` a stable
    short name (for scripts and tests); ``subject`` what it is about."""

    severity: str
    kind: str
    subject: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {
            "severity": self.severity,
            "kind": self.kind,
            "subject": self.subject,
            "message": self.message,
        }

    def __str__(self) -> str:
        return f"{self.subject}: {self.message}"


@dataclass
class StorageReport:
    """What one storage node said (its admin ``info`` and ``list``), or why it said nothing."""

    node: str
    endpoint: str
    error: str | None = None
    cluster_key: str | None = None
    num_partitions: int | None = None
    feature_level: int = MIN_FEATURE_LEVEL
    """The level it writes at and the highest it supports (a node of 0.1.0 reports
    neither: 1)."""
    max_feature_level: int = MIN_FEATURE_LEVEL
    partitions: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Rows of the admin ``list``: max_transaction_id, session_info, available, error."""

    def max_transaction_id(self, partition_id: int) -> int | None:
        row = self.partitions.get(partition_id)
        if row is None or row.get("max_transaction_id") is None:
            return None
        return int(row["max_transaction_id"])

    def session(self, partition_id: int) -> dict[str, int]:
        row = self.partitions.get(partition_id) or {}
        info = row.get("session_info") or {}
        return {k: int(v) for k, v in info.items()}


@dataclass
class ClusterFacts:
    """Everything :func:`collect` read. ``storage`` is None when the storage nodes were
    not contacted; ``high_water_marks`` holds (before, after) per partition whose owner
    answered, ``server_errors`` why another did not."""

    config: ClusterConfig | None = None
    config_error: str | None = None
    assignments: ReplicaAssignments | None = None
    assignments_error: str | None = None
    store: dict[int, PartitionStoreMetadata] = field(default_factory=dict)
    store_after: dict[int, PartitionStoreMetadata] = field(default_factory=dict)
    """The store metadata read again after the storage nodes (their sessions are compared
    with it: a session a node saw must be known to the metadata read after it)."""
    owners: dict[int, PartitionAssignment] = field(default_factory=dict)
    metadata_errors: dict[int, str] = field(default_factory=dict)
    servers: list[ServerInfo] = field(default_factory=list)
    feature_level: int = MIN_FEATURE_LEVEL
    """The cluster's recorded feature level (waltz_api.features)."""
    storage: dict[str, StorageReport] | None = None
    high_water_marks: dict[int, tuple[int, int]] = field(default_factory=dict)
    server_errors: dict[int, str] = field(default_factory=dict)

    def live_owner(self, partition_id: int) -> ServerInfo | None:
        owner = self.owners.get(partition_id)
        if owner is None or owner.server_id == NO_SERVER:
            return None
        for server in self.servers:
            if server.server_id == owner.server_id:
                return server
        return None


# -- collecting -------------------------------------------------------------------------------


async def _storage_report(
    transport: Transport, node: str, endpoint: str, timeout: float
) -> StorageReport:
    report = StorageReport(node, endpoint)
    try:
        async with asyncio.timeout(timeout):
            async with await StorageAdminClient.connect(
                transport, endpoint, sender="admin:verify", timeout=timeout
            ) as admin:
                info = await admin.info()
                report.cluster_key = str(info.get("cluster_key"))
                report.num_partitions = int(info["num_partitions"])
                report.feature_level = int(info.get("feature_level", MIN_FEATURE_LEVEL))
                report.max_feature_level = int(info.get("max_feature_level", MIN_FEATURE_LEVEL))
                for row in await admin.list_partitions_raw():
                    report.partitions[int(row["partition_id"])] = row
    except TimeoutError:
        report.error = f"no answer from {endpoint} within {timeout:.1f} s"
    except (WaltzError, OSError, KeyError, ValueError) as exc:
        report.error = f"{endpoint}: {exc}"
    return report


async def query_high_water_marks(
    transport: Transport,
    endpoint: str,
    partitions: Sequence[tuple[int, int]],
    timeout: float,
) -> dict[int, int | str]:
    """Ask the server at ``endpoint`` the high-water mark of each (partition, generation):
    the mark, or a string saying why there is none, all within ``timeout`` seconds."""
    answers: dict[int, int | str] = {}
    try:
        async with asyncio.timeout(timeout):
            conn = await transport.connect(endpoint, timeout=timeout)
            try:
                protocol = wire.ProtocolConnection(
                    wire.Role.INITIATOR,
                    sender="waltz-verify",
                    max_frame_size=transport.max_frame_size,
                )
                await conn.send(protocol.start_handshake())
                protocol.receive_frame(await asyncio.wait_for(conn.recv(), timeout))
                for seq, (partition_id, generation) in enumerate(partitions, start=1):
                    req_id = ReqId(-1, generation, partition_id, seq)
                    await conn.send(protocol.send(HighWaterMarkRequest(req_id)))
                    while True:
                        message = protocol.receive_frame(
                            await asyncio.wait_for(conn.recv(), timeout)
                        )
                        if getattr(message, "req_id", None) != req_id:
                            continue
                        if isinstance(message, HighWaterMarkResponse):
                            answers[partition_id] = message.transaction_id
                        elif isinstance(message, ErrorResponse):
                            answers[partition_id] = f"{message.code.name}: {message.message}"
                        else:
                            answers[partition_id] = f"unexpected answer {type(message).__name__}"
                        break
            finally:
                with contextlib.suppress(WaltzError, OSError):
                    await conn.close()
    except TimeoutError:
        reason = f"no answer from {endpoint} within {timeout:.1f} s"
        for partition_id, _ in partitions:
            answers.setdefault(partition_id, reason)
    except (WaltzError, OSError) as exc:
        for partition_id, _ in partitions:
            answers.setdefault(partition_id, f"{endpoint}: {exc}")
    return answers


async def _ask_owners(
    facts: ClusterFacts,
    transport: Transport,
    timeout: float,
    only: Collection[int] | None = None,
) -> dict[int, int | str]:
    """The owners' answers for their partitions (``only`` these, when given)."""
    by_endpoint: dict[str, list[tuple[int, int]]] = {}
    for partition_id, owner in sorted(facts.owners.items()):
        server = facts.live_owner(partition_id)
        if server is not None and (only is None or partition_id in only):
            by_endpoint.setdefault(server.endpoint, []).append((partition_id, owner.generation))
    results = await asyncio.gather(
        *(
            query_high_water_marks(transport, endpoint, parts, timeout)
            for endpoint, parts in by_endpoint.items()
        )
    )
    merged: dict[int, int | str] = {}
    for answer in results:
        merged.update(answer)
    return merged


def storage_endpoint(template: str, node: str) -> str:
    if "{}" not in template:
        raise ConfigError(
            f"--storage-endpoint must contain {{}} (the node's host:port), got {template!r}",
            key="storage_endpoint",
        )
    return template.format(node)


async def collect(
    meta: ClusterMetadata,
    transport: Transport | None,
    *,
    endpoint_template: str = DEFAULT_STORAGE_ENDPOINT,
    timeout: float = 5.0,
    storage: bool = True,
    servers: bool = True,
) -> ClusterFacts:
    """Read the metadata, then (with a transport) ask the owners their high-water
    marks, read every storage node, and ask the owners again (those that answered).

    ``timeout`` bounds the whole: each of the three rounds waits at most
    :data:`ROUND_SHARE` of it for a process, so a dead server or storage node is
    reported (an error in the facts) within it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    def wait() -> float:
        return max(0.1, min(timeout * ROUND_SHARE, deadline - loop.time()))

    facts = ClusterFacts()
    try:
        facts.config = await meta.config()
    except WaltzError as exc:
        facts.config_error = str(exc)
        return facts
    try:
        facts.assignments = await meta.replica_assignments()
    except WaltzError as exc:
        facts.assignments_error = str(exc)
    for partition_id in range(facts.config.num_partitions):
        try:
            facts.owners[partition_id] = (await meta.partition_assignment(partition_id)).value
            facts.store[partition_id] = (await meta.store_metadata(partition_id)).value
        except WaltzError as exc:
            facts.metadata_errors[partition_id] = str(exc)
    facts.servers = await meta.servers()
    facts.feature_level = (await meta.feature_level()).value
    if transport is None:
        return facts
    before: dict[int, int | str] = {}
    if servers:
        before = await _ask_owners(facts, transport, wait())
    if storage and facts.assignments is not None:
        nodes = sorted(facts.assignments.storage)
        each = wait()
        reports = await asyncio.gather(
            *(
                _storage_report(transport, node, storage_endpoint(endpoint_template, node), each)
                for node in nodes
            )
        )
        facts.storage = {r.node: r for r in reports}
    if facts.storage is not None:
        for partition_id in list(facts.store):
            with contextlib.suppress(WaltzError):
                facts.store_after[partition_id] = (await meta.store_metadata(partition_id)).value
    if servers:
        answered = [p for p, mark in before.items() if isinstance(mark, int)]
        after = await _ask_owners(facts, transport, wait(), answered)
        if _replicas_ahead(facts, after) and deadline - loop.time() > 1.5:
            # appends in flight when the nodes were read commit meanwhile: ask once more
            await asyncio.sleep(1.0)
            again = await _ask_owners(facts, transport, wait(), answered)
            after.update({p: m for p, m in again.items() if isinstance(m, int)})
        for partition_id, first in before.items():
            second = after.get(partition_id, "no second answer")
            if isinstance(first, int) and isinstance(second, int):
                facts.high_water_marks[partition_id] = (first, second)
            else:
                facts.server_errors[partition_id] = str(first if isinstance(first, str) else second)
    return facts


def _replicas_ahead(facts: ClusterFacts, marks: dict[int, int | str]) -> bool:
    if facts.storage is None:
        return False
    for partition_id, mark in marks.items():
        if not isinstance(mark, int):
            continue
        for report in facts.storage.values():
            max_id = report.max_transaction_id(partition_id)
            if max_id is not None and max_id > mark:
                return True
    return False


# -- checking ---------------------------------------------------------------------------------


class _Findings(list[Finding]):
    def problem(self, kind: str, subject: str, message: str) -> None:
        self.append(Finding(PROBLEM, kind, subject, message))

    def note(self, kind: str, subject: str, message: str) -> None:
        self.append(Finding(NOTE, kind, subject, message))


def check(facts: ClusterFacts) -> list[Finding]:
    """The findings about ``facts`` (problems first, in a stable order)."""
    found = _Findings()
    if facts.config is None:
        found.problem("config", "cluster", facts.config_error or "no cluster config")
        return found
    config = facts.config
    if facts.assignments is None:
        found.problem("assignments", "cluster", facts.assignments_error or "no assignments")
    else:
        _check_assignments(found, config, facts.assignments)
    _check_store_metadata(found, facts)
    _check_owners(found, facts)
    _check_server_levels(found, facts)
    if facts.storage is not None and facts.assignments is not None:
        _check_storage(found, facts, facts.assignments, facts.storage)
    _check_high_water_marks(found, facts)
    return sorted(found, key=lambda f: (f.severity != PROBLEM, f.subject, f.kind))


def _check_assignments(
    found: _Findings, config: ClusterConfig, assignments: ReplicaAssignments
) -> None:
    for node, parts in sorted(assignments.storage.items()):
        subject = f"storage node {node}"
        try:
            validate_storage_node(node)
        except ConfigError as exc:
            found.problem("assignments", subject, str(exc))
        unknown = sorted(p for p in parts if not 0 <= p < config.num_partitions)
        if unknown:
            found.problem(
                "assignments",
                subject,
                f"assigned partitions {unknown} that do not exist (the cluster has "
                f"{config.num_partitions})",
            )
        if not parts:
            found.note("idle-node", subject, "holds no replica (give it some with add-replica)")
    for node in sorted(set(assignments.groups) - set(assignments.storage)):
        found.problem("assignments", f"storage node {node}", "has a group but is not a member")
    for partition_id in range(config.num_partitions):
        holders = assignments.replicas_of(partition_id)
        subject = f"partition {partition_id}"
        if not holders:
            found.problem("no-replicas", subject, "has no replica on any storage node")
        elif len(holders) != config.num_replicas:
            found.note(
                "replica-count",
                subject,
                f"has {len(holders)} replicas ({', '.join(holders)}); the cluster's "
                f"configured number is {config.num_replicas}",
            )


def _check_store_metadata(found: _Findings, facts: ClusterFacts) -> None:
    assert facts.config is not None
    known = set(facts.assignments.storage) if facts.assignments is not None else None
    for partition_id in range(facts.config.num_partitions):
        subject = f"partition {partition_id}"
        if partition_id in facts.metadata_errors:
            found.problem("metadata", subject, facts.metadata_errors[partition_id])
            continue
        store = facts.store[partition_id]
        owner = facts.owners[partition_id]
        if store.generation > owner.generation:
            found.problem(
                "generation",
                subject,
                f"store metadata names generation {store.generation}, newer than the "
                f"partition assignment's {owner.generation}",
            )
        for replica in store.replicas:
            node = replica.replica_id.storage_node
            if replica.session_id > store.session_id:
                found.problem(
                    "session",
                    subject,
                    f"replica on {node} is at store session {replica.session_id}, newer than "
                    f"the partition's {store.session_id}",
                )
            if known is not None and node not in known:
                found.problem(
                    "unknown-node",
                    subject,
                    f"store metadata has a replica on {node}, which is not a storage node of "
                    "the cluster",
                )
        if facts.assignments is None or store.session_id < 0:
            continue
        in_store = {r.replica_id.storage_node for r in store.replicas}
        assigned = set(facts.assignments.replicas_of(partition_id))
        for replica in store.replicas:
            node = replica.replica_id.storage_node
            if node in assigned and replica.session_id < store.session_id:
                found.note(
                    "not-in-session",
                    subject,
                    f"replica on {node} is not part of store session {store.session_id} (last "
                    f"in session {replica.session_id}: it was offline or behind when the "
                    "session started; a later session takes it back)",
                )
        if in_store != assigned:
            changes = [f"add {n}" for n in sorted(assigned - in_store)]
            changes += [f"drop {n}" for n in sorted(in_store - assigned)]
            found.note(
                "replica-set-pending",
                subject,
                f"store session {store.session_id} has replicas {', '.join(sorted(in_store))}; "
                f"the assignment differs ({', '.join(changes)}): the owner applies it in its "
                "next store session",
            )


def _check_owners(found: _Findings, facts: ClusterFacts) -> None:
    assert facts.config is not None
    if not facts.servers:
        found.problem("no-servers", "cluster", "no live server is registered: nothing is served")
    live = {s.server_id: s for s in facts.servers}
    for partition_id, owner in sorted(facts.owners.items()):
        subject = f"partition {partition_id}"
        if owner.server_id == NO_SERVER:
            if facts.servers:
                found.problem("unassigned", subject, "is not assigned to any server")
            continue
        server = live.get(owner.server_id)
        if server is None:
            found.problem(
                "dead-owner",
                subject,
                f"is assigned to server {owner.server_id} (generation {owner.generation}), "
                "which is not live",
            )
        elif owner.endpoint and server.endpoint != owner.endpoint:
            found.problem(
                "owner-endpoint",
                subject,
                f"assignment names endpoint {owner.endpoint}, but server {server.server_id} "
                f"is registered at {server.endpoint}",
            )


def _check_server_levels(found: _Findings, facts: ClusterFacts) -> None:
    for server in facts.servers:
        if server.max_feature_level < facts.feature_level:
            found.problem(
                "feature-level",
                f"server {server.server_id}",
                f"supports feature level {server.max_feature_level} at most, below the "
                f"cluster's {facts.feature_level}: it works at level "
                f"{server.max_feature_level} (an older release); stop it and start it on a "
                f"release that supports level {facts.feature_level}",
            )


def _check_storage_level(found: _Findings, level: int, subject: str, report: StorageReport) -> None:
    if report.max_feature_level < level:
        found.problem(
            "feature-level",
            subject,
            f"supports feature level {report.max_feature_level} at most, below the "
            f"cluster's {level}: it cannot read what the level enables (an older release); "
            f"upgrade it to a release that supports level {level}, or restore it from a "
            'copy taken before the raise (docs/compatibility.md, "Feature levels")',
        )
    elif report.feature_level < level:  # a note: the servers tell it as they connect
        found.note(
            "feature-level",
            subject,
            f"writes at feature level {report.feature_level}, below the cluster's {level}: "
            "not told the level yet (each server tells it when it connects to it); "
            f"`waltz cluster features --to {level}` tells it now",
        )


def _check_storage(
    found: _Findings,
    facts: ClusterFacts,
    assignments: ReplicaAssignments,
    storage: dict[str, StorageReport],
) -> None:
    config = facts.config
    assert config is not None
    for node, report in sorted(storage.items()):
        subject = f"storage node {node}"
        if report.error is not None:
            found.problem("unreachable", subject, f"cannot be read: {report.error}")
            continue
        if report.cluster_key != str(config.cluster_key):
            found.problem(
                "cluster-key",
                subject,
                f"was opened with cluster key {report.cluster_key}, not the cluster's "
                f"{config.cluster_key} (a node of another cluster?)",
            )
            continue
        _check_storage_level(found, facts.feature_level, subject, report)
        if report.num_partitions != config.num_partitions:
            found.problem(
                "num-partitions",
                subject,
                f"was opened for {report.num_partitions} partitions, the cluster has "
                f"{config.num_partitions}",
            )
        assigned = set(assignments.partitions_of(node))
        for partition_id in sorted(assigned - set(report.partitions)):
            found.problem(
                "not-hosted",
                subject,
                f"does not host partition {partition_id}, which is assigned to it "
                f"(`waltz storage add-partition {partition_id}` on that node)",
            )
        for partition_id in sorted(set(report.partitions) - assigned):
            found.note(
                "unassigned-data",
                subject,
                f"hosts partition {partition_id}, which is not assigned to it (left-over data; "
                "`waltz storage remove-partition` deletes it)",
            )
        for partition_id in sorted(assigned & set(report.partitions)):
            _check_replica(found, facts, report, partition_id)


def _check_replica(
    found: _Findings, facts: ClusterFacts, report: StorageReport, partition_id: int
) -> None:
    subject = f"partition {partition_id}"
    where = f"replica on {report.node}"
    row = report.partitions[partition_id]
    if row.get("error"):
        found.problem("replica-error", subject, f"{where} cannot be read: {row['error']}")
        return
    if not row.get("available", True):
        found.problem(
            "unavailable",
            subject,
            f"{where} is marked unavailable (it refuses storage requests; "
            "`waltz storage availability` makes it available again)",
        )
    session = report.session(partition_id)
    store = facts.store_after.get(partition_id, facts.store.get(partition_id))
    if store is not None and session.get("session_id", -1) > store.session_id:
        found.problem(
            "session",
            subject,
            f"{where} has seen store session {session['session_id']}, newer than the "
            f"metadata's {store.session_id} (metadata restored from an old copy?)",
        )
    low = session.get("low_water_mark", -1)
    local_low = session.get("local_low_water_mark", -1)
    if local_low > low:
        found.problem(
            "low-water-mark",
            subject,
            f"{where} has local low-water mark {local_low} above its low-water mark {low}",
        )


def _check_high_water_marks(found: _Findings, facts: ClusterFacts) -> None:
    for partition_id, reason in sorted(facts.server_errors.items()):
        found.problem(
            "high-water-mark", f"partition {partition_id}", f"its owner did not answer: {reason}"
        )
    if facts.storage is None or facts.assignments is None:
        return
    for partition_id, (before, after) in sorted(facts.high_water_marks.items()):
        subject = f"partition {partition_id}"
        store = facts.store.get(partition_id)
        holders = facts.assignments.replicas_of(partition_id)
        in_session = (
            {r.replica_id.storage_node for r in store.replicas} if store is not None else set()
        )
        holding = 0
        for node in holders:
            report = facts.storage.get(node)
            if report is None or report.error is not None:
                continue
            max_id = report.max_transaction_id(partition_id)
            if max_id is None:
                continue
            where = f"replica on {node}"
            low = report.session(partition_id).get("low_water_mark", -1)
            if low > after:
                found.problem(
                    "low-water-mark",
                    subject,
                    f"{where} has low-water mark {low}, above the committed high-water mark "
                    f"{after}",
                )
            if max_id >= before:
                holding += node in in_session
            if max_id > after:
                found.problem(
                    "ahead",
                    subject,
                    f"{where} holds transactions up to {max_id}, beyond the committed "
                    f"high-water mark {after} (uncommitted records)",
                )
            elif max_id < before:
                found.note(
                    "behind",
                    subject,
                    f"{where} is at {max_id}, {before - max_id} behind the committed "
                    f"high-water mark {before} (catching up)",
                )
        needed = quorum_of(len(in_session)) if in_session else 1
        if before >= 0 and holding < needed:
            found.problem(
                "quorum",
                subject,
                f"only {holding} replica(s) of the store session hold the committed "
                f"high-water mark {before}; a quorum is {needed}",
            )


# -- the replicas' progress -------------------------------------------------------------------


def replica_progress(facts: ClusterFacts) -> list[dict[str, Any]]:
    """Per partition: its committed high-water mark and each assigned replica's max
    transaction id, how far behind, and whether the current store session has it."""
    rows: list[dict[str, Any]] = []
    if facts.config is None or facts.assignments is None:
        return rows
    for partition_id in range(facts.config.num_partitions):
        marks = facts.high_water_marks.get(partition_id)
        hwm = None if marks is None else marks[1]
        store = facts.store.get(partition_id)
        in_session = {r.replica_id.storage_node: r for r in store.replicas} if store else {}
        replicas = []
        for node in facts.assignments.replicas_of(partition_id):
            report = None if facts.storage is None else facts.storage.get(node)
            max_id = None
            error = None
            if report is not None:
                error = report.error
                max_id = report.max_transaction_id(partition_id)
                if error is None and partition_id not in report.partitions:
                    error = "partition not hosted"
            state = in_session.get(node)
            replicas.append(
                {
                    "storage": node,
                    "max_transaction_id": max_id,
                    "behind": None if hwm is None or max_id is None else max(0, hwm - max_id),
                    "in_store_session": state is not None
                    and store is not None
                    and state.session_id == store.session_id,
                    "error": error,
                }
            )
        rows.append(
            {
                "partition": partition_id,
                "high_water_mark": hwm,
                "store_session_id": None if store is None else store.session_id,
                "replicas": replicas,
            }
        )
    return rows
