"""Registers the embedded coordination plugin (``local``, URIs ``local:///path``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waltz_api.contracts.coordination import Coordination
from waltz_api.hookspecs import PluginDescriptor, PluginKind, hookimpl


def create_coordination(connect: str, options: Mapping[str, Any] | None = None) -> Coordination:
    """The plugin factory: ``connect`` is ``local:///path/to/dir`` (or a file, or a plain
    path); options: root, session_timeout, poll_interval, busy_timeout."""
    from waltz_coord_local.coordination import LocalCoordination

    return LocalCoordination(connect, options or {})


@hookimpl
def waltz_coordinators() -> list[PluginDescriptor]:
    return [
        PluginDescriptor(
            kind=PluginKind.COORDINATION,
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
