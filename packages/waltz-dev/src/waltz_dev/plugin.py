"""What waltz-dev adds to the command line (entry point ``waltz_dev``): ``waltz dev``.

Light on purpose: the command's module is imported when it is chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING

from waltz_api.hookspecs import CommandDescriptor, hookimpl

if TYPE_CHECKING:
    import click


def load_dev() -> click.Command:
    from waltz_dev.command import dev_command

    return dev_command


@hookimpl
def waltz_cli_commands() -> list[CommandDescriptor]:
    return [
        CommandDescriptor(
            "dev",
            load_dev,
            "Run a development cluster until Ctrl-C: local coordination, ZeroMQ on "
            "loopback, fs storage in DATA_DIR, 3 storage nodes and 1+ servers as child "
            "processes.",
        ),
    ]
