"""``waltz cluster``: a cluster's metadata and membership.

``create`` (the spec's CreateCluster), ``show`` (``--replicas``: each replica's progress
against its partition's committed high-water mark), ``verify`` (the metadata against the
storage nodes and servers), ``delete``; membership: ``add-storage-node``,
``remove-storage-node``, ``add-replica`` (``--wait``: until it caught up),
``remove-replica``; ``features`` (module :mod:`waltz_server.cli.features`): the feature
level. Commands that contact storage nodes or servers take
``--transport`` (default zmq), ``--transport-option KEY=VALUE`` and
``--storage-endpoint`` (how a storage node's ``host:port`` becomes an endpoint, as in
the server's config; default ``tcp://{}``).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from waltz_api.cluster import ClusterConfig, ReplicaAssignments, validate_storage_node
from waltz_api.contracts.transport import Transport
from waltz_api.errors import (
    ClusterExistsError,
    ClusterNotFoundError,
    ConfigError,
    PluginError,
    UnavailableError,
    WaltzError,
)
from waltz_api.features import MAX_FEATURE_LEVEL, MIN_FEATURE_LEVEL
from waltz_cli.coordination import coordination_option, start_coordination
from waltz_cli.deadline import REFUSAL_PROBE, refused, run, tcp_address, timeout_option
from waltz_cli.output import emit, output_option
from waltz_cli.transport import parse_transport_options, transport_options
from waltz_server.cluster_admin import ClusterAdmin

T = TypeVar("T")


def _run_with_metadata(
    uri: str, work: Callable[[ClusterAdmin], Awaitable[T]], *, create: bool = False
) -> T:
    """``work`` on the cluster metadata at ``uri``, all within the command's --timeout
    (``create``: a ``local`` location may be made)."""

    async def main() -> T:
        coordination = await start_coordination(uri, create=create)
        try:
            return await work(ClusterAdmin(coordination))
        finally:
            await coordination.close()

    return run(main, waiting_for=f"the coordination service at {uri}")


@dataclass(frozen=True)
class Reach:
    """How to reach storage nodes and servers (the options of the commands that do)."""

    transport: str
    options: dict[str, Any]
    storage_endpoint: str
    timeout: float

    def create(self) -> Transport:
        from waltz_api.plugins import get_registry

        try:
            descriptor = get_registry().get("transport", self.transport)
        except PluginError as exc:
            raise ConfigError(f"--transport: {exc}", key="transport") from None
        transport: Transport = descriptor.factory(self.options)
        return transport


def _reach_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--transport, --transport-option, --storage-endpoint, --timeout -> ``reach``."""

    @transport_options
    @click.option(
        "--storage-endpoint",
        default="tcp://{}",
        show_default=True,
        help="A storage node's endpoint from its host:port ({}), as in the servers' config.",
    )
    @timeout_option()
    @functools.wraps(func)
    def wrapper(
        *,
        transport: str,
        transport_options: tuple[str, ...],
        storage_endpoint: str,
        timeout: float,
        **kwargs: Any,
    ) -> Any:
        from waltz_server.cluster_check import storage_endpoint as check_template

        check_template(storage_endpoint, "host:1")
        reach = Reach(
            transport, parse_transport_options(transport_options), storage_endpoint, timeout
        )
        return func(reach=reach, **kwargs)

    return wrapper


def _run_with_transport(
    uri: str,
    reach: Reach,
    work: Callable[[ClusterAdmin, Transport], Awaitable[T]],
    *,
    longer: float = 0.0,
) -> T:
    """``work`` on the metadata and the processes of the cluster, within --timeout (and
    ``longer`` seconds more, for a wait the command was asked for)."""

    async def main() -> T:
        transport = reach.create()
        try:
            coordination = await start_coordination(uri)
            try:
                return await work(ClusterAdmin(coordination), transport)
            finally:
                await coordination.close()
        finally:
            await transport.close()

    return run(main, waiting_for=f"the cluster at {uri}", timeout=reach.timeout + longer)


@click.group("cluster")
def cluster_group() -> None:
    """Cluster metadata: create it once, then inspect it."""


@cluster_group.command("create")
@coordination_option
@click.option(
    "--partitions", type=click.IntRange(min=1), required=True, help="Number of partitions."
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    required=True,
    help="Replicas per partition (at most the number of storage nodes).",
)
@click.option(
    "--storage",
    "storage_nodes",
    multiple=True,
    required=True,
    metavar="HOST:PORT",
    help="A storage node's connect string; repeat for each node.",
)
@click.option(
    "--cluster-key",
    type=click.UUID,
    default=None,
    help="The cluster key (a UUID); a new random one by default.",
)
@click.option(
    "--feature-level",
    type=click.IntRange(min=MIN_FEATURE_LEVEL, max=MAX_FEATURE_LEVEL),
    default=MAX_FEATURE_LEVEL,
    show_default=True,
    help="The cluster's feature level: a lower one for a cluster that processes of an "
    "earlier release join (raise it later with `waltz cluster features --raise`).",
)
def create_cluster(
    *,
    uri: str,
    partitions: int,
    replicas: int,
    storage_nodes: tuple[str, ...],
    cluster_key: uuid.UUID | None,
    feature_level: int,
) -> None:
    """Write a new cluster's metadata. Refused (exit 1) when the root holds another
    cluster; a re-run with the same --cluster-key, partitions and replicas does nothing."""
    nodes = [n.strip() for arg in storage_nodes for n in arg.split(",") if n.strip()]
    if not nodes:
        raise ConfigError("give at least one storage node with --storage HOST:PORT", key="storage")

    async def work(meta: ClusterAdmin) -> tuple[ClusterConfig, bool]:
        try:
            created = await meta.create_cluster(
                num_partitions=partitions,
                num_replicas=replicas,
                storage_nodes=nodes,
                cluster_key=cluster_key,
                feature_level=feature_level,
            )
        except ClusterExistsError:
            if cluster_key is None:
                raise
            try:
                existing = await meta.config()
            except ClusterNotFoundError:  # its creation did not complete
                raise ClusterExistsError(
                    f"the creation of a cluster at this root did not complete; delete it "
                    f"(`waltz cluster delete --cluster-key {cluster_key}`) and create it again"
                ) from None
            if existing != ClusterConfig(cluster_key, partitions, replicas):
                raise
            return existing, False
        return created, True

    config, created = _run_with_metadata(uri, work, create=True)
    if not created:
        click.echo(
            f"cluster {config.cluster_key} exists already with {config.num_partitions} "
            f"partitions and {config.num_replicas} replicas at {uri}; nothing to do "
            "(`waltz cluster show` lists its storage nodes)"
        )
        return
    click.echo(
        f"created cluster {config.cluster_key}: {config.num_partitions} partitions, "
        f"{config.num_replicas} replicas on {len(nodes)} storage nodes at {uri} (feature "
        f"level {feature_level})"
    )


@cluster_group.command("show")
@coordination_option
@output_option
@click.option(
    "--replicas",
    "with_replicas",
    is_flag=True,
    help="Also ask the storage nodes and servers: each replica's max transaction id "
    "against its partition's committed high-water mark (catch-up progress).",
)
@_reach_options
def show_cluster(uri: str, output: str, with_replicas: bool, reach: Reach) -> None:
    """Print the cluster config, replica assignments, servers and partition state."""
    from waltz_server.cluster_check import collect, replica_progress

    async def work(meta: ClusterAdmin, transport: Transport) -> dict[str, Any]:
        summary = await meta.describe()
        facts = await collect(
            meta, transport, endpoint_template=reach.storage_endpoint, timeout=reach.timeout
        )
        summary["replica_progress"] = replica_progress(facts)
        return summary

    if with_replicas:
        summary = _run_with_transport(uri, reach, work)
    else:
        summary = _run_with_metadata(uri, ClusterAdmin.describe)
    counts = {p: 0 for p in range(summary["partitions"])}
    for parts in summary["storage"].values():
        for p in parts:
            counts[p] = counts.get(p, 0) + 1
    summary["replica_counts"] = [{"partition": p, "replicas": n} for p, n in counts.items()]
    emit(output, summary, lambda: _show_text(summary, counts, with_replicas))


def _replicas_text(configured: int, counts: dict[int, int]) -> str:
    """The replicas each partition has now (replica assignments), against the config."""
    if all(n == configured for n in counts.values()):
        return f"{configured} per partition"
    others = [f"partition {p}: {n}" for p, n in sorted(counts.items()) if n != configured]
    return f"{configured} configured; now {', '.join(others)} ({configured} for the others)"


def _show_text(summary: dict[str, Any], counts: dict[int, int], with_replicas: bool) -> None:
    click.echo(f"cluster key: {summary['cluster_key']}")
    click.echo(f"partitions:  {summary['partitions']}")
    click.echo(f"replicas:    {_replicas_text(summary['replicas'], counts)}")
    click.echo("storage nodes:")
    groups = summary.get("groups", {})
    for node, parts in summary["storage"].items():
        group = f" (group {groups[node]})" if groups.get(node) else ""
        click.echo(f"  {node}{group}: partitions {', '.join(str(p) for p in parts) or '(none)'}")
    click.echo("servers:" + ("" if summary["servers"] else " (none registered)"))
    for server in summary["servers"]:
        click.echo(f"  {server['server_id']}: {server['endpoint']}")
    click.echo("partition  server  generation  store-session  replicas (session/closing hwm)")
    for p in summary["partition_state"]:
        replicas = ", ".join(
            f"{r['storage']} ({r['session_id']}/{r['closing_high_water_mark']})"
            for r in p["replicas"]
        )
        server = "-" if p["server_id"] < 0 else str(p["server_id"])
        click.echo(
            f"{p['partition']:>9}  {server:>6}  {p['generation']:>10}  "
            f"{p['store_session_id']:>13}  {replicas}"
        )
    if with_replicas:
        click.echo("partition  high-water mark  replica: max transaction id (behind)")
        for row in summary["replica_progress"]:
            hwm = "?" if row["high_water_mark"] is None else str(row["high_water_mark"])
            click.echo(f"{row['partition']:>9}  {hwm:>15}  " + _progress_text(row["replicas"]))


def _progress_text(replicas: list[dict[str, Any]]) -> str:
    parts = []
    for r in replicas:
        if r["error"]:
            parts.append(f"{r['storage']}: ? ({r['error']})")
            continue
        max_id = "?" if r["max_transaction_id"] is None else r["max_transaction_id"]
        behind = "" if not r["behind"] else f", {r['behind']} behind"
        session = "" if r["in_store_session"] else ", not in the store session yet"
        parts.append(f"{r['storage']}: {max_id}{behind}{session}")
    return "; ".join(parts)


@cluster_group.command("delete")
@coordination_option
@click.option(
    "--cluster-key",
    type=click.UUID,
    required=True,
    help="The key of the cluster to delete (see `waltz cluster show`): a guard against "
    "deleting the wrong one.",
)
@click.option("--force", is_flag=True, help="Delete even while servers are registered.")
def delete_cluster(uri: str, cluster_key: uuid.UUID, force: bool) -> None:
    """Delete a cluster's metadata (not the storage nodes' data)."""

    async def work(meta: ClusterAdmin) -> None:
        await meta.delete_cluster(cluster_key, force=force)

    _run_with_metadata(uri, work)
    click.echo(f"deleted cluster {cluster_key} at {uri}")


@cluster_group.command("verify")
@coordination_option
@output_option
@click.option(
    "--metadata-only",
    is_flag=True,
    help="Check the coordination metadata only (contact no storage node or server).",
)
@_reach_options
def verify_cluster(uri: str, output: str, metadata_only: bool, reach: Reach) -> None:
    """Check the metadata, the storage nodes and the servers against each other.

    Config present and ready; every partition has replicas on known storage nodes;
    each storage node reachable, of this cluster (its key), hosting its partitions;
    store sessions and low-water marks consistent; replicas against the committed
    high-water marks; partitions owned by live servers; every storage node and live
    server at the cluster's feature level (or able to be told it). Prints every finding; exits 0
    when there is no problem (notes do not count), 1 otherwise."""
    from waltz_server.cluster_check import PROBLEM, check, collect, replica_progress

    async def work(meta: ClusterAdmin, transport: Transport) -> tuple[Any, Any]:
        facts = await collect(
            meta,
            None if metadata_only else transport,
            endpoint_template=reach.storage_endpoint,
            timeout=reach.timeout,
        )
        return facts, check(facts)

    facts, findings = _run_with_transport(uri, reach, work)
    if facts.config is None:  # nothing to check: no (complete) cluster at this root
        raise WaltzError(facts.config_error or "no cluster config at this coordination root")
    problems = [f for f in findings if f.severity == PROBLEM]
    result = {
        "ok": not problems,
        "cluster_key": str(facts.config.cluster_key),
        "storage_nodes_checked": None if facts.storage is None else sorted(facts.storage),
        "problems": [f.to_json() for f in problems],
        "notes": [f.to_json() for f in findings if f.severity != PROBLEM],
        "replica_progress": replica_progress(facts),
    }
    config = facts.config

    def text() -> None:
        nodes = 0 if facts.assignments is None else len(facts.assignments.storage)
        scope = (
            "metadata only"
            if metadata_only
            else f"{nodes} storage node(s), {len(facts.high_water_marks)} high-water mark(s)"
        )
        click.echo(
            f"cluster {config.cluster_key}: {config.num_partitions} "
            f"partition(s), {len(facts.servers)} live server(s); checked {scope}"
        )
        for finding in findings:
            label = "PROBLEM" if finding.severity == PROBLEM else "note"
            click.echo(f"{label}: {finding}")
        click.echo(f"{len(problems)} problem(s) found" if problems else "OK: no problem found")

    emit(output, result, text)
    if problems:
        raise SystemExit(1)


# -- membership -------------------------------------------------------------------------------


def _storage_node_argument(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.argument("storage_node", metavar="HOST:PORT")(func)


async def _host_partition(
    meta: ClusterAdmin, transport: Transport, reach: Reach, node: str, partition_id: int | None
) -> None:
    """Check that the storage node answers and belongs to this cluster; with a partition,
    make it host that partition (idempotent)."""
    from waltz_api.storage_client import StorageAdminClient
    from waltz_server.cluster_check import storage_endpoint

    config = await meta.config()
    endpoint = storage_endpoint(reach.storage_endpoint, node)
    address = tcp_address(endpoint)
    if address is not None and await refused([address], min(REFUSAL_PROBE, reach.timeout)):
        raise UnavailableError(
            f"storage node {node} ({endpoint}) refused the connection (nothing listens "
            "there); is it running?"
        )
    try:
        async with asyncio.timeout(reach.timeout):
            async with await StorageAdminClient.connect(
                transport, endpoint, sender="admin:cluster", timeout=reach.timeout
            ) as admin:
                info = await admin.info()
                if str(info.get("cluster_key")) != str(config.cluster_key):
                    raise ConfigError(
                        f"storage node {node} ({endpoint}) belongs to cluster "
                        f"{info.get('cluster_key')}, not {config.cluster_key}; start it with "
                        "this cluster's key",
                        key="storage",
                    )
                if int(info.get("num_partitions", -1)) != config.num_partitions:
                    raise ConfigError(
                        f"storage node {node} was opened for {info.get('num_partitions')} "
                        f"partitions, the cluster has {config.num_partitions}",
                        key="storage",
                    )
                if partition_id is not None:
                    await admin.add_partition(partition_id, config.cluster_key)
    except TimeoutError:
        raise UnavailableError(
            f"storage node {node} ({endpoint}) did not answer within {reach.timeout:g}s; "
            "is it running? (--timeout waits longer)"
        ) from None


def _check_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--check/--no-check",
        default=True,
        show_default=True,
        help="Contact the storage node first: it must answer and belong to this cluster.",
    )(func)


@cluster_group.command("add-storage-node")
@coordination_option
@_storage_node_argument
@click.option(
    "--group", type=click.IntRange(min=0), default=0, show_default=True, help="Its group."
)
@_check_option
@_reach_options
def add_storage_node(uri: str, storage_node: str, group: int, check: bool, reach: Reach) -> None:
    """Make a storage node (HOST:PORT) a member of the cluster, holding no replica yet
    (give it some with add-replica). Adding a member again does nothing."""
    node = validate_storage_node(storage_node)

    async def work(meta: ClusterAdmin, transport: Transport) -> bool:
        before = await meta.replica_assignments()
        if check:
            await _host_partition(meta, transport, reach, node, None)
        await meta.add_storage_node(node, group=group)
        return node not in before.storage

    added = _run_with_transport(uri, reach, work)
    if added:
        click.echo(f"storage node {node} added (group {group}); it holds no replica yet")
    else:
        click.echo(f"storage node {node} is a member already (group {group}); nothing to do")


@cluster_group.command("remove-storage-node")
@coordination_option
@_storage_node_argument
@click.option(
    "--force",
    is_flag=True,
    help="Also drop the replicas it holds (never a partition's last one).",
)
def remove_storage_node(uri: str, storage_node: str, force: bool) -> None:
    """Remove a storage node (HOST:PORT) from the cluster. Refused while it holds
    replicas (move them first: add-replica elsewhere, then remove-replica), unless
    --force. Its data stays on the node."""
    node = validate_storage_node(storage_node)

    async def work(meta: ClusterAdmin) -> tuple[int, ...]:
        held = (await meta.replica_assignments()).partitions_of(node)
        await meta.remove_storage_node(node, force=force)
        return held

    held = _run_with_metadata(uri, work)
    dropped = f"; its replicas of partitions {list(held)} were dropped" if held else ""
    click.echo(f"storage node {node} removed{dropped}")


def _partition_argument(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.argument("partition", type=click.IntRange(min=0))(func)


@cluster_group.command("add-replica")
@coordination_option
@_partition_argument
@_storage_node_argument
@click.option(
    "--wait",
    "wait_seconds",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="Wait (at most SECONDS) until the new replica has caught up with the "
    "partition's committed high-water mark and joined its store session.",
)
@_reach_options
def add_replica(
    *,
    uri: str,
    partition: int,
    storage_node: str,
    wait_seconds: float | None,
    reach: Reach,
) -> None:
    """Place a replica of PARTITION on the storage node HOST:PORT (a member: see
    add-storage-node), which must be running: it is checked (this cluster's key) and told
    to host the partition first; the partition's owner then catches the replica up in
    the background. Adding it again does nothing."""
    node = validate_storage_node(storage_node)

    async def work(meta: ClusterAdmin, transport: Transport) -> None:
        config = await meta.config()
        if partition >= config.num_partitions:
            raise ConfigError(
                f"partition {partition} does not exist: the cluster has partitions "
                f"0..{config.num_partitions - 1}",
                key="partition",
            )
        before = await meta.replica_assignments()
        if node not in before.storage:
            raise ConfigError(
                f"storage node {node} is not a member of the cluster (members: "
                f"{', '.join(sorted(before.storage)) or 'none'}); add it first with "
                "`waltz cluster add-storage-node`",
                key="storage",
            )
        # always: a replica whose node does not host the partition would refuse the
        # owner's requests (the node must be up to receive a replica)
        await _host_partition(meta, transport, reach, node, partition)
        await meta.add_replica(partition, node)
        if partition not in before.partitions_of(node):
            click.echo(f"partition {partition}: replica added on {node}")
        else:
            click.echo(f"partition {partition}: {node} holds a replica already; nothing to do")
        if wait_seconds is not None:
            click.echo(
                await _wait_caught_up(
                    meta,
                    transport=transport,
                    reach=reach,
                    partition=partition,
                    node=node,
                    wait_seconds=wait_seconds,
                )
            )

    _run_with_transport(uri, reach, work, longer=wait_seconds or 0.0)


async def _wait_caught_up(
    meta: ClusterAdmin,
    *,
    transport: Transport,
    reach: Reach,
    partition: int,
    node: str,
    wait_seconds: float,
) -> str:
    """Poll until the replica on ``node`` is in the partition's store session and holds
    its committed high-water mark; a line saying so, or WaltzError after the wait."""
    from waltz_server.cluster_check import collect, replica_progress

    deadline = time.monotonic() + wait_seconds
    last = "no answer yet"
    while True:
        facts = await collect(
            meta, transport, endpoint_template=reach.storage_endpoint, timeout=reach.timeout
        )
        row = replica_progress(facts)[partition]
        hwm = row["high_water_mark"]
        mine = next((r for r in row["replicas"] if r["storage"] == node), None)
        if mine is None:
            raise WaltzError(
                f"partition {partition}: {node} no longer holds a replica (removed meanwhile?)"
            )
        if mine["error"]:
            last = f"the replica cannot be read: {mine['error']}"
        elif hwm is None:
            reason = facts.server_errors.get(partition, "no live server owns the partition")
            last = f"the committed high-water mark is unknown ({reason})"
        else:
            last = f"replica at {mine['max_transaction_id']}, committed high-water mark {hwm}" + (
                "" if mine["in_store_session"] else ", not in the store session yet"
            )
            if mine["in_store_session"] and mine["max_transaction_id"] >= hwm:
                return f"partition {partition}: replica on {node} caught up ({last})"
        if time.monotonic() >= deadline:
            raise WaltzError(
                f"partition {partition}: the replica on {node} did not catch up within "
                f"{wait_seconds:g} s ({last}); it keeps catching up in the background "
                "(watch `waltz cluster show --replicas`)"
            )
        await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


@cluster_group.command("remove-replica")
@coordination_option
@_partition_argument
@_storage_node_argument
def remove_replica(uri: str, partition: int, storage_node: str) -> None:
    """Drop the replica of PARTITION on the storage node HOST:PORT: the owner stops
    writing it (its data stays on the node: `waltz storage remove-partition` deletes
    it). Refused for the partition's last replica; removing it again does nothing."""
    node = validate_storage_node(storage_node)

    async def work(meta: ClusterAdmin) -> bool:
        config = await meta.config()
        if partition >= config.num_partitions:
            raise ConfigError(
                f"partition {partition} does not exist: the cluster has partitions "
                f"0..{config.num_partitions - 1}",
                key="partition",
            )
        current: ReplicaAssignments = await meta.replica_assignments()
        if node not in current.storage:
            raise ConfigError(
                f"storage node {node} is not a member of the cluster (members: "
                f"{', '.join(sorted(current.storage)) or 'none'})",
                key="storage",
            )
        if partition not in current.partitions_of(node):
            return False
        await meta.remove_replica(partition, node)
        return True

    if _run_with_metadata(uri, work):
        click.echo(f"partition {partition}: replica on {node} removed (its data stays on the node)")
    else:
        click.echo(f"partition {partition}: {node} holds no replica of it; nothing to do")
