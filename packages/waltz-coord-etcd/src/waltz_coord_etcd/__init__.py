"""Waltz coordination on etcd v3, through etcd's JSON gRPC gateway (see the README).

The names below are imported on first use: the plugin's entry point imports this
package, and reading its descriptor must not import the implementation.
"""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
    from waltz_coord_etcd.coordination import EtcdCoordination, EtcdTarget, parse_connect

__all__ = ["EtcdCoordination", "EtcdTarget", "parse_connect"]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "EtcdCoordination": ".coordination",
        "EtcdTarget": ".coordination",
        "parse_connect": ".coordination",
    },
)
