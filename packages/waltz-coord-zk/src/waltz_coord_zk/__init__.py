"""waltz_coord_zk: Waltz coordination on ZooKeeper (kazoo), plugin ``zk`` (the default).

Select it with a URI ``zk://host:port[,host:port...]/root``.

The names below are imported on first use: the plugin's entry point imports this
package, and reading its descriptor must not import the implementation.
"""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
    from waltz_coord_zk.coordination import ZooKeeperCoordination, parse_zk_uri

__all__ = ["ZooKeeperCoordination", "parse_zk_uri"]
__getattr__, __dir__ = lazy_exports(
    __name__, {"ZooKeeperCoordination": ".coordination", "parse_zk_uri": ".coordination"}
)
