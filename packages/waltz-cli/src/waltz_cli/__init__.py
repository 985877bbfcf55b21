"""The ``waltz`` command line: one entry point, each command contributed by a plugin.

The commands come from the installed packages through the ``waltz_cli_commands``
hook (see :mod:`waltz_cli.group`); this package holds the root, the options every
command shares (:mod:`waltz_cli.output`, :mod:`waltz_cli.coordination`) and
``waltz plugins list``.
"""

from __future__ import annotations

import logging
import sys

import click

from waltz_cli.group import PluginCommands, WaltzGroup, load_all, quiet_client_libraries

__all__ = ["PluginCommands", "WaltzGroup", "load_all", "main"]


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
