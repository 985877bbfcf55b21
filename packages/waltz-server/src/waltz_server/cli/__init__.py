"""The ``waltz`` command line: one entry point, one subcommand group per area.

Each area lives in its own module and is added below with ``main.add_command``.
Errors: a WaltzError ends the command with one clear line on stderr and exit
code 1; a usage error (unknown option, missing argument, bad value) is one line
too, naming the ``--help`` to read, with exit code 2 as click gives it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from waltz_api.errors import WaltzError


def _usage_error(exc: click.UsageError) -> click.exceptions.Exit:
    """Print a usage error as one line (click prints usage, a hint and the error)."""
    where = exc.ctx.command_path if exc.ctx is not None else "waltz"
    click.echo(f"error: {exc.format_message()} (see '{where} --help')", err=True)
    return click.exceptions.Exit(exc.exit_code)


class WaltzGroup(click.Group):
    """A click group that turns a WaltzError into one line and exit code 1, and a
    usage error anywhere below it into one line and exit code 2."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _usage_error(exc) from exc

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except WaltzError as exc:
            click.echo(f"error: {exc}", err=True)
            ctx.exit(1)
        except click.UsageError as exc:
            raise _usage_error(exc) from exc


@click.group(cls=WaltzGroup)
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="waltz-server")
def main(verbose: int) -> None:
    """Waltz: a distributed, replicated write-ahead log."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from waltz_server.cli.coordination import quiet_client_libraries

    quiet_client_libraries(verbose)


# Subcommand groups register here, one line each.
from waltz_server.cli.plugins import plugins_group  # noqa: E402

main.add_command(plugins_group)
from waltz_server.cli.cluster import cluster_group  # noqa: E402

main.add_command(cluster_group)
from waltz_server.cli.storage import storage_group  # noqa: E402

main.add_command(storage_group)
from waltz_server.cli.keys import keys_group  # noqa: E402

main.add_command(keys_group)
from waltz_server.cli.server import server_command  # noqa: E402

main.add_command(server_command)
from waltz_server.cli.dev import dev_command  # noqa: E402

main.add_command(dev_command)
from waltz_server.cli.client import client_group  # noqa: E402

main.add_command(client_group)
from waltz_server.cli.spark import spark_group  # noqa: E402

main.add_command(spark_group)
from waltz_server.cli.perf import perf_group  # noqa: E402

main.add_command(perf_group)
from waltz_server.cli.console import console_command  # noqa: E402

main.add_command(console_command())
from waltz_server.cli.simulate import simulate_command  # noqa: E402

main.add_command(simulate_command)
