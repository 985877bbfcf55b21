"""``waltz cluster features``: the cluster's feature level, shown and raised.

The level decides which formats the storage nodes write and which messages the
servers send (:mod:`waltz_api.features`). The command shows the recorded level, the
highest this Waltz supports, and for each storage node of the cluster (asked with its
admin ``info``) and each live server (its registration) the highest level it supports;
a process of 0.1.0 reports none: level 1. ``--raise`` (to the highest this Waltz
supports) or ``--to N`` records the new level, once every storage node answered and
every known process supports it (checked and written by compare-and-set on the
recorded level's version, which a server registering meanwhile changes:
:meth:`ClusterAdmin.raise_feature_level`), then tells each storage node (which migrates its
storage to the level's formats). Raising again does nothing new; lowering is refused.
"""

from __future__ import annotations

import asyncio
from typing import Any

import click

from waltz_api import __version__
from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConfigError, WaltzError
from waltz_api.features import (
    FEATURE_LEVELS,
    MAX_FEATURE_LEVEL,
    MIN_FEATURE_LEVEL,
    check_feature_level,
)
from waltz_cli.coordination import coordination_option
from waltz_cli.output import emit, output_option
from waltz_server.cli.cluster import Reach, _reach_options, _run_with_transport
from waltz_server.cluster_admin import ClusterAdmin


async def _ask_storage_node(
    transport: Transport, reach: Reach, node: str, cluster_key: str, level: int | None
) -> dict[str, Any]:
    """What one storage node says about feature levels (``level``: tell it that one
    first); ``error`` says why it said nothing."""
    from waltz_api.storage_client import StorageAdminClient
    from waltz_server.cluster_check import storage_endpoint

    endpoint = storage_endpoint(reach.storage_endpoint, node)
    row: dict[str, Any] = {
        "storage_node": node,
        "endpoint": endpoint,
        "feature_level": None,
        "max_feature_level": None,
        "version": None,
        "error": None,
    }
    try:
        async with asyncio.timeout(reach.timeout / 2):
            async with await StorageAdminClient.connect(
                transport, endpoint, sender="admin:features", timeout=reach.timeout / 2
            ) as admin:
                info = await admin.info()
                if str(info.get("cluster_key")) != cluster_key:
                    raise ConfigError(
                        f"it belongs to cluster {info.get('cluster_key')}, not {cluster_key}"
                    )
                if level is not None:
                    info = {**info, **await admin.set_feature_level(level, cluster_key)}
    except TimeoutError:
        row["error"] = f"did not answer within {reach.timeout / 2:g} s"
        return row
    except WaltzError as exc:
        row["error"] = str(exc)
        return row
    # a node of 0.1.0 reports no level: it writes and reads level 1 only
    row["feature_level"] = int(info.get("feature_level", MIN_FEATURE_LEVEL))
    row["max_feature_level"] = int(info.get("max_feature_level", MIN_FEATURE_LEVEL))
    row["version"] = str(info.get("version", OLDEST_VERSION))
    return row


async def _features(
    meta: ClusterAdmin, transport: Transport, reach: Reach, tell: int | None = None
) -> dict[str, Any]:
    config = await meta.config()
    recorded = (await meta.feature_level()).value
    nodes = sorted((await meta.replica_assignments()).storage)
    rows = await asyncio.gather(
        *(_ask_storage_node(transport, reach, n, str(config.cluster_key), tell) for n in nodes)
    )
    return {
        "feature_level": recorded,
        "max_feature_level": MAX_FEATURE_LEVEL,
        "version": __version__,
        "levels": [
            {"level": f.level, "release": f.release, "enables": list(f.enables)}
            for f in FEATURE_LEVELS
        ],
        "storage_nodes": list(rows),
        "servers": [
            {
                "server_id": s.server_id,
                "endpoint": s.endpoint,
                "max_feature_level": s.max_feature_level,
            }
            for s in await meta.servers()
        ],
    }


def _blockers(found: dict[str, Any], level: int) -> list[str]:
    """Why ``level`` cannot be recorded now: each process that cannot support it."""
    why = []
    for row in found["storage_nodes"]:
        if row["error"] is not None:
            why.append(f"storage node {row['storage_node']} cannot be asked ({row['error']})")
        elif row["max_feature_level"] < level:
            why.append(
                f"storage node {row['storage_node']} supports feature level "
                f"{row['max_feature_level']} at most"
                + (" (a release before levels: 0.1.0)" if row["max_feature_level"] == 1 else "")
            )
    for server in found["servers"]:
        if server["max_feature_level"] < level:
            why.append(
                f"server {server['server_id']} ({server['endpoint']}) supports feature level "
                f"{server['max_feature_level']} at most"
                + (" (a release before levels: 0.1.0)" if server["max_feature_level"] == 1 else "")
            )
    return why


OLDEST_VERSION = "0.1.0"
"""What a storage node that reports no version runs (0.1.0 reports none)."""


@click.command("features")
@coordination_option
@output_option
@click.option(
    "--raise",
    "raise_level",
    is_flag=True,
    help=f"Raise the cluster's feature level to the highest this Waltz supports "
    f"({MAX_FEATURE_LEVEL}).",
)
@click.option(
    "--to",
    "to_level",
    type=int,
    default=None,
    metavar="LEVEL",
    help="Raise the cluster's feature level to LEVEL.",
)
@_reach_options
def features_command(
    uri: str, output: str, raise_level: bool, to_level: int | None, reach: Reach
) -> None:
    """Show the cluster's feature level and what each process supports; --raise or --to
    LEVEL raises it once every storage node and server supports the new level (then the
    storage nodes write that level's formats: a process of an earlier release can no
    longer read them). A level is never lowered."""
    if raise_level and to_level is not None:
        raise click.UsageError("give --raise or --to LEVEL, not both")
    target = MAX_FEATURE_LEVEL if raise_level else to_level
    if target is not None:
        check_feature_level(target, "--to")

    async def work(meta: ClusterAdmin, transport: Transport) -> dict[str, Any]:
        if target is None:
            return await _features(meta, transport, reach)

        async def check() -> None:
            # after the raise read the recorded level's version: a server registering
            # from now on changes it (ClusterAdmin.raise_feature_level)
            found = await _features(meta, transport, reach)
            recorded = found["feature_level"]
            blockers = _blockers(found, target)
            if blockers:
                raise WaltzError(
                    f"the feature level stays {recorded}, not raised to {target}: "
                    + "; ".join(blockers)
                    + "; upgrade (or start) them and run the command again"
                )

        before, _ = await meta.raise_feature_level(target, check)
        told = await _features(meta, transport, reach, tell=target)
        told["raised_from"] = before
        return told

    found = _run_with_transport(uri, reach, work)
    missed = [
        row
        for row in found["storage_nodes"]
        if target is not None and (row["error"] is not None or row["feature_level"] < target)
    ]
    emit(output, found, lambda: _text(found, target))
    if missed:
        raise WaltzError(
            f"feature level {target} is recorded, but storage node(s) "
            + ", ".join(f"{r['storage_node']} ({r['error'] or 'still below'})" for r in missed)
            + " did not take it: the servers tell each node when they connect to it; run "
            "the command again to tell them now"
        )


def _text(found: dict[str, Any], target: int | None) -> None:
    recorded = found["feature_level"]
    if target is not None:
        before = found["raised_from"]
        click.echo(
            f"feature level {recorded} recorded (was {before})"
            if before != recorded
            else f"the cluster is at feature level {recorded} already; storage nodes told again"
        )
    top = found["max_feature_level"]
    click.echo(
        f"cluster feature level: {recorded} (this Waltz, {found['version']}, supports up to {top})"
    )
    for level in found["levels"]:
        mark = "*" if level["level"] <= recorded else " "
        click.echo(
            f" {mark}level {level['level']} ({level['release']}): {'; '.join(level['enables'])}"
        )
    click.echo("storage nodes (supports up to / writes at, version):")
    for row in found["storage_nodes"]:
        if row["error"] is not None:
            click.echo(f"  {row['storage_node']}: ? ({row['error']})")
        else:
            click.echo(
                f"  {row['storage_node']}: {row['max_feature_level']} / {row['feature_level']}, "
                f"{row['version']}"
            )
    click.echo("servers (supports up to):" + ("" if found["servers"] else " (none registered)"))
    for server in found["servers"]:
        click.echo(f"  {server['server_id']} ({server['endpoint']}): {server['max_feature_level']}")
    if target is None and recorded < found["max_feature_level"]:
        blockers = _blockers(found, found["max_feature_level"])
        if blockers:
            click.echo(f"not raisable to {found['max_feature_level']} now: " + "; ".join(blockers))
        else:
            click.echo(
                f"every process supports level {found['max_feature_level']}: "
                "`waltz cluster features --raise` raises it (no way back but restoring copies)"
            )
