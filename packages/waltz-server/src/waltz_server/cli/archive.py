"""``waltz archive``: the archive of a cluster (tiered storage, docs/archive.md)::

    waltz archive status --coordination URI          mark, ranges and bytes per partition
    waltz archive verify --coordination URI          every archived object read back, checked
    waltz archive restore --coordination URI --url URL           a new cluster, from the archive
    waltz archive restore --coordination URI --storage-node H:P  a wiped storage node

The archive's location is the one each partition's mark records, unless ``--url`` (and
``--storage-options``, a JSON object of fsspec options) says otherwise.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import click

from waltz_api.cluster import ArchiveMark, ClusterMetadata, Stored
from waltz_api.contracts.coordination import Coordination
from waltz_api.errors import ArchiveError, ConfigError, UnavailableError, WaltzError
from waltz_cli.coordination import coordination_option, start_coordination
from waltz_cli.deadline import REFUSAL_PROBE, command_timeout, refused, run, tcp_address
from waltz_cli.output import emitted, output_option
from waltz_server.cluster_admin import ClusterAdmin

T = TypeVar("T")

_URL = click.option("--url", default="", help="Archive URL (default: the one each mark records).")
_OPTIONS = click.option(
    "--storage-options",
    default="",
    help='fsspec options of the archive as a JSON object, e.g. {"endpoint_url": "..."}.',
)
_PARTITIONS = click.option(
    "--partitions", default="", help="Comma-separated partitions (default: all)."
)


@click.group("archive")
def archive_group() -> None:
    """The archive: old records as Parquet in object storage (docs/archive.md)."""


def _run(uri: str, action: Callable[[Coordination], Awaitable[T]], *, bounded: bool = True) -> T:
    """``action`` on the coordination service at ``uri``: reaching it is bounded by
    --timeout; so is the action when ``bounded`` (not one that reads the archive's
    objects, which takes as long as they are big)."""

    async def main() -> T:
        coordination = await start_coordination(uri)
        try:
            return await action(coordination)
        finally:
            await coordination.close()

    if not bounded:
        return asyncio.run(main())
    return run(main, waiting_for=f"the coordination service at {uri}")


async def _partitions(metadata: ClusterMetadata, raw: str) -> list[int]:
    count = (await metadata.config()).num_partitions
    if not raw.strip():
        return list(range(count))
    try:
        chosen = sorted({int(p) for p in raw.split(",") if p.strip()})
    except ValueError:
        raise ConfigError(
            f"--partitions is a comma-separated list of integers, not {raw!r}"
        ) from None
    unknown = [p for p in chosen if not 0 <= p < count]
    if unknown:
        raise ConfigError(f"partitions {unknown} do not exist (0..{count - 1})")
    return chosen


def _store(url: str, options: str, mark: ArchiveMark | None = None) -> Any:
    from waltz_archive.store import ArchiveStore, parse_storage_options

    chosen = url or (mark.url if mark is not None else "")
    if not chosen:
        raise ConfigError("no archive URL: this partition never archived, and --url was not given")
    return ArchiveStore(chosen, parse_storage_options(options))


@archive_group.command("status")
@_PARTITIONS
@_URL
@_OPTIONS
@output_option
@coordination_option
def status_command(
    *, uri: str, partitions: str, url: str, storage_options: str, output: str
) -> None:
    """Each partition's archive mark: the last archived id, ranges, bytes and manifest."""

    async def action(coordination: Coordination) -> list[dict[str, Any]]:
        metadata = ClusterMetadata(coordination)
        rows = []
        for partition_id in await _partitions(metadata, partitions):
            mark = (await metadata.archive_mark(partition_id)).value
            rows.append(
                {
                    "partition": partition_id,
                    "mark": mark.mark,
                    "ranges": mark.ranges,
                    "bytes": mark.archived_bytes,
                    "manifest": mark.manifest,
                    "url": url or mark.url,
                }
            )
        return rows

    rows = _run(uri, action)
    if emitted(output, rows):
        return
    for row in rows:
        if row["mark"] < 0:
            click.echo(f"partition {row['partition']}: nothing archived")
        else:
            click.echo(
                f"partition {row['partition']}: archived 0..{row['mark']} in {row['ranges']} "
                f"range(s), {row['bytes']} bytes, at {row['url']} ({row['manifest']})"
            )


@archive_group.command("verify")
@_PARTITIONS
@_URL
@_OPTIONS
@click.option("--footers-only", is_flag=True, help="Check each object's footer, not its rows.")
@output_option
@coordination_option
def verify_command(
    *, uri: str, partitions: str, url: str, storage_options: str, footers_only: bool, output: str
) -> None:
    """Read back every archived object of each partition and check it: its footer, ids,
    every record's checksum and the range's digest. Exit code 1 on any problem, each
    named by partition, range and object."""
    from waltz_archive.tools import load_manifest, orphans, verify_manifest

    async def action(coordination: Coordination) -> list[dict[str, Any]]:
        metadata = ClusterMetadata(coordination)
        rows = []
        for partition_id in await _partitions(metadata, partitions):
            mark = (await metadata.archive_mark(partition_id)).value
            row: dict[str, Any] = {"partition": partition_id, "mark": mark.mark}
            if mark.mark < 0:
                rows.append({**row, "ranges": 0, "records": 0, "problems": [], "orphans": []})
                continue
            store = _store(url, storage_options, mark)

            def check(store: Any = store, mark: ArchiveMark = mark) -> dict[str, Any]:
                try:
                    manifest = load_manifest(store, mark.partition_id, mark.manifest)
                except ArchiveError as exc:
                    return {"ranges": 0, "records": 0, "problems": [str(exc)], "orphans": []}
                result = verify_manifest(store, manifest, full=not footers_only)
                problems = list(result.problems)
                if manifest.mark != mark.mark:
                    problems.append(
                        f"partition {mark.partition_id}: manifest {mark.manifest} ends at "
                        f"{manifest.mark}, the archive mark is {mark.mark}"
                    )
                return {
                    "ranges": result.ranges,
                    "records": result.records,
                    "problems": problems,
                    "orphans": orphans(store, manifest),
                }

            rows.append({**row, **await asyncio.to_thread(check)})
        return rows

    rows = _run(uri, action, bounded=False)  # every object is read: as long as they take
    bad = [p for row in rows for p in row["problems"]]
    if not emitted(output, rows):
        for row in rows:
            state = "ok" if not row["problems"] else f"{len(row['problems'])} problem(s)"
            click.echo(
                f"partition {row['partition']}: mark {row['mark']}, {row['ranges']} range(s), "
                f"{row['records']} records verified: {state}"
                + (f"; {len(row['orphans'])} unused object(s)" if row["orphans"] else "")
            )
            for problem in row["problems"]:
                click.echo(f"  {problem}")
    if bad:
        raise WaltzError(f"the archive has {len(bad)} problem(s): {bad[0]}")


@archive_group.command("restore")
@_PARTITIONS
@_URL
@_OPTIONS
@click.option(
    "--storage-node",
    default="",
    help="A storage node (host:port) that lost its disk: its partitions start at the marks.",
)
@click.option("--transport", default="zmq", show_default=True, help="Transport to the node.")
@click.option(
    "--endpoint-template",
    default="tcp://{}",
    show_default=True,
    help="The node's endpoint from its host:port ({} is replaced).",
)
@output_option
@coordination_option
def restore_command(
    *,
    uri: str,
    partitions: str,
    url: str,
    storage_options: str,
    storage_node: str,
    transport: str,
    endpoint_template: str,
    output: str,
) -> None:
    """Restore from the archive. Without --storage-node: a whole new cluster (created
    with `waltz cluster create`, no partition written yet) gets, per partition, the
    archive mark of the manifest in --url with the highest mark whose ranges verify, and
    a new archive incarnation; every range object and manifest above that mark (the lost
    cluster's history past it) is moved under set-aside/; its servers (configured with
    that archive) open each partition there. With
    --storage-node: that node's partitions start at the cluster's archive marks (the
    rest is caught up from the other replicas by the next store session)."""
    if storage_node:
        rows = _run(
            uri,
            lambda c: _restore_node(c, partitions, storage_node, transport, endpoint_template),
        )
    else:
        if not url:
            raise click.UsageError("restoring a cluster needs --url (the archive to restore)")
        rows = _run(
            uri, lambda c: _restore_cluster(c, partitions, url, storage_options), bounded=False
        )
    if not emitted(output, rows):
        for row in rows:
            click.echo(json.dumps(row) if row.get("skipped") else _describe(row))


def _describe(row: dict[str, Any]) -> str:
    where = f" on {row['storage_node']}" if "storage_node" in row else ""
    text = f"partition {row['partition']}{where}: starts at the archive mark {row['mark']}"
    if "incarnation" in row:
        text += f", incarnation {row['incarnation']}"
    set_aside = row.get("set_aside") or []
    if set_aside:
        text += f"; {len(set_aside)} object(s) above it set aside: {', '.join(set_aside)}"
    return text


async def _restore_cluster(
    coordination: Coordination, partitions: str, url: str, options: str
) -> list[dict[str, Any]]:
    """Per partition: the best manifest's mark, a new incarnation, and everything above
    the mark set aside (set aside first: a restore interrupted after it runs again, and
    keeps the incarnation it wrote). The incarnation makes every object of the lost
    cluster, even one it uploads after this, another incarnation's: never adopted."""
    from waltz_archive.tools import best_manifest, set_aside_above

    admin = ClusterAdmin(coordination)
    store = _store(url, options)
    incarnation = uuid.uuid4().hex
    rows = []
    for partition_id in await _partitions(admin, partitions):
        current = await admin.archive_mark(partition_id)
        store_meta = await admin.store_metadata(partition_id)
        if store_meta.value.session_id >= 0 or current.value.mark >= 0:
            raise WaltzError(
                f"partition {partition_id} already has a log (store sessions or an archive "
                "mark): restore into a new cluster only"
            )
        chosen = current.value.incarnation or incarnation  # kept by a restore run again
        found = await asyncio.to_thread(best_manifest, store, partition_id)
        mark = found[0].mark if found is not None else -1
        set_aside = await asyncio.to_thread(set_aside_above, store, partition_id, mark)
        if found is None:
            if current.version < 0:
                await admin.advance_archive_mark(
                    current, ArchiveMark(partition_id, -1, url=store.url, incarnation=chosen)
                )
            rows.append(
                {
                    "partition": partition_id,
                    "mark": -1,
                    "skipped": "nothing archived",
                    "incarnation": chosen,
                    "set_aside": set_aside,
                }
            )
            continue
        manifest, name, passed_over = found
        for reason in passed_over:
            click.echo(f"partition {partition_id}: passed over {reason}", err=True)
        new = ArchiveMark(
            partition_id,
            manifest.mark,
            name,
            len(manifest.ranges),
            manifest.total_bytes,
            store.url,
            chosen,
        )
        await admin.advance_archive_mark(current, new)
        rows.append(
            {
                "partition": partition_id,
                "mark": manifest.mark,
                "manifest": name,
                "incarnation": chosen,
                "set_aside": set_aside,
            }
        )
    return rows


async def _restore_node(
    coordination: Coordination,
    partitions: str,
    storage_node: str,
    transport_name: str,
    template: str,
) -> list[dict[str, Any]]:
    from waltz_api.plugins import get_registry
    from waltz_api.storage_client import StorageAdminClient

    metadata = ClusterMetadata(coordination)
    config = await metadata.config()
    assignments = await metadata.replica_assignments()
    chosen = set(await _partitions(metadata, partitions))
    owned = [p for p in assignments.partitions_of(storage_node) if p in chosen]
    if not owned:
        raise WaltzError(f"storage node {storage_node} holds none of the chosen partitions")
    marks: dict[int, Stored[ArchiveMark]] = {p: await metadata.archive_mark(p) for p in owned}
    endpoint = template.format(storage_node)
    address = tcp_address(endpoint)
    if address is not None and await refused([address], min(REFUSAL_PROBE, command_timeout())):
        raise UnavailableError(
            f"storage node {storage_node} ({endpoint}) refused the connection (nothing "
            "listens there); is it running?"
        )
    transport = get_registry().get("transport", transport_name).factory({})
    rows = []
    try:
        async with await StorageAdminClient.connect(
            transport, endpoint, timeout=command_timeout()
        ) as admin:
            hosted = {row["partition_id"]: row for row in await admin.list_partitions_raw()}
            for partition_id in owned:
                mark = marks[partition_id].value.mark
                if mark < 0:
                    rows.append({"partition": partition_id, "mark": -1, "skipped": "no archive"})
                    continue
                if partition_id not in hosted:
                    await admin.add_partition(partition_id, config.cluster_key)
                session = (hosted.get(partition_id, {}).get("session_info") or {}).get(
                    "session_id", 0
                )
                start = await admin.prune(partition_id, mark, max(session, 0), config.cluster_key)
                rows.append(
                    {
                        "partition": partition_id,
                        "storage_node": storage_node,
                        "mark": mark,
                        "log_start": start,
                    }
                )
    finally:
        await transport.close()
    return rows
