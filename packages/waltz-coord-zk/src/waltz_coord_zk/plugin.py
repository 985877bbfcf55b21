"""Registers the ZooKeeper coordination plugin (``zk``) with Waltz, and its options.

Light on purpose: kazoo is imported only when ``zk`` is chosen."""

from __future__ import annotations

from collections.abc import Sequence

from waltz_api.hookspecs import (
    CoordinationDescriptor,
    CoordinationFactory,
    OptionSchema,
    OptionSpec,
    hookimpl,
)


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


def options() -> Sequence[OptionSpec]:
    """The options of a ``zk`` client (also the URI's query), with their defaults."""
    from waltz_api.security import login_option_specs, tls_option_specs
    from waltz_coord_zk import coordination as zk

    return [
        OptionSpec(
            "session_timeout",
            "float",
            zk.DEFAULT_SESSION_TIMEOUT,
            "seconds; a client silent this long loses its session and its ephemeral entries "
            "(a server whose session ends drops its partitions and registers again)",
        ),
        OptionSpec(
            "connect_timeout",
            "float",
            zk.DEFAULT_CONNECT_TIMEOUT,
            "seconds to reach the ensemble at start",
        ),
        *tls_option_specs("ZooKeeper's `secureClientPort`"),
        OptionSpec(
            "auth",
            "str",
            "",
            "`digest` (ZooKeeper's digest scheme) or `sasl` (SASL DIGEST-MD5; needs "
            "`waltz-coord-zk[sasl]`); with `username` and `password` or `password_file`",
        ),
        *login_option_specs(),
        OptionSpec(
            "acl",
            "str",
            "",
            "ACL of the znodes this client creates: `world-read` (default with `auth`: the "
            "cluster's identity may do anything, others only read), `private` (only the "
            "cluster's identity), `open` (default without `auth`: anyone)",
        ),
    ]


@hookimpl
def waltz_option_schemas() -> list[OptionSchema]:
    return [OptionSchema("zk-options", options)]
