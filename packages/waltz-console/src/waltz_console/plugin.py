"""``waltz console``, contributed to the command line through the ``waltz_cli_commands``
hook (entry point ``waltz_console``). The command (:mod:`waltz_console.cli`) is imported
when it is chosen, the console's own imports (aiohttp...) when it runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from waltz_api.hookspecs import CommandDescriptor, hookimpl

if TYPE_CHECKING:
    import click


def load_console() -> click.Command:
    from waltz_console.cli import console_command

    return console_command


@hookimpl
def waltz_cli_commands() -> list[CommandDescriptor]:
    return [
        CommandDescriptor(
            "console",
            load_console,
            "Serve the web console of the cluster at URI: live servers, storage nodes, "
            "partitions, clients, events and transactions; actions after logging in.",
        )
    ]
