"""``waltz cluster``: create a cluster's metadata (the spec's CreateCluster) and show it."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from waltz_api.cluster import ClusterConfig, ClusterMetadata, coordination_from_uri
from waltz_api.errors import ConfigError

T = TypeVar("T")

COORDINATION_HELP = (
    "Coordination service URI, e.g. zk://127.0.0.1:2181/waltz (the scheme chooses the plugin)."
)


def _run_with_metadata(uri: str, work: Callable[[ClusterMetadata], Awaitable[T]]) -> T:
    async def run() -> T:
        coordination = coordination_from_uri(uri)
        await coordination.start()
        try:
            return await work(ClusterMetadata(coordination))
        finally:
            await coordination.close()

    return asyncio.run(run())


@click.group("cluster")
def cluster_group() -> None:
    """Cluster metadata: create it once, then inspect it."""


@cluster_group.command("create")
@click.option(
    "--coordination", "uri", required=True, envvar="WALTZ_COORDINATION", help=COORDINATION_HELP
)
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
def create_cluster(
    uri: str,
    partitions: int,
    replicas: int,
    storage_nodes: tuple[str, ...],
    cluster_key: uuid.UUID | None,
) -> None:
    """Write a new cluster's metadata. Refused (exit 1) when the root holds one already."""
    nodes = [n.strip() for arg in storage_nodes for n in arg.split(",") if n.strip()]
    if not nodes:
        raise ConfigError("give at least one storage node with --storage HOST:PORT", key="storage")

    async def work(meta: ClusterMetadata) -> ClusterConfig:
        return await meta.create_cluster(
            num_partitions=partitions,
            num_replicas=replicas,
            storage_nodes=nodes,
            cluster_key=cluster_key,
        )

    config = _run_with_metadata(uri, work)
    click.echo(
        f"created cluster {config.cluster_key}: {config.num_partitions} partitions, "
        f"{config.num_replicas} replicas on {len(nodes)} storage nodes at {uri}"
    )


@cluster_group.command("show")
@click.option(
    "--coordination", "uri", required=True, envvar="WALTZ_COORDINATION", help=COORDINATION_HELP
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def show_cluster(uri: str, as_json: bool) -> None:
    """Print the cluster config, replica assignments, servers and partition state."""

    async def work(meta: ClusterMetadata) -> dict[str, Any]:
        return await meta.describe()

    summary = _run_with_metadata(uri, work)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    click.echo(f"cluster key: {summary['cluster_key']}")
    click.echo(f"partitions:  {summary['partitions']}")
    click.echo(f"replicas:    {summary['replicas']}")
    click.echo("storage nodes:")
    for node, parts in summary["storage"].items():
        click.echo(f"  {node}: partitions {', '.join(str(p) for p in parts) or '(none)'}")
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


@cluster_group.command("delete")
@click.option(
    "--coordination", "uri", required=True, envvar="WALTZ_COORDINATION", help=COORDINATION_HELP
)
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

    async def work(meta: ClusterMetadata) -> None:
        await meta.delete_cluster(cluster_key, force=force)

    _run_with_metadata(uri, work)
    click.echo(f"deleted cluster {cluster_key} at {uri}")
