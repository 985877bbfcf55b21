"""The pytest plugin (entry point ``pytest11``) of the conformance suite."""

from __future__ import annotations

import pytest

# Session-scoped fixtures of real servers (ZooKeeper, etcd), shared by every package's tests.
from waltz_conformance.servers.fixtures import etcd_cluster, zookeeper_server  # noqa: F401


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "waltz_requires(*capabilities): the test needs optional backend capabilities; "
        "it is skipped with the reason for a backend that does not declare them",
    )
