"""A whole Waltz cluster on one machine, for development, tests and benchmarks: the one
place that needs both products (the server and the storage node).

- :class:`~waltz_dev.dev.DevCluster` (``waltz dev``): storage nodes and servers as child
  processes (``waltz storage --config``, ``waltz server --config``) on local
  coordination, ZeroMQ on loopback and the fs engine.
- :class:`~waltz_dev.inprocess.InProcessCluster`: the same components in one event loop.

The names below are imported on first use.
"""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
    from waltz_dev.dev import DevCluster
    from waltz_dev.inprocess import InProcessCluster

__all__ = ["DevCluster", "InProcessCluster"]
__getattr__, __dir__ = lazy_exports(
    __name__, {"DevCluster": ".dev", "InProcessCluster": ".inprocess"}
)
