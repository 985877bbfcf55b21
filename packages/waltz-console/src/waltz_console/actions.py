"""The console's actions, through the cluster admin code the ``waltz cluster`` and ``waltz
server`` commands use: :class:`~waltz_server.cluster_admin.ClusterAdmin`'s membership
changes (compare-and-set, bounded retries), the preferred partition overrides
(:class:`~waltz_server.server.preferred.PreferredPartitionStore`) and
:mod:`waltz_server.cluster_check` for ``verify``.

Every mutation the console makes goes through this module (and only the imports
below name where the admin code lives): moving that code is a change here alone.
Each action validates its arguments (a clear :class:`ConfigError` naming the bad
one) and returns a short JSON-able outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from waltz_api.cluster import validate_storage_node
from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConfigError, WaltzError
from waltz_api.storage_client import StorageAdminClient
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.cluster_check import PROBLEM, check, collect, replica_progress, storage_endpoint
from waltz_server.server.preferred import (
    PreferredPartitionStore,
    validate_endpoint,
    validate_partitions,
)


@dataclass(frozen=True)
class ActionContext:
    """What an action works with: the console's metadata client and transport."""

    metadata: ClusterAdmin
    transport: Transport
    storage_endpoint: str = "tcp://{}"
    timeout: float = 5.0


def _partition(arguments: Mapping[str, Any], key: str = "partition") -> int:
    value = arguments.get(key)
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"{key} is required (a partition id)", key=key)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key} must be a partition id (0 or more), got {value!r}", key=key)
    return value


def _node(arguments: Mapping[str, Any]) -> str:
    value = arguments.get("storage_node")
    if not isinstance(value, str) or not value.strip():
        raise ConfigError("storage_node is required (host:port)", key="storage_node")
    return validate_storage_node(value)


async def _host_partition(ctx: ActionContext, node: str, partition_id: int | None) -> None:
    """The storage node must answer and belong to this cluster; with a partition it is
    told to host it (idempotent), as ``waltz cluster add-replica`` does."""
    config = await ctx.metadata.config()
    endpoint = storage_endpoint(ctx.storage_endpoint, node)
    try:
        async with asyncio.timeout(ctx.timeout * 3):
            async with await StorageAdminClient.connect(
                ctx.transport, endpoint, sender="admin:console", timeout=ctx.timeout
            ) as admin:
                info = await admin.info()
                if str(info.get("cluster_key")) != str(config.cluster_key):
                    raise ConfigError(
                        f"storage node {node} ({endpoint}) belongs to cluster "
                        f"{info.get('cluster_key')}, not {config.cluster_key}",
                        key="storage_node",
                    )
                if partition_id is not None:
                    await admin.add_partition(partition_id, config.cluster_key)
    except TimeoutError:
        raise WaltzError(
            f"storage node {node} ({endpoint}) did not answer within {ctx.timeout * 3:g} s; "
            "is it running?"
        ) from None


async def add_replica(ctx: ActionContext, arguments: Mapping[str, Any]) -> dict[str, Any]:
    partition, node = _partition(arguments), _node(arguments)
    before = await ctx.metadata.replica_assignments()
    if node not in before.storage:
        raise ConfigError(
            f"storage node {node} is not a member of the cluster (members: "
            f"{', '.join(sorted(before.storage)) or 'none'}); add it first",
            key="storage_node",
        )
    await ctx.metadata.config()
    await _host_partition(ctx, node, partition)
    await ctx.metadata.add_replica(partition, node)
    if partition in before.partitions_of(node):
        return {"message": f"partition {partition}: {node} holds a replica already"}
    return {"message": f"partition {partition}: replica added on {node}; it catches up now"}


async def remove_replica(ctx: ActionContext, arguments: Mapping[str, Any]) -> dict[str, Any]:
    partition, node = _partition(arguments), _node(arguments)
    before = await ctx.metadata.replica_assignments()
    if partition not in before.partitions_of(node):
        return {"message": f"partition {partition}: {node} holds no replica of it; nothing done"}
    await ctx.metadata.remove_replica(partition, node)
    return {"message": f"partition {partition}: replica on {node} removed (its data stays)"}


async def add_storage_node(ctx: ActionContext, arguments: Mapping[str, Any]) -> dict[str, Any]:
    node = _node(arguments)
    group = arguments.get("group", 0)
    if isinstance(group, str) and group.strip().isdigit():
        group = int(group)
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise ConfigError(f"group must be 0 or more, got {group!r}", key="group")
    await _host_partition(ctx, node, None)
    await ctx.metadata.add_storage_node(node, group=group)
    return {"message": f"storage node {node} is a member (group {group}); it holds no replica yet"}


async def remove_storage_node(ctx: ActionContext, arguments: Mapping[str, Any]) -> dict[str, Any]:
    node = _node(arguments)
    force = arguments.get("force", False) is True
    held = (await ctx.metadata.replica_assignments()).partitions_of(node)
    await ctx.metadata.remove_storage_node(node, force=force)
    dropped = f"; its replicas of partitions {list(held)} were dropped" if held else ""
    return {"message": f"storage node {node} removed{dropped}"}


async def set_preferred_partitions(
    ctx: ActionContext, arguments: Mapping[str, Any]
) -> dict[str, Any]:
    """Set (replace) the preferred partitions of the server at ``endpoint``; ``reset``
    drops the override (back to the server's config)."""
    endpoint = validate_endpoint(str(arguments.get("endpoint") or ""))
    store = PreferredPartitionStore(ctx.metadata.coordination)
    if arguments.get("reset") is True:
        await store.change(endpoint, lambda _current: None)
        return {"message": f"{endpoint}: preferred partitions back to the server's config"}
    raw = arguments.get("partitions")
    if isinstance(raw, str):
        parts = [p for p in raw.replace(",", " ").split() if p]
        if not all(p.isdigit() for p in parts):
            raise ConfigError(
                f"partitions must be partition ids separated by commas, got {raw!r}",
                key="partitions",
            )
        raw = [int(p) for p in parts]
    if not isinstance(raw, list) or not all(
        isinstance(p, int) and not isinstance(p, bool) for p in raw
    ):
        raise ConfigError("partitions must be a list of partition ids", key="partitions")
    config = await ctx.metadata.config()
    chosen = validate_partitions(raw, config.num_partitions)
    new = await store.change(endpoint, lambda _current: chosen)
    return {"message": f"{endpoint}: preferred partitions {list(new or ())}"}


async def verify(ctx: ActionContext, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """``waltz cluster verify``: every finding, problems first."""
    facts = await collect(
        ctx.metadata,
        ctx.transport,
        endpoint_template=ctx.storage_endpoint,
        timeout=ctx.timeout,
    )
    if facts.config is None:
        raise WaltzError(facts.config_error or "no cluster config at this coordination root")
    findings = sorted(check(facts), key=lambda f: f.severity != PROBLEM)
    problems = [f for f in findings if f.severity == PROBLEM]
    return {
        "message": f"{len(problems)} problem(s) found" if problems else "OK: no problem found",
        "ok": not problems,
        "findings": [f.to_json() for f in findings],
        "replica_progress": replica_progress(facts),
    }


Action = Callable[[ActionContext, Mapping[str, Any]], Awaitable[dict[str, Any]]]

ACTIONS: dict[str, Action] = {
    "add-replica": add_replica,
    "remove-replica": remove_replica,
    "add-storage-node": add_storage_node,
    "remove-storage-node": remove_storage_node,
    "preferred-partitions": set_preferred_partitions,
    "verify": verify,
}
"""Every action by the name its URL uses (``POST /api/actions/NAME``)."""
