"""The ``waltz`` root command (the console script ``waltz``, ``python -m waltz_cli``)."""

from __future__ import annotations

import logging
import sys

import click

from waltz_cli.group import PluginCommands, quiet_client_libraries


@click.group(cls=PluginCommands)
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(package_name="waltz-cli")
def main(verbose: int) -> None:
    """Waltz: a distributed, replicated write-ahead log."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_client_libraries(verbose)
