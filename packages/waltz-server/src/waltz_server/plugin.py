"""What waltz-server adds to the command line and the docs (entry point ``waltz_server``):
the commands ``waltz cluster``, ``server``, ``storage`` and ``dev``, and the option
tables of the server's and the storage node's config files.

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


def load_storage() -> click.Command:
    from waltz_server.cli.storage import storage_group

    return storage_group


def load_archive() -> click.Command:
    from waltz_server.cli.archive import archive_group

    return archive_group


def load_acl() -> click.Command:
    from waltz_server.cli.acl import acl_group

    return acl_group


def load_dev() -> click.Command:
    from waltz_server.cli.dev import dev_command

    return dev_command


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
            "storage",
            load_storage,
            "Run a storage node (with --config), or inspect a storage directory offline.",
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
        CommandDescriptor(
            "dev",
            load_dev,
            "Run a development cluster until Ctrl-C: local coordination, ZeroMQ on "
            "loopback, fs storage in DATA_DIR, 3 storage nodes and 1+ servers as child "
            "processes.",
        ),
    ]


def server_options() -> Sequence[OptionSpec]:
    from waltz_api.config import option_specs
    from waltz_server.server.config import ServerNodeConfig

    return option_specs(ServerNodeConfig)


def storage_options() -> Sequence[OptionSpec]:
    from waltz_api.config import option_specs
    from waltz_server.storage_node.config import StorageNodeConfig

    return option_specs(StorageNodeConfig)


@hookimpl
def waltz_option_schemas() -> list[OptionSchema]:
    return [
        OptionSchema("server-config", server_options, environment=True),
        OptionSchema("storage-config", storage_options, environment=True),
    ]
