"""``waltz storage snapshot``, ``verify-snapshot`` and ``restore`` (see
:mod:`waltz_storage_node.snapshot`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import click

from waltz_api.storage_client import StorageAdminClient
from waltz_storage_node.cli import Target, _run, _target_options


def _summary(manifest: dict[str, Any]) -> str:
    parts = manifest["partitions"]
    records = sum(int(p["records"]) for p in parts.values())
    return f"{len(parts)} partition(s), {records} record(s), cluster {manifest['cluster_key']}"


@click.command("snapshot")
@_target_options
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--engine", default="fs", show_default=True, help="storage engine of the copy (a plugin)"
)
def snapshot_command(target: Target, out: Path, engine: str) -> None:
    """Copy a RUNNING node's partitions into the new directory OUT (consistent per
    partition, verifiable; the node keeps serving)."""
    from waltz_storage_node.snapshot import take_snapshot

    async def action(admin: StorageAdminClient) -> dict[str, Any]:
        return await take_snapshot(admin.client, out, engine=engine)

    manifest = _run(target, action, bounded=False)  # as long as the data takes
    click.echo(f"snapshot {out}: {_summary(manifest)}")


@click.command("verify-snapshot")
@click.argument("snapshot", type=click.Path(file_okay=False, exists=True, path_type=Path))
def verify_snapshot_command(snapshot: Path) -> None:
    """Read every record of SNAPSHOT back and check it against its manifest (exit 1 when
    damaged)."""
    from waltz_storage_node.snapshot import verify_snapshot

    manifest = asyncio.run(verify_snapshot(snapshot))
    click.echo(f"snapshot {snapshot} is intact: {_summary(manifest)}")


@click.command("restore")
@click.argument("snapshot", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="the (absent or empty) data directory to restore into",
)
@click.option(
    "--config",
    "config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="the node's config file: restore into its storage.data_dir",
)
@click.option(
    "--keep-marks",
    is_flag=True,
    help="leave the partitions' marks as copied (only when EVERY storage node of the "
    "cluster is restored from its snapshot): by default each restored partition is "
    "marked restored, so it rejoins as a suspect replica and is caught up before it votes",
)
def restore_command(
    snapshot: Path, data_dir: Path | None, config: Path | None, keep_marks: bool
) -> None:
    """Verify SNAPSHOT and copy it into a STOPPED node's empty data directory; start the
    node on it afterwards (the servers catch its partitions up). Each partition is marked
    restored: what the node acknowledged after the snapshot is gone from the copy, so it
    does not vote in a recovery before it holds the committed log again."""
    from waltz_storage_node.snapshot import SnapshotError, read_manifest, restore_snapshot

    if (data_dir is None) == (config is None):
        raise click.UsageError("give --data-dir or --config (one of them)")
    if config is not None:
        from waltz_storage_node.config import load_storage_config

        loaded = load_storage_config(config)
        data_dir = Path(loaded.storage.data_dir)
        manifest = read_manifest(snapshot)
        if loaded.storage.cluster_key and loaded.storage.cluster_key != manifest["cluster_key"]:
            raise SnapshotError(
                f"the snapshot is of cluster {manifest['cluster_key']}, the config's "
                f"storage.cluster_key is {loaded.storage.cluster_key}"
            )
    assert data_dir is not None
    manifest = asyncio.run(restore_snapshot(snapshot, data_dir, keep_marks=keep_marks))
    click.echo(f"restored {snapshot} into {data_dir}: {_summary(manifest)}")


SNAPSHOT_COMMANDS = (snapshot_command, verify_snapshot_command, restore_command)
