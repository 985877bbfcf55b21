"""Lazy re-exports for a package's ``__init__``: the names stay importable from the
package, the modules behind them are imported on first use.

A plugin's entry point (``waltz_coord_etcd.plugin``) imports its package first; an
``__init__`` that imported the implementation would make every process that reads
the plugin descriptors pay for aiohttp, kazoo, pyzmq... Use it as::

    from typing import TYPE_CHECKING

    from waltz_api.lazy import lazy_exports

    if TYPE_CHECKING:
        from waltz_coord_etcd.coordination import EtcdCoordination

    __all__ = ["EtcdCoordination"]
    __getattr__, __dir__ = lazy_exports(__name__, {"EtcdCoordination": ".coordination"})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` (PEP 562): each of
    ``names`` is imported from its module (``".coordination"``, relative to ``package``,
    or absolute) on first access, then kept in the package's namespace."""

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__
