"""The command line's own command, registered like every other (entry point
``waltz_cli``): ``waltz plugins``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from waltz_api.hookspecs import CommandDescriptor, hookimpl

if TYPE_CHECKING:
    import click


def load_plugins() -> click.Command:
    from waltz_cli.plugins import plugins_group

    return plugins_group


@hookimpl
def waltz_cli_commands() -> list[CommandDescriptor]:
    return [
        CommandDescriptor(
            "plugins",
            load_plugins,
            "Installed plugins (storage engines, coordination, transports, lock tables).",
        )
    ]
