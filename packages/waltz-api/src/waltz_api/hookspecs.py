"""The pluggy hook specifications of Waltz (project name and entry-point group ``waltz``).

A plugin is a module (or object) with ``@hookimpl`` functions named like the
specs below, registered through the ``waltz`` entry-point group::

    [project.entry-points.waltz]
    my_storage = "waltz_storage_s3.plugin"

Each hook returns a list of :class:`PluginDescriptor`; a plugin may implement
any subset of the hooks. Built-in components register exactly this way.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from waltz_api import capabilities

PROJECT_NAME = "waltz"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class PluginKind(enum.StrEnum):
    STORAGE = "storage"
    COORDINATION = "coordination"
    TRANSPORT = "transport"
    LOCK_TABLE = "lock_table"


@dataclass(frozen=True)
class PluginDescriptor:
    """What a plugin offers for one kind of component.

    - ``name``: chosen in config (``coordination = "zk"``).
    - ``factory``: for storage, the StorageEngine subclass (``await factory.open(...)``);
      for the others, a callable taking an options mapping and returning the component.
    - ``capabilities``: optional features the implementation supports (names from
      :mod:`waltz_api.capabilities`; an unknown one is a PluginError); the conformance
      suite skips (visibly) the tests of features not declared.
    - ``uri_schemes``: URI schemes that select this plugin (``zk`` for ``zk://...``).
    - ``conformance_harness``: ``"module:attribute"`` of the harness that runs
      the shared suite against this implementation, if it ships one.
    """

    kind: PluginKind
    name: str
    factory: Callable[..., Any]
    capabilities: frozenset[str] = field(default_factory=frozenset)
    description: str = ""
    uri_schemes: tuple[str, ...] = ()
    conformance_harness: str | None = None

    def __post_init__(self) -> None:
        where = f"declared by the {self.kind} plugin {self.name!r}"
        object.__setattr__(
            self, "capabilities", capabilities.check(self.capabilities, self.kind, where)
        )


class WaltzHookSpecs:
    """The hooks. Each returns the descriptors of one kind of component."""

    @hookspec
    def waltz_storage_engines(self) -> Sequence[PluginDescriptor]:  # type: ignore[empty-body]
        """Storage engines: each ``factory`` is a :class:`~waltz_api.contracts.StorageEngine`
        subclass, opened with ``await factory.open(location, ...)``."""

    @hookspec
    def waltz_coordinators(self) -> Sequence[PluginDescriptor]:  # type: ignore[empty-body]
        """Coordination services: ``factory(connect: str, options: Mapping) -> Coordination``;
        ``connect`` is the URI or connect string of the service."""

    @hookspec
    def waltz_transports(self) -> Sequence[PluginDescriptor]:  # type: ignore[empty-body]
        """Transports: ``factory(options: Mapping) -> Transport``."""

    @hookspec
    def waltz_lock_tables(self) -> Sequence[PluginDescriptor]:  # type: ignore[empty-body]
        """Lock tables: ``factory(high_water_mark: int, options: Mapping) -> LockTable``."""


HOOK_FOR_KIND: dict[PluginKind, str] = {
    PluginKind.STORAGE: "waltz_storage_engines",
    PluginKind.COORDINATION: "waltz_coordinators",
    PluginKind.TRANSPORT: "waltz_transports",
    PluginKind.LOCK_TABLE: "waltz_lock_tables",
}
