"""Session-scoped pytest fixtures for the real servers (registered by the conformance
pytest plugin, so every test suite of the workspace can ask for them):
``zookeeper_server`` (one standalone ZooKeeper) and ``etcd_cluster`` (a
3-member etcd cluster, from :mod:`waltz_conformance.servers.etcd`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz_conformance.servers.etcd import EtcdCluster
from waltz_conformance.servers.zookeeper import ZooKeeperServer

__all__ = ["etcd_cluster", "zookeeper_server"]


@pytest.fixture(scope="session")
def zookeeper_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZooKeeperServer]:
    """One real standalone ZooKeeper for the test session, stopped by pid at the end.

    Tests that kill or restart it (``kill()``, ``restart()``) must leave it running."""
    workdir: Path = tmp_path_factory.mktemp("zookeeper")
    server = ZooKeeperServer(workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """A real 3-member etcd cluster shared by the whole test session."""
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
