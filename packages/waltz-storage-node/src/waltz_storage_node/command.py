"""``waltz storage``: run a storage node (``--config``), its admin commands and snapshots.

``waltz storage --config storage.toml`` runs the node until SIGINT/SIGTERM. The
offline tools of a storage engine (the fs engine's ``verify``, ``dump-segment`` and
``dump-control-file``) are contributed to this group by the engine's package, through
the ``waltz_cli_commands`` hook.
"""

from __future__ import annotations

import click

from waltz_api.errors import WaltzError


@click.group("storage", invoke_without_command=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="The storage node's TOML config file (every key overridable by WALTZ_* variables).",
)
@click.pass_context
def storage_group(ctx: click.Context, config_path: str | None) -> None:
    """Run a storage node (with --config), or inspect a storage directory offline."""
    if ctx.invoked_subcommand is not None:
        if config_path is not None:
            raise click.UsageError("--config runs the storage node; give it no subcommand")
        return
    try:
        from waltz_storage_node.main import run_from_config
    except ImportError as exc:
        raise WaltzError(
            f"the storage node is not available in this installation ({exc}); "
            "install waltz-server completely"
        ) from exc
    run_from_config(config_path)


# The admin subcommands of a running node (list, add-partition, remove-partition,
# availability, max-transaction-id) live with the storage node.
from waltz_storage_node.cli import add_admin_commands  # noqa: E402

add_admin_commands(storage_group)

# snapshot (of a running node), verify-snapshot, restore
from waltz_storage_node.snapshot_commands import SNAPSHOT_COMMANDS  # noqa: E402

for _command in SNAPSHOT_COMMANDS:
    storage_group.add_command(_command)
