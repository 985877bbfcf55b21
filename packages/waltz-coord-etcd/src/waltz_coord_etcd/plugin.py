"""Registers the etcd coordination plugin (``etcd``, URIs ``etcd://...``).

Light on purpose: the implementation is imported only when the plugin is chosen."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from waltz_api.hookspecs import CoordinationDescriptor, hookimpl

if TYPE_CHECKING:
    from waltz_api.contracts.coordination import Coordination


def create_coordination(connect: str, options: Mapping[str, Any] | None = None) -> Coordination:
    """The plugin factory: ``connect`` is ``etcd://host:port[,host:port...]/root``."""
    from waltz_coord_etcd.coordination import EtcdCoordination

    return EtcdCoordination(connect, options or {})


@hookimpl
def waltz_coordinators() -> list[CoordinationDescriptor]:
    return [
        CoordinationDescriptor(
            name="etcd",
            factory=create_coordination,
            capabilities=frozenset({"server_restart", "cross_process"}),
            description="etcd v3 (leases, mod_revision compare-and-set, watches)",
            uri_schemes=("etcd",),
            conformance_harness="waltz_coord_etcd.conformance:harness",
        )
    ]
