"""The conformance harnesses of the built-in lock tables (``hwm-array`` and ``exact``).

Needs waltz-conformance (waltz-server's ``test`` extra). Each function returns the
harness of the lock-table suite for its plugin, with the plugin's declared capabilities.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry
from waltz_conformance.suites.locktable import LockTableHarness


def hwm_array(options: Mapping[str, Any] | None = None) -> LockTableHarness:
    """The harness of ``hwm-array`` (``options["size"]``: its number of slots)."""
    return _harness("hwm-array", options)


def exact(options: Mapping[str, Any] | None = None) -> LockTableHarness:
    """The harness of ``exact``."""
    return _harness("exact", options)


def _harness(name: str, options: Mapping[str, Any] | None) -> LockTableHarness:
    descriptor = get_registry().get(PluginKind.LOCK_TABLE, name)
    suffix = f"[{', '.join(f'{k}={v}' for k, v in options.items())}]" if options else ""
    return LockTableHarness.from_descriptor(descriptor, options, name=f"{name}{suffix}")
