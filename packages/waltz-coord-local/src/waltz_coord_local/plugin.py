"""Registers the embedded coordination plugin (``local``, URIs ``local:///path``).

Light on purpose: the implementation is imported only when the plugin is chosen."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from waltz_api.hookspecs import CoordinationDescriptor, hookimpl

if TYPE_CHECKING:
    from waltz_api.contracts.coordination import Coordination


def create_coordination(connect: str, options: Mapping[str, Any] | None = None) -> Coordination:
    """The plugin factory: ``connect`` is ``local:///path/to/dir`` (or a file, or a plain
    path); options: root, session_timeout, poll_interval, busy_timeout."""
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
