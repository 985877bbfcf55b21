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
from typing import Any
from urllib.parse import urlsplit

import pluggy

from waltz_api.errors import DuplicatePluginError, PluginError, UnknownPluginError
from waltz_api.hookspecs import (
    HOOK_FOR_KIND,
    PROJECT_NAME,
    PluginDescriptor,
    PluginKind,
    WaltzHookSpecs,
)

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = PROJECT_NAME
DISABLE_AUTOLOAD_ENV = "WALTZ_DISABLE_PLUGIN_AUTOLOAD"


class PluginRegistry:
    """The loaded plugins and the descriptors they offer, by kind and name."""

    def __init__(self, *, autoload: bool | None = None) -> None:
        self.manager = pluggy.PluginManager(PROJECT_NAME)
        self.manager.add_hookspecs(WaltzHookSpecs)
        self.load_errors: dict[str, BaseException] = {}
        self._index: dict[PluginKind, dict[str, list[PluginDescriptor]]] | None = None
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
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must not take the others down
                self.load_errors[ep.name] = exc
                log.warning(
                    "skipping Waltz plugin %r (%s): it failed to import: %s: %s",
                    ep.name,
                    ep.value,
                    type(exc).__name__,
                    exc,
                )
                continue
            self.manager.register(plugin, name=ep.name)

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Register a plugin module or object explicitly (tests, embedding)."""
        self.manager.register(plugin, name=name)
        self.manager.check_pending()
        self._index = None

    def _build_index(self) -> dict[PluginKind, dict[str, list[PluginDescriptor]]]:
        if self._index is None:
            index: dict[PluginKind, dict[str, list[PluginDescriptor]]] = {
                kind: defaultdict(list) for kind in PluginKind
            }
            for kind, hook_name in HOOK_FOR_KIND.items():
                hook = getattr(self.manager.hook, hook_name)
                for result in hook():
                    for descriptor in result:
                        if descriptor.kind is not kind:
                            raise PluginError(
                                f"plugin descriptor {descriptor.name!r} of kind "
                                f"{descriptor.kind} was returned by {hook_name}"
                            )
                        index[kind][descriptor.name].append(descriptor)
            for kind, by_name in index.items():
                for name, found in by_name.items():
                    if len(found) > 1:
                        log.error(
                            "duplicate %s plugin name %r, offered by %s",
                            kind,
                            name,
                            ", ".join(_origin(d) for d in found),
                        )
            self._index = index
        return self._index

    def names(self, kind: PluginKind | str) -> list[str]:
        """The names of the plugins of ``kind``, sorted."""
        return sorted(self._build_index()[PluginKind(kind)])

    def descriptors(self, kind: PluginKind | str) -> list[PluginDescriptor]:
        """Every descriptor of ``kind`` (the first of any duplicated name)."""
        by_name = self._build_index()[PluginKind(kind)]
        return [by_name[name][0] for name in sorted(by_name)]

    def get(self, kind: PluginKind | str, name: str) -> PluginDescriptor:
        """The plugin of ``kind`` named ``name`` (or selected by URI scheme).

        Raises UnknownPluginError listing the valid names, or
        DuplicatePluginError when two plugins claim the name."""
        kind = PluginKind(kind)
        by_name = self._build_index()[kind]
        found = by_name.get(name)
        if not found:
            for descriptors in by_name.values():
                if name in descriptors[0].uri_schemes:
                    found = descriptors
                    break
        if not found:
            valid = ", ".join(sorted(by_name)) or "(none installed)"
            hint = ""
            if name in self.load_errors:
                hint = f"; plugin {name!r} failed to import: {self.load_errors[name]}"
            raise UnknownPluginError(
                f"unknown {kind.value} plugin {name!r}; valid choices: {valid}{hint}"
            )
        if len(found) > 1:
            raise DuplicatePluginError(
                f"{kind.value} plugin name {name!r} is offered by several plugins: "
                f"{', '.join(_origin(d) for d in found)}; uninstall one of them"
            )
        return found[0]

    def resolve(self, kind: PluginKind | str, name_or_uri: str) -> PluginDescriptor:
        """Choose a plugin by name (``zk``) or by URI (``zk://127.0.0.1:2181/waltz``)."""
        if "://" in name_or_uri:
            return self.get(kind, urlsplit(name_or_uri).scheme)
        return self.get(kind, name_or_uri)


def _origin(descriptor: PluginDescriptor) -> str:
    factory = descriptor.factory
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', factory)}"


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
