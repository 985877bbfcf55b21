"""What waltz-storage-node adds to the command line and the docs (entry point
``waltz_storage_node``): the command ``waltz storage`` and the option table of the
storage node's config file.

Light on purpose: a command's module is imported when it is chosen."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from waltz_api.hookspecs import CommandDescriptor, OptionSchema, OptionSpec, hookimpl

if TYPE_CHECKING:
    import click


def load_storage() -> click.Command:
    from waltz_storage_node.command import storage_group

    return storage_group


@hookimpl
def waltz_cli_commands() -> list[CommandDescriptor]:
    return [
        CommandDescriptor(
            "storage",
            load_storage,
            "Run a storage node (with --config), or inspect a storage directory offline.",
        ),
    ]


def storage_options() -> Sequence[OptionSpec]:
    from waltz_api.config import option_specs
    from waltz_storage_node.config import StorageNodeConfig

    return option_specs(StorageNodeConfig)


@hookimpl
def waltz_option_schemas() -> list[OptionSchema]:
    return [OptionSchema("storage-config", storage_options, environment=True)]
