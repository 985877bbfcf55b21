"""Admin subcommands of ``waltz storage`` (a running node, over its transport).

``waltz storage list --endpoint tcp://127.0.0.1:5500`` (or ``--config storage.toml``
to take the endpoint, transport and cluster key from the node's config), and
``add-partition``, ``remove-partition``, ``availability``, ``max-transaction-id``, ``stats``,
and ``scrub`` (a running node, or a stopped node's data directory with ``--data-dir``).
They are added to the ``waltz storage`` group by :func:`add_admin_commands`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import typing
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click

from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConfigError, PluginError, UnavailableError, WaltzError
from waltz_api.plugins import get_registry
from waltz_api.storage_client import StorageAdminClient
from waltz_api.types import LOST_SESSION
from waltz_cli.deadline import REFUSAL_PROBE, refused, run, tcp_address, timeout_option
from waltz_cli.output import emitted, output_option, tables

T = TypeVar("T")


@dataclass
class Target:
    endpoint: str
    transport: str
    transport_options: dict[str, Any]
    cluster_key: str | None
    timeout: float


def _parse_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--transport-option")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _target(
    *,
    config: Path | None,
    endpoint: str | None,
    transport: str | None,
    transport_options: tuple[str, ...],
    cluster_key: str | None,
    timeout: float,
) -> Target:
    options = _parse_options(transport_options)
    if config is not None:
        from waltz_storage_node.config import load_storage_config

        cfg = load_storage_config(config)
        return Target(
            endpoint=endpoint or cfg.transport.endpoint,
            transport=transport or cfg.transport.plugin,
            transport_options={**cfg.transport.options, **options},
            cluster_key=cluster_key or cfg.storage.cluster_key,
            timeout=timeout,
        )
    if endpoint is None:
        raise click.UsageError("give the node's --endpoint (or its --config file)")
    return Target(endpoint, transport or "zmq", options, cluster_key, timeout)


def _key(target: Target) -> uuid.UUID:
    if target.cluster_key is None:
        raise click.UsageError(
            "this command changes the storage: give --cluster-key (or the node's --config)"
        )
    try:
        return uuid.UUID(target.cluster_key)
    except ValueError:
        raise click.BadParameter(
            f"{target.cluster_key!r} is not a UUID", param_hint="--cluster-key"
        ) from None


def _run(
    target: Target, action: Callable[[StorageAdminClient], Awaitable[T]], *, bounded: bool = True
) -> T:
    """Connect to the node, run ``action``, close. Reaching the node is bounded by the
    target's timeout (a closed port is reported at once); so is the action when
    ``bounded`` (not a scrub or a snapshot, which take as long as the data)."""

    async def main() -> T:
        try:
            descriptor = get_registry().get("transport", target.transport)
        except PluginError as exc:
            raise ConfigError(f"--transport: {exc}", "transport.plugin") from None
        address = tcp_address(target.endpoint)
        if address is not None and await refused([address], min(REFUSAL_PROBE, target.timeout)):
            raise UnavailableError(
                f"the storage node at {target.endpoint} refused the connection (nothing "
                "listens there); is it running, and is the endpoint right?"
            )
        transport: Transport = descriptor.factory(target.transport_options)
        try:
            async with await StorageAdminClient.connect(
                transport, target.endpoint, timeout=target.timeout
            ) as admin:
                return await action(admin)
        finally:
            await transport.close()

    if not bounded:
        return asyncio.run(main())
    return run(main, waiting_for=f"the storage node at {target.endpoint}", timeout=target.timeout)


def _target_options(func: Callable[..., Any]) -> Callable[..., Any]:
    @click.option(
        "--config",
        "config",
        type=click.Path(dir_okay=False, path_type=Path),
        help="the node's config file (endpoint, transport and cluster key from it)",
    )
    @click.option("--endpoint", help="the node's endpoint, e.g. tcp://127.0.0.1:5500")
    @click.option("--transport", help="transport plugin (default: zmq, or the config's)")
    @click.option(
        "--transport-option", "transport_options", multiple=True, help="KEY=VALUE, repeatable"
    )
    @click.option("--cluster-key", help="the cluster key (UUID), for commands that change things")
    @timeout_option(
        "Seconds to wait for the storage node; past it the command ends with exit code 4."
    )
    @functools.wraps(func)
    def wrapper(
        *,
        config: Path | None,
        endpoint: str | None,
        transport: str | None,
        transport_options: tuple[str, ...],
        cluster_key: str | None,
        timeout: float,
        **kwargs: Any,
    ) -> Any:
        target = _target(
            config=config,
            endpoint=endpoint,
            transport=transport,
            transport_options=transport_options,
            cluster_key=cluster_key,
            timeout=timeout,
        )
        return func(target, **kwargs)

    return wrapper


@click.command("list")
@_target_options
@output_option
def list_partitions(target: Target, output: str) -> None:
    """List the node's partitions: max transaction id, session info, availability."""

    async def action(admin: StorageAdminClient) -> list[dict[str, Any]]:
        return await admin.list_partitions_raw()

    rows = _run(target, action)
    if emitted(output, rows):
        return
    click.echo(
        f"{'partition':>9} {'max txn id':>12} {'session':>8} {'low-water':>10} "
        f"{'local lwm':>10} {'lwm session':>11} {'available':>9}"
    )
    for row in rows:
        info = row["session_info"] or {}
        max_id = row["max_transaction_id"]
        low_session = info.get("low_water_mark_session_id", "?")
        notes = [f"error: {row['error']}"] if row["error"] else []
        if low_session == LOST_SESSION:
            low_session = "LOST"
            notes.append("records it acknowledged may be lost (damage): it is caught up")
        missing = row.get("missing_ranges") or []
        if missing:
            ranges = ", ".join(f"{a}..{b}" for a, b in missing)
            notes.append(f"missing {ranges} (damage; repaired from a peer)")
        click.echo(
            f"{row['partition_id']:>9} {max_id if max_id is not None else '?':>12} "
            f"{info.get('session_id', '?'):>8} {info.get('low_water_mark', '?'):>10} "
            f"{info.get('local_low_water_mark', '?'):>10} {low_session:>11} "
            f"{'yes' if row['available'] else 'no':>9}" + "".join(f"  {n}" for n in notes)
        )


@click.command("add-partition")
@_target_options
@click.argument("partition_id", type=int)
def add_partition(target: Target, partition_id: int) -> None:
    """Host a new, empty partition on the node."""
    key = _key(target)

    async def action(admin: StorageAdminClient) -> None:
        await admin.add_partition(partition_id, key)

    _run(target, action)
    click.echo(f"partition {partition_id} added")


@click.command("remove-partition")
@_target_options
@click.argument("partition_id", type=int)
@click.option("--yes", is_flag=True, help="do not ask: the partition's data is deleted")
def remove_partition(target: Target, partition_id: int, yes: bool) -> None:
    """Stop hosting a partition and DELETE its data on the node."""
    key = _key(target)
    if not yes:
        click.confirm(f"delete partition {partition_id}'s data on {target.endpoint}?", abort=True)

    async def action(admin: StorageAdminClient) -> None:
        await admin.remove_partition(partition_id, key)

    _run(target, action)
    click.echo(f"partition {partition_id} removed")


@click.command("availability")
@_target_options
@click.argument("partition_id", type=int)
@click.argument("state", type=click.Choice(["available", "unavailable"]))
def availability(target: Target, partition_id: int, state: str) -> None:
    """Mark a partition available or unavailable (refusing every storage request)."""
    key = _key(target)

    async def action(admin: StorageAdminClient) -> None:
        await admin.set_availability(partition_id, state == "available", key)

    _run(target, action)
    click.echo(f"partition {partition_id} is {state}")


@click.command("max-transaction-id")
@_target_options
@click.argument("partition_id", type=int)
@output_option
def max_transaction_id(target: Target, partition_id: int, output: str) -> None:
    """Print a partition's max transaction id on the node."""

    async def action(admin: StorageAdminClient) -> int:
        return await admin.max_transaction_id(partition_id)

    highest = _run(target, action)
    result = {"partition": partition_id, "max_transaction_id": highest}
    if not emitted(output, result):
        click.echo(str(highest))


@click.command("stats")
@_target_options
@output_option
def stats(target: Target, output: str) -> None:
    """Print the node's per-partition counters: requests, appends, merges, fenced."""

    async def action(admin: StorageAdminClient) -> dict[str, Any]:
        return await admin.command("stats")

    result = _run(target, action)
    if not emitted(output, result):
        click.echo(tables(result["partitions"]))


@click.command("scrub")
@click.option(
    "--config",
    "config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="the node's config file: the running node's endpoint, transport and rate; with "
    "--data-dir, its engine and engine options",
)
@click.option("--endpoint", help="a running node's endpoint, e.g. tcp://127.0.0.1:5500")
@click.option("--transport", help="transport plugin (default: zmq, or the config's)")
@click.option(
    "--transport-option", "transport_options", multiple=True, help="KEY=VALUE, repeatable"
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="scrub this data directory of a stopped node here, in this process",
)
@click.option("--engine", help="with --data-dir: the storage engine (default: fs, or the config's)")
@click.option("--engine-option", "engine_options", multiple=True, help="with --data-dir: KEY=VALUE")
@click.option("--partition", "partition_id", type=int, help="only this partition")
@click.option(
    "--rate",
    type=click.IntRange(min=0),
    help="most bytes read per second, 0: no bound (default: a running node's background "
    "rate; no bound with --data-dir)",
)
@timeout_option(
    "Seconds to wait for a running node to answer (the scrub itself takes as long as the "
    "data); past it the command ends with exit code 4."
)
@output_option
def scrub(
    *,
    config: Path | None,
    endpoint: str | None,
    transport: str | None,
    transport_options: tuple[str, ...],
    data_dir: Path | None,
    engine: str | None,
    engine_options: tuple[str, ...],
    partition_id: int | None,
    rate: int | None,
    timeout: float,
    output: str,
) -> None:
    """Read back and verify the sealed records now; damage found is moved aside and
    repaired from a peer (exit code 1 when damage was found)."""
    if data_dir is not None:
        if endpoint is not None:
            raise click.UsageError("give --data-dir (a stopped node) or --endpoint, not both")
        result = _scrub_directory(
            data_dir,
            config=config,
            engine=engine,
            engine_options=engine_options,
            partition_id=partition_id,
            rate=rate,
        )
    else:
        if engine is not None or engine_options:
            raise click.UsageError("--engine and --engine-option go with --data-dir")
        target = _target(
            config=config,
            endpoint=endpoint,
            transport=transport,
            transport_options=transport_options,
            cluster_key=None,
            timeout=timeout,
        )
        arguments: dict[str, Any] = {"partition_id": partition_id}
        if rate is not None:
            arguments["rate_bytes_per_second"] = rate

        async def action(admin: StorageAdminClient) -> dict[str, Any]:
            return await admin.command("scrub", timeout=None, **arguments)

        result = _run(target, action, bounded=False)
    if not emitted(output, result):
        for row in result["partitions"]:
            click.echo(_scrub_line(row))
    if any(row["damaged"] for row in result["partitions"]):
        raise SystemExit(1)


def _scrub_line(row: dict[str, Any]) -> str:
    line = f"partition {row['partition_id']}: {row['records']} records ({row['bytes']} bytes)"
    if row["damaged"]:
        ranges = ", ".join(f"{a}..{b}" for a, b in row["damaged"])
        line += f", DAMAGED {ranges}: moved aside, missing until repaired from a peer"
    elif row["complete"]:
        line += ", no damage"
    if row["error"]:
        line += f"; stopped: {row['error']}"
    return line


def _scrub_directory(
    data_dir: Path,
    *,
    config: Path | None,
    engine: str | None,
    engine_options: tuple[str, ...],
    partition_id: int | None,
    rate: int | None,
) -> dict[str, Any]:
    from waltz_api.capabilities import SCRUB
    from waltz_api.contracts.storage import StorageEngine
    from waltz_storage_node.scrub import scrub_engine

    options: dict[str, Any] = {}
    if config is not None:
        from waltz_storage_node.config import load_storage_config

        cfg = load_storage_config(config)
        engine = engine or cfg.storage.engine
        options = dict(cfg.storage.options)
    options.update(_parse_options(engine_options))
    name = engine or "fs"
    try:
        descriptor = get_registry().get("storage", name)
    except PluginError as exc:
        raise ConfigError(f"--engine: {exc}", "storage.engine") from None
    if SCRUB not in descriptor.capabilities:
        raise WaltzError(
            f"storage engine {name!r} does not scrub (no 'scrub' capability): damage is found "
            "when a record is read, or at start-up"
        )
    if not data_dir.is_dir():
        raise WaltzError(f"{data_dir} is not a directory (the stopped node's data_dir)")
    engine_class = typing.cast(type[StorageEngine], descriptor.factory)

    async def main() -> dict[str, Any]:
        started = time.monotonic()
        opened = await engine_class.open(str(data_dir), options=options)
        try:
            partitions = None if partition_id is None else [partition_id]
            results = await scrub_engine(opened, partitions, rate_bytes_per_second=rate or None)
            rows = []
            for result in results:
                row = result.as_dict()
                with contextlib.suppress(WaltzError):
                    missing = opened.partition(result.partition_id).missing_ranges()
                    row["missing_ranges"] = [list(r) for r in missing]
                rows.append(row)
        finally:
            await opened.close()
        return {"partitions": rows, "seconds": round(time.monotonic() - started, 3)}

    return asyncio.run(main())


ADMIN_COMMANDS = (
    list_partitions,
    add_partition,
    remove_partition,
    availability,
    max_transaction_id,
    stats,
    scrub,
)


def add_admin_commands(group: click.Group) -> None:
    """Add the admin subcommands to the ``waltz storage`` group."""
    for command in ADMIN_COMMANDS:
        group.add_command(command)
