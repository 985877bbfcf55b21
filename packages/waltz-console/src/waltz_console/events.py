"""The console's time line: what changed between two snapshots, named. Pure: no I/O,
no clock (the collector stamps each event when it adds it).

:func:`derive_events` compares two :class:`~waltz_console.views.Snapshot` and says
what happened: servers joining, leaving or falling silent, the leader, partitions
assigned, moved or failed over, store sessions, recoveries, replicas added, removed,
leaving and rejoining a store session, storage nodes down and back, fenced requests,
clients connecting and leaving, ACL changes and archive rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from waltz_console.views import Snapshot


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened: ``kind`` is a stable word (failover, recovery,
    store_session, membership, fenced, storage_down, ...), ``partition`` the partition it
    is about (None for the cluster)."""

    kind: str
    message: str
    partition: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "partition": self.partition}


def _lost(server_id: int, before: Snapshot, after: Snapshot) -> bool:
    """Whether the server is gone: its registration expired, or its endpoint, which
    answered before, no longer does (a killed server is seen so before its coordination
    session expires and its partitions move)."""
    now = next((s for s in after.servers if s["server_id"] == server_id), None)
    return now is None or not now["alive"] or now.get("answering") is False


def derive_events(before: Snapshot | None, after: Snapshot) -> list[Event]:
    """What changed from ``before`` to ``after`` (nothing on the first snapshot)."""
    if before is None:
        return []
    events: list[Event] = []
    old_servers = {s["server_id"]: s for s in before.servers if s["alive"]}
    new_servers = {s["server_id"]: s for s in after.servers if s["alive"]}
    for sid in sorted(set(new_servers) - set(old_servers)):
        events.append(Event("membership", f"server {sid} joined ({new_servers[sid]['endpoint']})"))
    for sid in sorted(set(old_servers) - set(new_servers)):
        events.append(Event("membership", f"server {sid} left ({old_servers[sid]['endpoint']})"))
    for sid in sorted(set(old_servers) & set(new_servers)):
        was, now = old_servers[sid].get("answering"), new_servers[sid].get("answering")
        if was and now is False:
            events.append(
                Event(
                    "server_down",
                    f"server {sid} stopped answering; its partitions move when its "
                    "coordination session expires",
                )
            )
        elif was is False and now:
            events.append(Event("server_up", f"server {sid} answers again"))
    old_leader = [s["server_id"] for s in before.servers if s["leader"] and s["alive"]]
    new_leader = [s["server_id"] for s in after.servers if s["leader"] and s["alive"]]
    if new_leader and new_leader != old_leader:
        events.append(Event("leader", f"server {new_leader[0]} leads the cluster manager"))

    old_nodes = {s["node"]: s for s in before.storage}
    new_nodes = {s["node"]: s for s in after.storage}
    for node in sorted(set(new_nodes) - set(old_nodes)):
        events.append(Event("membership", f"storage node {node} added to the cluster"))
    for node in sorted(set(old_nodes) - set(new_nodes)):
        events.append(Event("membership", f"storage node {node} removed from the cluster"))
    for node in sorted(set(old_nodes) & set(new_nodes)):
        was, now = old_nodes[node]["up"], new_nodes[node]["up"]
        if was and now is not True:
            events.append(Event("storage_down", f"storage node {node} stopped answering"))
        elif now and (was is False or was is None):
            events.append(Event("storage_up", f"storage node {node} answers again"))
        old_fenced = old_nodes[node]["fenced_requests"]
        new_fenced = new_nodes[node]["fenced_requests"]
        if old_fenced is not None and new_fenced is not None and new_fenced > old_fenced:
            events.append(
                Event(
                    "fenced",
                    f"storage node {node} refused {int(new_fenced - old_fenced)} request(s) "
                    "of a fenced (older) store session",
                )
            )

    old_parts = {p["partition"]: p for p in before.partitions}
    for p in after.partitions:
        pid = p["partition"]
        old = old_parts.get(pid)
        if old is None:
            continue
        if p["generation"] != old["generation"] and p["generation"] is not None:
            if p["owner"] is None:
                events.append(Event("unassigned", f"partition {pid} has no server", pid))
            elif old["owner"] is not None and old["owner"] != p["owner"]:
                kind = "failover" if _lost(old["owner"], before, after) else "moved"
                verb = "failed over" if kind == "failover" else "moved"
                events.append(
                    Event(
                        kind,
                        f"partition {pid} {verb} from server {old['owner']} to server "
                        f"{p['owner']} (generation {p['generation']})",
                        pid,
                    )
                )
            else:
                events.append(
                    Event(
                        "assigned",
                        f"partition {pid} assigned to server {p['owner']} "
                        f"(generation {p['generation']})",
                        pid,
                    )
                )
        if (
            p["session_id"] is not None
            and old["session_id"] is not None
            and p["session_id"] > old["session_id"]
        ):
            events.append(
                Event("store_session", f"partition {pid}: new store session {p['session_id']}", pid)
            )
        if p["state"] == "writable" and (
            old["state"] in ("recovering", "undecidable")
            or (old["state"] == "writable" and p["serving_session_id"] != old["serving_session_id"])
        ):
            events.append(
                Event(
                    "recovery",
                    f"partition {pid} recovered: writable at high-water mark "
                    f"{p['high_water_mark']}",
                    pid,
                )
            )
        elif p["state"] == "undecidable" and old["state"] != "undecidable":
            events.append(
                Event(
                    "undecidable",
                    f"partition {pid}: recovery cannot decide the closing high-water mark "
                    "until offline replicas return",
                    pid,
                )
            )
        old_nodes_of = {r["node"] for r in old["replicas"]}
        new_nodes_of = {r["node"] for r in p["replicas"]}
        for node in sorted(new_nodes_of - old_nodes_of):
            if node in old_nodes:
                events.append(Event("membership", f"partition {pid}: replica added on {node}", pid))
        for node in sorted(old_nodes_of - new_nodes_of):
            if node in new_nodes:
                events.append(
                    Event("membership", f"partition {pid}: replica on {node} removed", pid)
                )
        events.extend(_replica_session_events(pid, old, p))
        events.extend(_archive_events(pid, old, p))
    events.extend(_client_events(before, after))
    events.extend(_acl_events(before.acl, after.acl))
    return events


MAX_CLIENT_EVENTS = 10
"""Client connects and leaves in one refresh beyond which one summary is shown (a
cluster whose clients all start at once would otherwise fill the time line)."""


def _replica_session_events(pid: int, old: dict[str, Any], new: dict[str, Any]) -> list[Event]:
    """Replicas leaving and rejoining the store session that stays the same (a new store
    session, or another owner, starts its own membership: that is not a replica leaving)."""
    if (
        old["state"] is None
        or new["state"] is None
        or old["owner"] != new["owner"]
        or old["serving_session_id"] != new["serving_session_id"]
    ):
        return []
    was = {r["node"] for r in old["replicas"] if r["writable"]}
    now = {r["node"] for r in new["replicas"] if r["writable"]}
    assigned = {r["node"] for r in old["replicas"]} & {r["node"] for r in new["replicas"]}
    session = new["serving_session_id"]
    events = [
        Event(
            "replica_left",
            f"partition {pid}: the replica on {node} left store session {session} "
            "(it stopped answering or fell behind; it catches up to rejoin)",
            pid,
        )
        for node in sorted((was - now) & assigned)
    ]
    events += [
        Event(
            "replica_rejoined",
            f"partition {pid}: the replica on {node} rejoined store session {session}",
            pid,
        )
        for node in sorted((now - was) & assigned)
    ]
    return events


def _archive_events(pid: int, old: dict[str, Any], new: dict[str, Any]) -> list[Event]:
    before, after = old.get("archive_mark"), new.get("archive_mark")
    if after is None or after < 0 or (before is not None and after <= before):
        return []
    return [
        Event(
            "archive",
            f"partition {pid}: an archive round archived through transaction {after} "
            f"({new.get('archived_bytes') or 0} bytes in the archive)",
            pid,
        )
    ]


def _client_events(before: Snapshot, after: Snapshot) -> list[Event]:
    old = {(c["partition"], c["client"]): c for c in before.clients}
    new = {(c["partition"], c["client"]): c for c in after.clients}
    # only partitions whose server answered both times: a silent server is not its
    # clients leaving
    answered = {p["partition"] for p in before.partitions if p["state"] is not None} & {
        p["partition"] for p in after.partitions if p["state"] is not None
    }
    came = sorted(k for k in new.keys() - old.keys() if k[0] in answered)
    went = sorted(k for k in old.keys() - new.keys() if k[0] in answered)
    if len(came) + len(went) > MAX_CLIENT_EVENTS:
        return [Event("clients", f"{len(came)} client(s) connected, {len(went)} left")]
    events = [
        Event(
            "client_connected",
            f"client {client} connected to partition {pid} "
            f"(feed position {new[(pid, client)]['position']})",
            pid,
        )
        for pid, client in came
    ]
    events += [
        Event("client_left", f"client {client} left partition {pid}", pid) for pid, client in went
    ]
    return events


def _grants(acl: dict[str, Any] | None) -> dict[tuple[str, str], dict[str, Any]]:
    rows = [] if acl is None else acl["grants"]
    return {(r["key"], str(r["partition"])): r for r in rows}


def _acl_events(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[Event]:
    events: list[Event] = []
    was_enforced = before is not None and before["enforced"]
    enforced = after is not None and after["enforced"]
    if enforced != was_enforced:
        events.append(
            Event(
                "acl",
                "ACL enforced: clients need a grant for each partition"
                if enforced
                else "ACL no longer enforced: every client may read and write",
            )
        )
    old, new = _grants(before), _grants(after)

    def who(row: dict[str, Any]) -> str:
        return (
            f"key {row['name']} ({row['key'][:8]}...)"
            if row["name"]
            else f"key {row['key'][:8]}..."
        )

    def where(row: dict[str, Any]) -> str:
        return (
            f"partition {row['partition']}"
            if isinstance(row["partition"], int)
            else "every partition"
        )

    for k in sorted(new.keys() - old.keys()):
        row = new[k]
        events.append(
            Event("acl", f"ACL: {who(row)} granted {row['permission']} on {where(row)}", _pid(row))
        )
    for k in sorted(old.keys() - new.keys()):
        row = old[k]
        events.append(
            Event(
                "acl",
                f"ACL: {who(row)} no longer holds {row['permission']} on {where(row)}",
                _pid(row),
            )
        )
    for k in sorted(old.keys() & new.keys()):
        if old[k]["permission"] != new[k]["permission"]:
            row = new[k]
            events.append(
                Event(
                    "acl",
                    f"ACL: {who(row)} holds {row['permission']} on {where(row)} "
                    f"(was {old[k]['permission']})",
                    _pid(row),
                )
            )
    return events


def _pid(row: dict[str, Any]) -> int | None:
    return row["partition"] if isinstance(row["partition"], int) else None
