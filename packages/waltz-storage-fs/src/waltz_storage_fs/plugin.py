"""Registers the file-segment storage engine as the storage plugin ``fs``, its offline
tools as ``waltz storage verify|dump-segment|dump-control-file``, and its options.

Light on purpose: the engine is imported only when ``fs`` is chosen, a tool when it
is run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from waltz_api.capabilities import (
    AVAILABILITY,
    CRASH_REOPEN,
    FILE_FAULTS,
    PREFIX,
    REOPEN,
    REPAIR,
    SCRUB,
    SEGMENTS,
)
from waltz_api.hookspecs import (
    CommandDescriptor,
    OptionSchema,
    OptionSpec,
    StorageEngineDescriptor,
    hookimpl,
)

if TYPE_CHECKING:
    import click

    from waltz_api.contracts.storage import StorageEngine

CAPABILITIES = frozenset(
    {REOPEN, CRASH_REOPEN, FILE_FAULTS, SEGMENTS, REPAIR, AVAILABILITY, PREFIX, SCRUB}
)


def load_engine() -> type[StorageEngine]:
    from waltz_storage_fs.engine import FsStorageEngine

    return FsStorageEngine


@hookimpl
def waltz_storage_engines() -> list[StorageEngineDescriptor]:
    return [
        StorageEngineDescriptor(
            name="fs",
            load=load_engine,
            capabilities=CAPABILITIES,
            description="segment files in a local storage directory, fdatasync'd group commit",
            uri_schemes=("file",),
            conformance_harness="waltz_storage_fs.conformance:harness",
        )
    ]


def load_verify() -> click.Command:
    from waltz_storage_fs.cli import verify_command

    return verify_command


def load_dump_segment() -> click.Command:
    from waltz_storage_fs.cli import dump_segment_command

    return dump_segment_command


def load_dump_control_file() -> click.Command:
    from waltz_storage_fs.cli import dump_control_file_command

    return dump_control_file_command


@hookimpl
def waltz_cli_commands() -> list[CommandDescriptor]:
    return [
        CommandDescriptor(
            "verify",
            load_verify,
            "Check every record, index entry and control struct of a storage DIRECTORY.",
            group="storage",
        ),
        CommandDescriptor(
            "dump-segment",
            load_dump_segment,
            "Print a segment data file (.seg): its header and every valid record.",
            group="storage",
        ),
        CommandDescriptor(
            "dump-control-file",
            load_dump_control_file,
            "Print a control file (PATH: the storage directory or its waltz-storage.ctl).",
            group="storage",
        ),
    ]


OPTION_MEANINGS = {
    "segment_size": "bytes; a new segment file starts once the current one reaches it",
    "index_checkpoint_interval": "records between flushes of the index file",
    "read_threads": "threads reading segments for range reads",
    "verify_on_open": "1: start-up recovery checks every record, not only those after each "
    "index's last flushed checkpoint (damage anywhere becomes a hole repaired from a peer)",
    "journal_size": "bytes (a multiple of 512) of the node journal, created at feature level 3 "
    "(preallocated; an existing journal keeps its size)",
    "checkpoint_bytes": "bytes of journal between checkpoints (the segment files flushed, "
    "the journal freed behind them)",
}
"""The meaning of each option of ``[storage.options]`` (``FsOptions``)."""


def options() -> Sequence[OptionSpec]:
    """``FsOptions``: every field, its default and its meaning."""
    import dataclasses

    from waltz_api.config import same_keys, type_name
    from waltz_storage_fs.options import FsOptions

    fields = {f.name: f for f in dataclasses.fields(FsOptions)}
    same_keys("fs storage", fields, OPTION_MEANINGS)
    return [
        OptionSpec(name, type_name(f.type), f.default, OPTION_MEANINGS[name])
        for name, f in fields.items()
    ]


@hookimpl
def waltz_option_schemas() -> list[OptionSchema]:
    return [OptionSchema("fs-options", options)]
