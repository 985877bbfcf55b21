"""The plugin manager: finds, loads and indexes Waltz plugins.

Built lazily on first use (never at import time). Plugins come from the
``waltz`` entry-point group; set ``WALTZ_DISABLE_PLUGIN_AUTOLOAD=1`` to load
none automatically (then register them with :meth:`PluginRegistry.register`).
A plugin that fails to import is skipped and logged; the rest still load.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pluggy

from waltz_api.errors import DuplicatePluginError, PluginError, UnknownPluginError
from waltz_api.hookspecs import (
    HOOK_FOR_KIND,
    PROJECT_NAME,
    CommandDescriptor,
    OptionSchema,
    PluginDescriptor,
    PluginKind,
    WaltzHookSpecs,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
HOOKS = sorted(name for name in vars(WaltzHookSpecs) if name.startswith("waltz_"))
"""Every hook a plugin may implement."""

_Index = dict[PluginKind, dict[str, list[tuple[str, PluginDescriptor]]]]
"""kind -> name -> [(plugin name, descriptor)], more than one when a name is duplicated."""

ENTRY_POINT_GROUP = PROJECT_NAME
DISABLE_AUTOLOAD_ENV = "WALTZ_DISABLE_PLUGIN_AUTOLOAD"


class PluginRegistry:
    """The loaded plugins and the descriptors they offer, by kind and name."""

    def __init__(self, *, autoload: bool | None = None) -> None:
        self.manager = pluggy.PluginManager(PROJECT_NAME)
        self.manager.add_hookspecs(WaltzHookSpecs)
        self.load_errors: dict[str, BaseException] = {}
        """Plugins skipped because they failed to import, register or answer a hook."""
        self._commands: list[CommandDescriptor] | None = None
        self._schemas: list[OptionSchema] | None = None
        self._distributions: dict[str, tuple[str, str]] = {}
        """(distribution, version) of each plugin loaded from an entry point."""
        self._index: _Index | None = None
        if autoload is None:
            autoload = os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in (
                "1",
                "true",
                "yes",
            )
        if autoload:
            self._load_entry_points()
        self.manager.check_pending()

    def _load_entry_points(self) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if self.manager.get_plugin(ep.name) is not None:
                # The same distribution seen twice on sys.path lists its entry points twice.
                log.debug("Waltz plugin %r (%s) is already registered", ep.name, ep.value)
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must not take the others down
                self._skip(ep.name, ep.value, "it failed to import", exc)
                continue
            try:
                self._register_checked(plugin, ep.name)
            except PluginError as exc:
                self._skip(ep.name, ep.value, "it is not a valid Waltz plugin", exc)
                continue
            if ep.dist is not None:
                self._distributions[ep.name] = (ep.dist.name, ep.dist.version)

    def _skip(self, name: str, where: str, why: str, exc: BaseException) -> None:
        self.load_errors[name] = exc
        log.warning(
            "skipping Waltz plugin %r (%s): %s: %s: %s", name, where, why, type(exc).__name__, exc
        )

    def _register_checked(self, plugin: Any, name: str | None) -> None:
        """Register ``plugin``; on any validation failure leave it unregistered."""
        try:
            registered = self.manager.register(plugin, name=name)
        except (ValueError, pluggy.PluginValidationError) as exc:
            raise PluginError(f"plugin {name or plugin!r} cannot be registered: {exc}") from exc
        try:
            self.manager.check_pending()
        except pluggy.PluginValidationError as exc:
            self.manager.unregister(plugin, name=registered)
            known = ", ".join(HOOKS)
            raise PluginError(
                f"plugin {name or plugin!r} implements an unknown hook ({exc}); "
                f"the Waltz hooks are: {known}"
            ) from exc
        self._index = None
        self._commands = None
        self._schemas = None

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Register a plugin module or object explicitly (tests, embedding).

        Raises PluginError when ``plugin`` (or its name) is already registered
        or implements a hook Waltz does not define."""
        self._register_checked(plugin, name)

    def _build_index(self) -> _Index:
        if self._index is None:
            index: _Index = {kind: defaultdict(list) for kind in PluginKind}
            for kind, hook_name in HOOK_FOR_KIND.items():
                hook = getattr(self.manager.hook, hook_name)
                # One implementation at a time: a plugin whose hook raises (say, a
                # lazy import inside it fails) is skipped, the others still count.
                for impl in reversed(hook.get_hookimpls()):
                    for descriptor in self._descriptors_of(impl, kind, hook_name):
                        index[kind][descriptor.name].append((impl.plugin_name, descriptor))
            for kind, by_name in index.items():
                for name, found in by_name.items():
                    if len(found) > 1:
                        log.error(
                            "duplicate %s plugin name %r, offered by %s",
                            kind.value,
                            name,
                            ", ".join(_origin(plugin, d) for plugin, d in found),
                        )
            self._index = index
        return self._index

    def _descriptors_of(
        self, impl: Any, kind: PluginKind, hook_name: str
    ) -> list[PluginDescriptor]:
        where = f"{hook_name} of {impl.plugin_name!r}"
        try:
            result = impl.function()
        except Exception as exc:
            self._skip(impl.plugin_name, hook_name, f"its hook {hook_name} raised", exc)
            return []
        if result is None:
            return []
        try:
            descriptors = list(result)
        except TypeError:
            descriptors = [result]
        for descriptor in descriptors:
            if not isinstance(descriptor, PluginDescriptor) or descriptor.kind is not kind:
                error = PluginError(
                    f"{where} returned {descriptor!r}; it must return a list of "
                    f"PluginDescriptor(kind=PluginKind.{kind.name}, ...)"
                )
                self._skip(impl.plugin_name, hook_name, "its hook returned a bad value", error)
                return []
        return descriptors

    def _contributions(self, hook_name: str, kind: type[T], key: Callable[[T], str]) -> list[T]:
        """What every plugin returns from ``hook_name`` (plugins in name order), each
        checked to be a ``kind``; a plugin whose hook raises or returns anything else is
        skipped and logged, and of two contributions with one ``key`` the first is kept
        (the other reported)."""
        hook = getattr(self.manager.hook, hook_name)
        kept: dict[str, tuple[str, T]] = {}
        for impl in sorted(hook.get_hookimpls(), key=lambda impl: impl.plugin_name):
            try:
                result = list(impl.function() or [])
            except Exception as exc:
                self._skip(impl.plugin_name, hook_name, f"its hook {hook_name} raised", exc)
                continue
            wrong = [item for item in result if not isinstance(item, kind)]
            if wrong:
                error = PluginError(
                    f"{hook_name} of {impl.plugin_name!r} returned {wrong[0]!r}; it must "
                    f"return a list of {kind.__name__}"
                )
                self._skip(impl.plugin_name, hook_name, "its hook returned a bad value", error)
                continue
            for item in result:
                name = key(item)
                if name in kept:
                    log.error(
                        "%s %r is offered by plugins %r and %r; %r is ignored",
                        kind.__name__,
                        name,
                        kept[name][0],
                        impl.plugin_name,
                        impl.plugin_name,
                    )
                    continue
                kept[name] = (impl.plugin_name, item)
        return [item for _plugin, item in kept.values()]

    def commands(self) -> list[CommandDescriptor]:
        """The ``waltz`` commands every plugin contributes (none is loaded)."""
        if self._commands is None:
            self._commands = self._contributions(
                "waltz_cli_commands", CommandDescriptor, lambda c: c.path
            )
        return self._commands

    def option_schemas(self) -> list[OptionSchema]:
        """The documented option tables every plugin contributes (none is loaded)."""
        if self._schemas is None:
            self._schemas = self._contributions(
                "waltz_option_schemas", OptionSchema, lambda s: s.name
            )
        return self._schemas

    def names(self, kind: PluginKind | str) -> list[str]:
        """The names of the plugins of ``kind``, sorted."""
        return sorted(self._build_index()[_kind(kind)])

    def descriptors(self, kind: PluginKind | str) -> list[PluginDescriptor]:
        """Every descriptor of ``kind`` (the first of any duplicated name)."""
        by_name = self._build_index()[_kind(kind)]
        return [by_name[name][0][1] for name in sorted(by_name)]

    def get(self, kind: PluginKind | str, name: str) -> PluginDescriptor:
        """The plugin of ``kind`` named ``name`` (or selected by URI scheme).

        Raises UnknownPluginError listing the valid names, or
        DuplicatePluginError when two plugins claim the name."""
        kind = _kind(kind)
        by_name = self._build_index()[kind]
        found = by_name.get(name)
        what = "plugin name"
        if not found:
            found = [
                entry
                for entries in by_name.values()
                for entry in entries
                if name in entry[1].uri_schemes
            ]
            what = "URI scheme"
        if not found:
            valid = ", ".join(sorted(by_name)) or "(none installed)"
            schemes = sorted({s for entries in by_name.values() for s in entries[0][1].uri_schemes})
            hint = f"; URI schemes: {', '.join(schemes)}" if schemes else ""
            if name in self.load_errors:
                hint += f"; plugin {name!r} failed to load: {self.load_errors[name]}"
            raise UnknownPluginError(
                f"unknown {kind.value} plugin {name!r}; valid choices: {valid}{hint}"
            )
        if len(found) > 1:
            raise DuplicatePluginError(
                f"{kind.value} {what} {name!r} is offered by several plugins: "
                f"{', '.join(_origin(plugin, d) for plugin, d in found)}; uninstall one of them"
            )
        return found[0][1]

    def distribution(self, descriptor: PluginDescriptor) -> tuple[str, str]:
        """(distribution, version) of the package that offers ``descriptor``, read from
        its entry point's metadata (the implementation is not imported); ``("?", "?")``
        for a plugin registered by hand from no installed distribution."""
        for by_name in self._build_index().values():
            for plugin_name, found in by_name.get(descriptor.name, []):
                if found is descriptor:
                    if plugin_name in self._distributions:
                        return self._distributions[plugin_name]
                    plugin = self.manager.get_plugin(plugin_name)
                    module = getattr(plugin, "__name__", None) or type(plugin).__module__
                    return _distribution_of_module(module)
        return "?", "?"

    def resolve(self, kind: PluginKind | str, name_or_uri: str) -> PluginDescriptor:
        """Choose a plugin by name (``zk``) or by URI (``zk://127.0.0.1:2181/waltz``)."""
        if "://" in name_or_uri:
            return self.get(kind, urlsplit(name_or_uri).scheme)
        return self.get(kind, name_or_uri)


def _kind(kind: PluginKind | str) -> PluginKind:
    try:
        return PluginKind(kind)
    except ValueError:
        valid = ", ".join(k.value for k in PluginKind)
        raise PluginError(f"unknown plugin kind {kind!r}; valid kinds: {valid}") from None


def _origin(plugin_name: str, descriptor: PluginDescriptor) -> str:
    return f"plugin {plugin_name!r} ({descriptor.origin})"


def _distribution_of_module(module: str) -> tuple[str, str]:
    top = module.split(".", maxsplit=1)[0]
    # an editable install maps no top-level name: its distribution is usually named alike
    names = [*importlib.metadata.packages_distributions().get(top, []), top.replace("_", "-")]
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return (top or "?"), "?"


_registry: PluginRegistry | None = None
_registry_lock = threading.Lock()


def get_registry() -> PluginRegistry:
    """The process-wide registry, built on first call."""
    global _registry  # noqa: PLW0603
    with _registry_lock:
        if _registry is None:
            _registry = PluginRegistry()
        return _registry


def reset_registry() -> None:
    """Forget the process-wide registry (tests; after installing a plugin)."""
    global _registry  # noqa: PLW0603
    with _registry_lock:
        _registry = None
