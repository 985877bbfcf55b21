"""``waltz simulate``, contributed to the command line through the ``waltz_cli_commands``
hook (entry point ``waltz_sim_commands``). The command (:mod:`waltz_sim.cli`) and the simulation
are imported when it is chosen.

(The ``sim`` transport, coordination and storage plugins are in :mod:`waltz_sim.plugin`,
registered by a run itself, never through an entry point.)"""

from __future__ import annotations

from typing import TYPE_CHECKING

from waltz_api.hookspecs import CommandDescriptor, hookimpl

if TYPE_CHECKING:
    import click


def load_simulate() -> click.Command:
    from waltz_sim.cli import simulate

    return simulate


@hookimpl
def waltz_cli_commands() -> list[CommandDescriptor]:
    return [
        CommandDescriptor(
            "simulate",
            load_simulate,
            "Deterministic simulation of the whole cluster on virtual time.",
        )
    ]
