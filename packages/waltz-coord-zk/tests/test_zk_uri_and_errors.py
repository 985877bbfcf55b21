"""The zk plugin's URI parsing, option validation and connection errors."""

from __future__ import annotations

import time

import pytest

from waltz_api.cluster import coordination_from_uri
from waltz_api.errors import ConfigError, CoordinationError, CoordinationUnavailableError
from waltz_conformance.servers import free_port
from waltz_coord_zk import ZooKeeperCoordination, parse_zk_uri
from waltz_coord_zk.coordination import create_zk_coordination


def test_parse_uri() -> None:
    assert parse_zk_uri("zk://127.0.0.1:2181/waltz") == ("127.0.0.1:2181", "/waltz", {})
    assert parse_zk_uri("zk://a:1,b:2,c:3/x/y?session_timeout=4") == (
        "a:1,b:2,c:3",
        "/x/y",
        {"session_timeout": "4"},
    )
    assert parse_zk_uri("zookeeper://a:1") == ("a:1", "/waltz", {})
    assert parse_zk_uri("a:1/r") == ("a:1", "/r", {})


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("etcd://a:1/x", "zk://host:port"),
        ("zk:///x", "no ZooKeeper host"),
        ("zk://a/x", "not host:port"),
        ("zk://a:1,b/x", "not host:port"),
    ],
)
def test_bad_uris_are_refused(uri: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_zk_uri(uri)


def test_options_are_validated() -> None:
    client = create_zk_coordination("zk://a:1/r?session_timeout=4", {"connect_timeout": 2})
    assert (client.session_timeout, client.connect_timeout, client.root) == (4.0, 2.0, "/r")
    with pytest.raises(ConfigError, match="session_timeout"):
        create_zk_coordination("zk://a:1/r?session_timeout=soon")
    with pytest.raises(ConfigError, match="positive"):
        create_zk_coordination("zk://a:1/r", {"connect_timeout": 0})


def test_registry_resolves_zk_uris() -> None:
    client = coordination_from_uri("zk://127.0.0.1:2181/waltz")
    assert isinstance(client, ZooKeeperCoordination)


async def test_unreachable_server_fails_in_time() -> None:
    client = ZooKeeperCoordination(f"127.0.0.1:{free_port()}", "/x", connect_timeout=1.5)
    started = time.monotonic()
    with pytest.raises(CoordinationUnavailableError, match="could not connect"):
        await client.start()
    assert time.monotonic() - started < 15
    with pytest.raises(CoordinationError):
        await client.get("/a")
    await client.close()


async def test_relative_paths_are_refused(zookeeper_server: object) -> None:
    from waltz_conformance.servers.zookeeper import ZooKeeperServer

    assert isinstance(zookeeper_server, ZooKeeperServer)
    client = ZooKeeperCoordination(zookeeper_server.connect_string, "/relative-test")
    await client.start()
    try:
        with pytest.raises(CoordinationError, match="absolute"):
            await client.get("no-slash")
    finally:
        await client.close()
