"""Registers the embedded coordination plugin (``local``, URIs ``local:///path``) and its
options.

Light on purpose: the implementation is imported only when the plugin is chosen."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from waltz_api.hookspecs import CoordinationDescriptor, OptionSchema, OptionSpec, hookimpl

if TYPE_CHECKING:
    from waltz_api.contracts.coordination import Coordination


def create_coordination(connect: str, options: Mapping[str, Any] | None = None) -> Coordination:
    """The plugin factory: ``connect`` is ``local:///path/to/dir`` (or a file, or a plain
    path); options: root, session_timeout, poll_interval, busy_timeout, create."""
    from waltz_coord_local.coordination import LocalCoordination

    return LocalCoordination(connect, options or {})


@hookimpl
def waltz_coordinators() -> list[CoordinationDescriptor]:
    return [
        CoordinationDescriptor(
            name="local",
            factory=create_coordination,
            capabilities=frozenset({"cross_process"}),
            description=(
                "embedded, for one machine: a SQLite file (WAL) shared by its processes "
                "(local:///path/to/dir)"
            ),
            uri_schemes=("local",),
            conformance_harness="waltz_coord_local.conformance:harness",
        )
    ]


def options() -> Sequence[OptionSpec]:
    """The options of a ``local`` client (also the URI's query), with their defaults."""
    from waltz_coord_local import coordination as local

    return [
        OptionSpec(
            "root",
            "str",
            "/",
            "path prefix of every entry (also the URI's `?root=`; the option wins)",
        ),
        OptionSpec(
            "session_timeout",
            "float",
            local.DEFAULT_SESSION_TIMEOUT,
            "seconds; a process that stops renewing loses its session and ephemeral entries",
        ),
        OptionSpec(
            "poll_interval",
            "float",
            local.DEFAULT_POLL_INTERVAL,
            "seconds between polls of the SQLite file for watches",
        ),
        OptionSpec(
            "busy_timeout",
            "float",
            local.DEFAULT_BUSY_TIMEOUT,
            "seconds to wait for the SQLite write lock",
        ),
        OptionSpec(
            "create",
            "bool",
            True,
            "make the directory and the database when missing (false: refuse a location "
            "that does not exist; the `waltz` commands that join a cluster do)",
        ),
    ]


@hookimpl
def waltz_option_schemas() -> list[OptionSchema]:
    return [OptionSchema("local-options", options)]
