"""Registers the ZooKeeper coordination plugin (``zk``) with Waltz.

Light on purpose: kazoo is imported only when ``zk`` is chosen."""

from __future__ import annotations

from waltz_api.hookspecs import CoordinationDescriptor, CoordinationFactory, hookimpl


def load_factory() -> CoordinationFactory:
    from waltz_coord_zk.coordination import create_zk_coordination

    return create_zk_coordination


@hookimpl
def waltz_coordinators() -> list[CoordinationDescriptor]:
    return [
        CoordinationDescriptor(
            name="zk",
            load=load_factory,
            description="ZooKeeper through kazoo (zk://host:port[,host:port]/root); the default",
            uri_schemes=("zk", "zookeeper"),
            conformance_harness="waltz_coord_zk.conformance:harness",
        )
    ]
