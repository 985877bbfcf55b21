"""``waltz storage``: run a storage node (``--config``), and the offline storage tools.

``waltz storage --config storage.toml`` runs the node until SIGINT/SIGTERM.
``verify``, ``dump-segment`` and ``dump-control-file`` read a storage
directory of the ``fs`` engine without changing it (stop the node first, or
work on a copy).
"""

from __future__ import annotations

import click

from waltz_api.errors import WaltzError


@click.group("storage", invoke_without_command=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="The storage node's TOML config file (every key overridable by WALTZ_* variables).",
)
@click.pass_context
def storage_group(ctx: click.Context, config_path: str | None) -> None:
    """Run a storage node (with --config), or inspect a storage directory offline."""
    if ctx.invoked_subcommand is not None:
        if config_path is not None:
            raise click.UsageError("--config runs the storage node; give it no subcommand")
        return
    try:
        from waltz_server.storage_node.main import run_from_config
    except ImportError as exc:
        raise WaltzError(
            f"the storage node is not available in this installation ({exc}); "
            "install waltz-server completely"
        ) from exc
    run_from_config(config_path)


@storage_group.command("verify")
@click.argument("directory", type=click.Path(file_okay=False))
def verify_command(directory: str) -> None:
    """Check every record, index entry and control struct of a storage DIRECTORY.

    Exits 1 when a problem is found (each is printed)."""
    from waltz_storage_fs import tools

    report = tools.verify(directory)
    for line in tools.format_verify(report):
        click.echo(line)
    if not report.ok:
        raise SystemExit(1)


@storage_group.command("dump-segment")
@click.argument("segment", type=click.Path(dir_okay=False))
@click.option("--data", "show_data", is_flag=True, help="Also print each record's data (hex).")
@click.option("--limit", type=int, default=None, help="Print at most this many records.")
def dump_segment_command(segment: str, show_data: bool, limit: int | None) -> None:
    """Print a segment data file (.seg): its header and every valid record.

    Exits 1 when the file has no valid segment header (not a segment file)."""
    from waltz_storage_fs import tools

    header = False
    for line in tools.format_segment(segment, show_data=show_data, limit=limit):
        header = header or line.startswith("header: ")
        click.echo(line)
    if not header:
        raise WaltzError(
            f"{segment}: not a Waltz segment file (its header is short or fails its checksum)"
        )


@storage_group.command("dump-control-file")
@click.argument("path", type=click.Path())
def dump_control_file_command(path: str) -> None:
    """Print a control file (PATH: the storage directory or its waltz-storage.ctl)."""
    from waltz_storage_fs import tools

    for line in tools.format_control_file(tools.read_control_file(path)):
        click.echo(line)


# The admin subcommands of a running node (list, add-partition, remove-partition,
# availability, max-transaction-id) live with the storage node.
from waltz_server.storage_node.cli import add_admin_commands  # noqa: E402

add_admin_commands(storage_group)

# snapshot (of a running node), verify-snapshot, restore
from waltz_server.cli.snapshot import SNAPSHOT_COMMANDS  # noqa: E402

for _command in SNAPSHOT_COMMANDS:
    storage_group.add_command(_command)
