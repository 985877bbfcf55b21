"""What waltz-server adds to the command line and the docs (entry point ``waltz_server``):
the commands ``waltz cluster``, ``server``, ``acl`` and ``archive``, and the
option table of the server's config file (the storage node's are waltz-storage-node's).

Light on purpose: a command's module is imported when it is chosen."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from waltz_api.hookspecs import CommandDescriptor, OptionSchema, OptionSpec, hookimpl

if TYPE_CHECKING:
    import click


def load_cluster() -> click.Command:
    from waltz_server.cli.cluster import cluster_group
    from waltz_server.cli.features import features_command

    cluster_group.add_command(features_command)
    return cluster_group


def load_server() -> click.Command:
    from waltz_server.cli.server import server_command

    return server_command


def load_archive() -> click.Command:
    from waltz_server.cli.archive import archive_group

    return archive_group


def load_acl() -> click.Command:
    from waltz_server.cli.acl import acl_group

    return acl_group


@hookimpl
def waltz_cli_commands() -> list[CommandDescriptor]:
    return [
        CommandDescriptor(
            "cluster", load_cluster, "Cluster metadata: create it once, then inspect it."
        ),
        CommandDescriptor(
            "server",
            load_server,
            "Run a Waltz server (with --config), or list the servers and set their "
            "preferred partitions (with a subcommand).",
        ),
        CommandDescriptor(
            "acl",
            load_acl,
            "Per-partition permissions (read, write, admin) of client keys, enforced by "
            "every server once enabled.",
        ),
        CommandDescriptor(
            "archive",
            load_archive,
            "The archive: old records as Parquet in object storage (docs/archive.md).",
        ),
    ]


def server_options() -> Sequence[OptionSpec]:
    from waltz_api.config import option_specs
    from waltz_server.server.config import ServerNodeConfig

    return option_specs(ServerNodeConfig)


@hookimpl
def waltz_option_schemas() -> list[OptionSchema]:
    return [
        OptionSchema("server-config", server_options, environment=True),
    ]
