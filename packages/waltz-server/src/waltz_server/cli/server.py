"""``waltz server``: run a server (``--config``), and inspect or steer the live servers.

``waltz server --config server.toml`` runs a server until SIGINT/SIGTERM (as
``waltz storage --config`` runs a storage node). With a subcommand instead,
``waltz server`` talks to the coordination service: ``list`` the live servers
and what they hold, and ``add-preferred-partition`` / ``remove-preferred-partition``
/ ``reset-preferred-partitions`` / ``list-preferred-partitions`` (see
:mod:`waltz_server.cli.server_admin`).
"""

from __future__ import annotations

import click


@click.group("server", invoke_without_command=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="The server's TOML config file (every key overridable by WALTZ_* variables): "
    "run a server.",
)
@click.pass_context
def server_command(ctx: click.Context, config_path: str | None) -> None:
    """Run a Waltz server (with --config), or list the servers and set their preferred
    partitions (with a subcommand)."""
    if ctx.invoked_subcommand is not None:
        if config_path is not None:
            raise click.UsageError("--config runs a server; give it no subcommand")
        return
    if config_path is None:
        raise click.UsageError(
            "give --config FILE to run a server, or a subcommand (list, "
            "add-preferred-partition, ...)"
        )
    from waltz_server.server.main import run_from_config

    run_from_config(config_path)


from waltz_server.cli.server_admin import add_admin_commands  # noqa: E402

add_admin_commands(server_command)
