"""waltz_coord_zk: Waltz coordination on ZooKeeper (kazoo), plugin ``zk`` (the default).

Select it with a URI ``zk://host:port[,host:port...]/root``.
"""

from waltz_coord_zk.coordination import ZooKeeperCoordination, parse_zk_uri

__all__ = ["ZooKeeperCoordination", "parse_zk_uri"]
