"""``waltz server --config server.toml``: run a Waltz server until SIGINT/SIGTERM."""

from __future__ import annotations

import click


@click.command("server")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    required=True,
    help="The server's TOML config file (every key overridable by WALTZ_* variables).",
)
def server_command(config_path: str) -> None:
    """Run a Waltz server: serve the partitions the cluster assigns to it."""
    from waltz_server.server.main import run_from_config

    run_from_config(config_path)
