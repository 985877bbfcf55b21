"""``waltz simulate``: the deterministic simulation (needs the waltz-sim package).

The command itself lives in ``waltz_sim.cli``; this forwards to it, importing it
only when the command runs, so ``waltz`` starts without it.
"""

from __future__ import annotations

import click


@click.command(
    "simulate",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def simulate_command(args: tuple[str, ...]) -> None:
    """Deterministic simulation of the whole cluster (seeded faults, virtual time)."""
    try:
        from waltz_sim.cli import simulate
    except ImportError as exc:
        raise click.ClickException(
            f"{exc}: install the simulation first (pip install -e packages/waltz-sim)"
        ) from exc
    simulate.main(list(args), prog_name="waltz simulate", standalone_mode=False)
