"""``waltz server list`` and the preferred partition commands.

Every command reads (and, for the preferred partitions, changes) the cluster
metadata in the coordination service; none needs a server process to answer.

- ``list``: the live servers (the lowest id leads), the partitions each holds with
  their generation, and each one's preferred partitions and where they come from
  (its config, or an operator override).
- ``add-preferred-partition`` / ``remove-preferred-partition``: change the
  preferred partitions of the server at an endpoint (``--endpoint``, stable across
  restarts; or ``--server ID``, resolved to its endpoint). The change is an
  operator override, kept in coordination (it survives restarts) and replacing the
  server's config; the cluster's leader moves the partitions at once. Idempotent.
- ``reset-preferred-partitions``: drop the override (back to the server's config).
- ``list-preferred-partitions``: every endpoint with preferences, live or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from waltz_api.cluster import NO_SERVER, ClusterMetadata, ServerInfo
from waltz_api.errors import ConfigError
from waltz_cli.coordination import coordination_option
from waltz_cli.output import emitted, output_option
from waltz_server.cli.cluster import _run_with_metadata as _run
from waltz_server.server.preferred import (
    Overrides,
    PreferredPartitionStore,
    apply_overrides,
    validate_endpoint,
    validate_partitions,
)


def _target_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--endpoint",
        default=None,
        help="The server's endpoint (as `waltz server list` shows it): stable across restarts.",
    )(f)
    return click.option(
        "--server",
        "server_id",
        type=int,
        default=None,
        help="A live server's id (resolved to its endpoint; ids change when a server restarts).",
    )(f)


@dataclass(frozen=True)
class _Target:
    endpoint: str
    live: list[ServerInfo]
    """The live registrations at the endpoint (usually one; none when it is down)."""
    overrides: Overrides
    servers: list[ServerInfo]
    """Every live server (as registered)."""


async def _resolve(meta: ClusterMetadata, server_id: int | None, endpoint: str | None) -> _Target:
    if (server_id is None) == (endpoint is None):
        raise ConfigError("give exactly one of --server ID and --endpoint ENDPOINT", key="server")
    await meta.config()  # a clear error when there is no cluster
    servers = await meta.servers()
    if server_id is not None:
        match = [s for s in servers if s.server_id == server_id]
        if not match:
            raise ConfigError(
                f"no live server has id {server_id} (see `waltz server list`; ids change when "
                "a server restarts, --endpoint does not)",
                key="server",
            )
        endpoint = match[0].endpoint
    assert endpoint is not None
    endpoint = validate_endpoint(endpoint)
    overrides = (await PreferredPartitionStore(meta.coordination).read()).endpoints
    live = [s for s in servers if s.endpoint == endpoint]
    return _Target(endpoint, live, overrides, servers)


def _configured(target: _Target) -> tuple[int, ...]:
    """What the live server(s) at the endpoint registered from their config."""
    return tuple(sorted({p for s in target.live for p in s.preferred_partitions}))


def _change_preferred(
    uri: str,
    server_id: int | None,
    endpoint: str | None,
    partitions: tuple[int, ...],
    add: bool,
) -> tuple[_Target, tuple[int, ...], tuple[int, ...]]:
    async def work(meta: ClusterMetadata) -> tuple[_Target, tuple[int, ...], tuple[int, ...]]:
        config = await meta.config()
        chosen = validate_partitions(partitions, config.num_partitions)
        target = await _resolve(meta, server_id, endpoint)
        configured = _configured(target)
        before: list[tuple[int, ...]] = []

        def update(current: tuple[int, ...] | None) -> tuple[int, ...]:
            # Without an override yet, start from what the server prefers now (its config).
            base = set(configured if current is None else current)
            before[:] = [tuple(sorted(base))]
            return tuple(sorted(base | set(chosen) if add else base - set(chosen)))

        new = await PreferredPartitionStore(meta.coordination).change(target.endpoint, update)
        return target, before[-1], new or ()

    return _run(uri, work)


def add_admin_commands(group: click.Group) -> None:
    for command in (list_servers, add_preferred, remove_preferred, reset_preferred, list_preferred):
        group.add_command(command)


@click.command("list")
@coordination_option
@output_option
def list_servers(uri: str, output: str) -> None:
    """The live servers: id, endpoint, partitions held (with generation), preferred
    partitions; ``*`` marks the leader (the server the leader record names: it
    computes the assignment)."""

    async def work(meta: ClusterMetadata) -> dict[str, Any]:
        config = await meta.config()
        servers = await meta.servers()
        overrides = (await PreferredPartitionStore(meta.coordination).read()).endpoints
        assignments = await meta.partition_assignments()
        record = await meta.leader()
        leader = NO_SERVER if record is None else record.value.server_id
        effective = apply_overrides(servers, overrides)
        live = {s.server_id for s in servers}
        rows = []
        for server, eff in zip(servers, effective, strict=True):
            rows.append(
                {
                    "server_id": server.server_id,
                    "endpoint": server.endpoint,
                    "leader": server.server_id == leader,
                    "partitions": [
                        {"partition": a.partition_id, "generation": a.generation}
                        for a in assignments
                        if a.server_id == server.server_id
                    ],
                    "preferred_partitions": list(eff.preferred_partitions),
                    "preferred_source": "override" if server.endpoint in overrides else "config",
                }
            )
        return {
            "partitions": config.num_partitions,
            "servers": rows,
            "not_held": [
                {"partition": a.partition_id, "server_id": a.server_id, "generation": a.generation}
                for a in assignments
                if a.server_id not in live
            ],
        }

    summary = _run(uri, work)
    if emitted(output, summary):
        return
    if not summary["servers"]:
        click.echo("no live servers")
    else:
        click.echo("server  endpoint                        partitions (generation)  preferred")
    for row in summary["servers"]:
        held = ", ".join(f"{p['partition']} (g{p['generation']})" for p in row["partitions"])
        preferred = ", ".join(str(p) for p in row["preferred_partitions"]) or "-"
        if row["preferred_source"] == "override":
            preferred += " [override]"
        lead = "*" if row["leader"] else " "
        click.echo(
            f"{row['server_id']:>5}{lead}  {row['endpoint']:<30}  {held or '-':<23}  {preferred}"
        )
    if summary["not_held"]:
        parts = ", ".join(str(p["partition"]) for p in summary["not_held"])
        click.echo(f"not held by a live server (moving or no server up): {parts}")
    if summary["servers"]:
        click.echo("* leads the cluster")


@click.command("add-preferred-partition")
@coordination_option
@_target_options
@click.option(
    "--partition",
    "partitions",
    type=click.IntRange(min=0),
    multiple=True,
    required=True,
    help="A partition id; repeat for several.",
)
def add_preferred(
    uri: str, server_id: int | None, endpoint: str | None, partitions: tuple[int, ...]
) -> None:
    """Make the server at an endpoint prefer partitions: the leader moves them to it
    (kept in coordination: survives restarts; replaces the server's config)."""
    target, before, after = _change_preferred(uri, server_id, endpoint, partitions, add=True)
    _report(target, before, after, partitions)


@click.command("remove-preferred-partition")
@coordination_option
@_target_options
@click.option(
    "--partition",
    "partitions",
    type=click.IntRange(min=0),
    multiple=True,
    required=True,
    help="A partition id; repeat for several.",
)
def remove_preferred(
    uri: str, server_id: int | None, endpoint: str | None, partitions: tuple[int, ...]
) -> None:
    """Stop the server at an endpoint preferring partitions (they are balanced again)."""
    target, before, after = _change_preferred(uri, server_id, endpoint, partitions, add=False)
    _report(target, before, after, partitions)


def _report(
    target: _Target, before: tuple[int, ...], after: tuple[int, ...], asked: tuple[int, ...]
) -> None:
    shown = ", ".join(str(p) for p in after) or "none"
    verb = "unchanged" if before == after else "now"
    click.echo(f"preferred partitions of {target.endpoint}: {shown} ({verb})")
    if not target.live:
        click.echo("no live server at this endpoint: it applies when one registers there")
    # Elsewhere: in other endpoints' overrides, or in the config of live servers there.
    preferring = dict(target.overrides)
    for server in apply_overrides(target.servers, target.overrides):
        preferring.setdefault(server.endpoint, server.preferred_partitions)
    others = sorted(
        e for e, parts in preferring.items() if e != target.endpoint and set(asked) & set(parts)
    )
    if others:
        click.echo(
            f"note: also preferred at {', '.join(others)}; the live server with the lowest id "
            "gets a partition preferred by several"
        )


@click.command("reset-preferred-partitions")
@coordination_option
@_target_options
def reset_preferred(uri: str, server_id: int | None, endpoint: str | None) -> None:
    """Drop the override of the server at an endpoint: its config's preferences apply again."""

    async def work(meta: ClusterMetadata) -> tuple[_Target, bool]:
        target = await _resolve(meta, server_id, endpoint)
        had = target.endpoint in target.overrides
        await PreferredPartitionStore(meta.coordination).change(target.endpoint, lambda _: None)
        return target, had

    target, had = _run(uri, work)
    configured = ", ".join(str(p) for p in _configured(target)) or "none"
    if had:
        click.echo(f"{target.endpoint}: override dropped; preferred partitions from its config")
    else:
        click.echo(f"{target.endpoint}: had no override (unchanged)")
    if target.live:
        click.echo(f"its config prefers: {configured}")


@click.command("list-preferred-partitions")
@coordination_option
@output_option
def list_preferred(uri: str, output: str) -> None:
    """Every endpoint with preferred partitions (live servers and overrides for servers
    that are down): from config, the override, and what applies."""

    async def work(meta: ClusterMetadata) -> list[dict[str, Any]]:
        await meta.config()
        servers = await meta.servers()
        overrides = (await PreferredPartitionStore(meta.coordination).read()).endpoints
        endpoints = sorted({s.endpoint for s in servers} | set(overrides))
        rows = []
        for endpoint in endpoints:
            live = [s for s in servers if s.endpoint == endpoint]
            configured = sorted({p for s in live for p in s.preferred_partitions})
            override = overrides.get(endpoint)
            if override is None and not configured:
                continue
            rows.append(
                {
                    "endpoint": endpoint,
                    "server_ids": [s.server_id for s in live],
                    "config": configured,
                    "override": None if override is None else list(override),
                    "effective": list(override) if override is not None else configured,
                }
            )
        return rows

    rows = _run(uri, work)
    if emitted(output, {"preferred": rows}):
        return
    if not rows:
        click.echo("no server prefers any partition")
        return
    click.echo("endpoint                        servers  config     override   applies")
    for row in rows:

        def show(parts: list[int] | None) -> str:
            return "-" if parts is None else (",".join(str(p) for p in parts) or "none")

        ids = ",".join(str(i) for i in row["server_ids"]) or "down"
        click.echo(
            f"{row['endpoint']:<30}  {ids:<7}  {show(row['config']):<9}  "
            f"{show(row['override']):<9}  {show(row['effective'])}"
        )
