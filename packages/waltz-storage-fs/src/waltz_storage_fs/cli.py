"""The fs engine's offline tools in the ``waltz storage`` group (``verify``,
``dump-segment``, ``dump-control-file``): they read a storage directory of the ``fs``
engine without changing it (stop the node first, or work on a copy). Contributed
through the ``waltz_cli_commands`` hook (:mod:`waltz_storage_fs.plugin`)."""

from __future__ import annotations

import click

from waltz_api.errors import WaltzError


@click.command("verify")
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


@click.command("dump-segment")
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


@click.command("dump-control-file")
@click.argument("path", type=click.Path())
def dump_control_file_command(path: str) -> None:
    """Print a control file (PATH: the storage directory or its waltz-storage.ctl)."""
    from waltz_storage_fs import tools

    for line in tools.format_control_file(tools.read_control_file(path)):
        click.echo(line)
