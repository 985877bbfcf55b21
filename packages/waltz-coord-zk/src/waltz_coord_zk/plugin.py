"""Registers the ZooKeeper coordination plugin (``zk``) with Waltz."""

from __future__ import annotations

from waltz_api.hookspecs import PluginDescriptor, PluginKind, hookimpl


@hookimpl
def waltz_coordinators() -> list[PluginDescriptor]:
    from waltz_coord_zk.coordination import create_zk_coordination

    return [
        PluginDescriptor(
            kind=PluginKind.COORDINATION,
            name="zk",
            factory=create_zk_coordination,
            description="ZooKeeper through kazoo (zk://host:port[,host:port]/root); the default",
            uri_schemes=("zk", "zookeeper"),
            conformance_harness="waltz_coord_zk.conformance:harness",
        )
    ]
