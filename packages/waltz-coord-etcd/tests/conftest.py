"""Client factories on the real 3-member etcd cluster of the test session (the
``etcd_cluster`` fixture comes from the conformance pytest plugin)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from waltz_conformance.servers.etcd import EtcdCluster
from waltz_coord_etcd import EtcdCoordination

ClientFactory = Callable[..., Awaitable[EtcdCoordination]]


@pytest.fixture
def root() -> str:
    return f"/test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def new_client(etcd_cluster: EtcdCluster, root: str) -> AsyncIterator[ClientFactory]:
    """Start clients of the shared cluster under a fresh root; all closed at the end."""
    etcd_cluster.ensure_all_running()
    clients: list[EtcdCoordination] = []

    async def factory(connect: str | None = None, **options: Any) -> EtcdCoordination:
        options.setdefault("session_timeout", 4)
        client = EtcdCoordination(connect or etcd_cluster.uri(root), options)
        await client.start()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.close()
