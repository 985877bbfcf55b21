"""The pluggy hook specifications of Waltz (project name and entry-point group ``waltz``).

A plugin is a module (or object) with ``@hookimpl`` functions named like the
specs below, registered through the ``waltz`` entry-point group::

    [project.entry-points.waltz]
    my_storage = "waltz_storage_s3.plugin"

Each hook returns a list of descriptors; a plugin may implement any subset of the
hooks. Built-in components register exactly this way.

A descriptor is read without importing the implementation: the plugin module stays
light (this module, :mod:`waltz_api.capabilities`, nothing else at import time) and
hands over a ``load`` function that imports the implementation when the component is
chosen. Every process reads every installed plugin's descriptors (``waltz --help``, a
client starting); only the chosen ones pay for their imports. The typed descriptors
(:class:`StorageEngineDescriptor`, :class:`CoordinationDescriptor`,
:class:`TransportDescriptor`, :class:`LockTableDescriptor`) let mypy check a plugin's
factory against the contract::

    def _engine() -> type[StorageEngine]:
        from waltz_storage_s3.engine import S3StorageEngine  # imported when chosen

        return S3StorageEngine

    @hookimpl
    def waltz_storage_engines() -> list[StorageEngineDescriptor]:
        return [StorageEngineDescriptor(name="s3", load=_engine)]
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, Unpack

import pluggy

from waltz_api.capabilities import check as check_capabilities
from waltz_api.errors import PluginError

if TYPE_CHECKING:
    import click

    from waltz_api.contracts.coordination import Coordination
    from waltz_api.contracts.locktable import LockTable
    from waltz_api.contracts.storage import StorageEngine
    from waltz_api.contracts.transport import Transport

PROJECT_NAME = "waltz"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class PluginKind(enum.StrEnum):
    STORAGE = "storage"
    COORDINATION = "coordination"
    TRANSPORT = "transport"
    LOCK_TABLE = "lock_table"


# -- the factories each kind of component offers ------------------------------------------


class CoordinationFactory(Protocol):
    """``factory(connect, options) -> Coordination``; ``connect`` is the service's URI
    or connect string (``zk://127.0.0.1:2181/waltz``)."""

    def __call__(self, connect: str, options: Mapping[str, Any], /) -> Coordination: ...


class TransportFactory(Protocol):
    """``factory(options) -> Transport``."""

    def __call__(self, options: Mapping[str, Any], /) -> Transport: ...


class LockTableFactory(Protocol):
    """``factory(high_water_mark, options) -> LockTable``."""

    def __call__(self, high_water_mark: int, options: Mapping[str, Any], /) -> LockTable: ...


class DescriptorDetails(TypedDict, total=False):
    """The optional fields of a typed descriptor (see :class:`PluginDescriptor`)."""

    capabilities: Iterable[str]
    description: str
    uri_schemes: tuple[str, ...]
    conformance_harness: str | None


class PluginDescriptor:
    """What a plugin offers for one kind of component.

    - ``name``: chosen in config (``coordination = "zk"``).
    - ``factory``: for storage, the StorageEngine subclass (``await factory.open(...)``);
      for the others, a callable taking an options mapping and returning the component.
      Give either ``factory`` itself or ``load``, a function returning it that imports
      the implementation: it runs the first time ``descriptor.factory`` is read (a
      failure there is a :class:`~waltz_api.errors.PluginError` naming the plugin).
    - ``capabilities``: optional features the implementation supports (names from
      :mod:`waltz_api.capabilities`; an unknown one is a PluginError); the conformance
      suite skips (visibly) the tests of features not declared.
    - ``uri_schemes``: URI schemes that select this plugin (``zk`` for ``zk://...``).
    - ``conformance_harness``: ``"module:attribute"`` of the harness that runs
      the shared suite against this implementation, if it ships one.

    Immutable once built. The typed subclasses below fix ``kind`` and the factory's
    type (what a plugin author should use: mypy then checks the factory).
    """

    __slots__ = (
        "_factory",
        "_load",
        "_lock",
        "capabilities",
        "conformance_harness",
        "description",
        "kind",
        "name",
        "uri_schemes",
    )

    kind: PluginKind
    name: str
    capabilities: frozenset[str]
    description: str
    uri_schemes: tuple[str, ...]
    conformance_harness: str | None
    _factory: Any
    _load: Callable[[], Any] | None
    _lock: threading.Lock

    def __init__(
        self,
        kind: PluginKind,
        name: str,
        factory: Any = None,
        *,
        capabilities: Iterable[str] = frozenset(),
        description: str = "",
        uri_schemes: tuple[str, ...] = (),
        conformance_harness: str | None = None,
        load: Callable[[], Any] | None = None,
    ) -> None:
        kind = PluginKind(kind)
        if not name:
            raise PluginError(f"a {kind} plugin descriptor needs a name")
        if (factory is None) == (load is None):
            raise PluginError(
                f"the {kind} plugin {name!r}: give its factory or a load function "
                "returning it, exactly one of them"
            )
        where = f"declared by the {kind} plugin {name!r}"
        init = super().__setattr__
        init("kind", kind)
        init("name", name)
        init("capabilities", check_capabilities(capabilities, kind, where))
        init("description", description)
        init("uri_schemes", tuple(uri_schemes))
        init("conformance_harness", conformance_harness)
        init("_factory", factory)
        init("_load", load)
        init("_lock", threading.Lock())

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a plugin descriptor is immutable (setting {name!r})")

    @property
    def factory(self) -> Any:
        """The factory; the first read imports the implementation (``load``)."""
        if self._factory is not None:
            return self._factory
        with self._lock:
            if self._factory is None:
                assert self._load is not None
                try:
                    loaded = self._load()
                except Exception as exc:
                    raise PluginError(
                        f"the {self.kind} plugin {self.name!r} failed to load its "
                        f"implementation ({self.origin}): {type(exc).__name__}: {exc}; "
                        "install what it needs, or choose another plugin"
                    ) from exc
                super().__setattr__("_factory", loaded)
            return self._factory

    @property
    def loaded(self) -> bool:
        """Whether the implementation was imported (``factory`` read, or given)."""
        return self._factory is not None

    @property
    def origin(self) -> str:
        """``module.name`` of the factory, or of the load function while it is not loaded
        (where the plugin comes from, told without importing it)."""
        target: Any = self._factory if self._factory is not None else self._load
        return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', target)}"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kind={self.kind.value!r}, name={self.name!r}, "
            f"origin={self.origin!r}, capabilities={sorted(self.capabilities)!r})"
        )


class StorageEngineDescriptor(PluginDescriptor):
    """A storage engine: its factory is the StorageEngine subclass."""

    __slots__ = ()

    def __init__(
        self,
        name: str,
        factory: type[StorageEngine] | None = None,
        *,
        load: Callable[[], type[StorageEngine]] | None = None,
        **details: Unpack[DescriptorDetails],
    ) -> None:
        super().__init__(PluginKind.STORAGE, name, factory, load=load, **details)

    @property
    def factory(self) -> type[StorageEngine]:
        engine: type[StorageEngine] = super().factory
        return engine


class CoordinationDescriptor(PluginDescriptor):
    """A coordination service client: ``factory(connect, options) -> Coordination``."""

    __slots__ = ()

    def __init__(
        self,
        name: str,
        factory: CoordinationFactory | None = None,
        *,
        load: Callable[[], CoordinationFactory] | None = None,
        **details: Unpack[DescriptorDetails],
    ) -> None:
        super().__init__(PluginKind.COORDINATION, name, factory, load=load, **details)

    @property
    def factory(self) -> CoordinationFactory:
        factory: CoordinationFactory = super().factory
        return factory


class TransportDescriptor(PluginDescriptor):
    """A transport: ``factory(options) -> Transport``."""

    __slots__ = ()

    def __init__(
        self,
        name: str,
        factory: TransportFactory | None = None,
        *,
        load: Callable[[], TransportFactory] | None = None,
        **details: Unpack[DescriptorDetails],
    ) -> None:
        super().__init__(PluginKind.TRANSPORT, name, factory, load=load, **details)

    @property
    def factory(self) -> TransportFactory:
        factory: TransportFactory = super().factory
        return factory


class LockTableDescriptor(PluginDescriptor):
    """A lock table: ``factory(high_water_mark, options) -> LockTable``."""

    __slots__ = ()

    def __init__(
        self,
        name: str,
        factory: LockTableFactory | None = None,
        *,
        load: Callable[[], LockTableFactory] | None = None,
        **details: Unpack[DescriptorDetails],
    ) -> None:
        super().__init__(PluginKind.LOCK_TABLE, name, factory, load=load, **details)

    @property
    def factory(self) -> LockTableFactory:
        factory: LockTableFactory = super().factory
        return factory


# -- what a plugin adds to the command line and to the documented options -------------------


@dataclass(frozen=True)
class CommandDescriptor:
    """A command a plugin adds to the ``waltz`` command line (hook ``waltz_cli_commands``).

    - ``name``: the command's name (``verify``).
    - ``load``: returns the click command (or group); it runs when the command is
      chosen (or its help read), so the command's module and what it imports cost
      nothing to a ``waltz`` run that does not use it.
    - ``short_help``: the line ``waltz --help`` shows (the command is not loaded for it).
    - ``group``: where it goes: ``""`` at the top (``waltz NAME``), or the name of a
      top-level group another plugin contributes (``"storage"``: ``waltz storage NAME``);
      such a command is loaded with its group.
    """

    name: str
    load: Callable[[], click.Command]
    short_help: str
    group: str = ""

    def __post_init__(self) -> None:
        if not self.name or " " in self.name or " " in self.group:
            raise PluginError(
                f"command {self.name!r} (group {self.group!r}): a command and its group "
                "are single words"
            )

    @property
    def path(self) -> str:
        """``storage verify``: the words after ``waltz``."""
        return f"{self.group} {self.name}" if self.group else self.name

    @property
    def origin(self) -> str:
        """``module.name`` of the load function (where the command comes from)."""
        load: Any = self.load
        return f"{getattr(load, '__module__', '?')}.{getattr(load, '__qualname__', load)}"


@dataclass(frozen=True)
class OptionSpec:
    """One documented option or config key: ``key`` (dotted for nested sections), its
    type as written in the docs, its default, its meaning and whether it is required."""

    key: str
    type: str
    default: Any
    meaning: str
    required: bool = False


@dataclass(frozen=True)
class OptionSchema:
    """A table of options a plugin documents (hook ``waltz_option_schemas``): a process's
    config file (``server-config``), the client's constructor (``client-config``), or a
    component's options (``zmq-options``, the mapping its factory takes).

    - ``name``: the table's name; ``docs/operators.md`` holds it between
      ``<!-- generated: NAME ... -->`` markers (``python -m waltz_server.docs_gen``).
    - ``load``: returns the options (it may import the implementation, for its defaults).
    - ``environment``: every key is also read from a ``WALTZ_SECTION__KEY`` variable (a
      process's config file), shown as a column of the table.
    """

    name: str
    load: Callable[[], Sequence[OptionSpec]]
    environment: bool = False


class WaltzHookSpecs:
    """The hooks. Each of the first four returns the descriptors of one kind of
    component; the last two what a plugin adds to the command line and the docs."""

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

    @hookspec
    def waltz_cli_commands(self) -> Sequence[CommandDescriptor]:  # type: ignore[empty-body]
        """Commands of the ``waltz`` command line, each loaded when it is chosen. Two
        plugins offering the same command path are reported; the first (by plugin name)
        is kept."""

    @hookspec
    def waltz_option_schemas(self) -> Sequence[OptionSchema]:  # type: ignore[empty-body]
        """Documented option tables (config files, the client, each component's options);
        ``python -m waltz_server.docs_gen`` writes them into ``docs/operators.md``."""


HOOK_FOR_KIND: dict[PluginKind, str] = {
    PluginKind.STORAGE: "waltz_storage_engines",
    PluginKind.COORDINATION: "waltz_coordinators",
    PluginKind.TRANSPORT: "waltz_transports",
    PluginKind.LOCK_TABLE: "waltz_lock_tables",
}
