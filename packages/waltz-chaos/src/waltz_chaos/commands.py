"""``waltz chaos``, contributed to the command line through the ``waltz_cli_commands``
hook (entry point ``waltz_chaos_commands``). The command (:mod:`waltz_chaos.cli`) and
the run are imported when it is chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING

from waltz_api.hookspecs import CommandDescriptor, hookimpl

if TYPE_CHECKING:
    import click


def load_chaos() -> click.Command:
    from waltz_chaos.cli import chaos

    return chaos


@hookimpl
def waltz_cli_commands() -> list[CommandDescriptor]:
    return [
        CommandDescriptor(
            "chaos",
            load_chaos,
            "A Jepsen-style fault run on a real cluster, checked by the simulation's checker.",
        )
    ]
