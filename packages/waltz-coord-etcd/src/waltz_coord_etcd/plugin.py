"""Registers the etcd coordination plugin (``etcd``, URIs ``etcd://...``) and its options.

Light on purpose: the implementation is imported only when the plugin is chosen."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from waltz_api.hookspecs import CoordinationDescriptor, OptionSchema, OptionSpec, hookimpl

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


def options() -> Sequence[OptionSpec]:
    """The options of an ``etcd`` client, with their defaults."""
    from waltz_api.security import login_option_specs, tls_option_specs
    from waltz_coord_etcd import coordination as etcd

    return [
        OptionSpec(
            "session_timeout",
            "float",
            etcd.DEFAULT_SESSION_TIMEOUT,
            "seconds, the lease TTL (whole seconds, rounded up); ephemeral keys carry the lease",
        ),
        OptionSpec(
            "request_timeout",
            "float",
            etcd.DEFAULT_REQUEST_TIMEOUT,
            "seconds per operation, failover to another member included",
        ),
        OptionSpec(
            "connect_timeout",
            "float",
            etcd.DEFAULT_CONNECT_TIMEOUT,
            "seconds per connection attempt to one member",
        ),
        *tls_option_specs(
            "`https://` client URLs; with auth on, `tls_cert` must carry no CommonName"
        ),
        *login_option_specs(),
    ]


@hookimpl
def waltz_option_schemas() -> list[OptionSchema]:
    return [OptionSchema("etcd-options", options)]
