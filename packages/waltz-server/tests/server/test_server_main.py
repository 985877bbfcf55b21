"""Servers started from their config (the ``waltz server`` path): cluster manager,
assignment, generations, a server leaving; memory plugins, real StorageNodes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from cluster_fixture import InProcessCluster
from test_server import RawClient

from waltz_api import wire
from waltz_api.cluster import ClusterMetadata
from waltz_api.config import config_from_mapping
from waltz_api.errors import ConfigError
from waltz_api.messages import (
    AppendRequest,
    ErrorResponse,
    FeedData,
    FlushRequest,
    FlushResponse,
    MountRequest,
    MountResponse,
)
from waltz_api.types import LockRequest, ReqId
from waltz_server.observability import http_get
from waltz_server.server.config import ServerNodeConfig, load_server_config
from waltz_server.server.main import RunningServer, start_server

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 30.0
PARTITIONS = 4


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[InProcessCluster, str]]:
    service = f"svc-{uuid.uuid4().hex[:8]}"
    made = await InProcessCluster.create(num_partitions=PARTITIONS, service=service)
    try:
        yield made, service
    finally:
        await made.close()


def server_config(service: str, name: str, http: bool = False) -> ServerNodeConfig:
    return config_from_mapping(
        ServerNodeConfig,
        {
            "coordination": {"uri": f"memory://{service}/waltz"},
            "transport": {
                "plugin": "memory",
                "endpoint": f"memory://{name}-{service}",
                "storage_endpoint": "memory://{}",
            },
            "server": {"lock_table": "exact"},
            "http": {"enabled": http, "port": 0},
        },
    )


async def wait_served(servers: list[RunningServer], meta: ClusterMetadata) -> None:
    """Until every partition is held by the server its assignment names, ready."""
    for _ in range(1000):
        done = True
        for partition in range(PARTITIONS):
            owner = (await meta.partition_assignment(partition)).value
            holders = [
                r
                for r in servers
                if r.manager.server_id == owner.server_id
                and partition in r.server.partitions
                and r.server.partitions[partition].generation == owner.generation
                and r.server.partitions[partition].ready
            ]
            done = done and len(holders) == 1
        if done:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the partitions were never all served")


async def write(
    cluster: InProcessCluster, meta: ClusterMetadata, tag: bytes, client_id: int
) -> dict[int, int]:
    """Append 10 transactions to every partition at its owner; the flushed marks."""
    marks = {}
    for partition in range(PARTITIONS):
        owner = (await meta.partition_assignment(partition)).value
        client = await RawClient.connect(
            cluster.client_transport, owner.endpoint, f"client:{client_id}"
        )
        for i in range(10):
            data = tag + b"%d-%d" % (partition, i)
            await client.send(
                AppendRequest(
                    ReqId(client_id, owner.generation, partition, i),
                    -1,
                    LockRequest(),
                    0,
                    data,
                    wire.checksum(data),
                )
            )
        await client.send(FlushRequest(ReqId(client_id, owner.generation, partition, 99)))
        marks[partition] = (await client.wait(FlushResponse))[0].transaction_id
        await client.close()
    return marks


async def test_two_servers_share_the_partitions_and_survive_one_leaving(
    cluster: tuple[InProcessCluster, str],
) -> None:
    made, service = cluster
    meta = ClusterMetadata(made.coordination)
    first = await start_server(server_config(service, "a", http=True))
    second = await start_server(server_config(service, "b"))
    servers = [first, second]
    try:
        await wait_served(servers, meta)
        held = {r.manager.server_id: sorted(r.server.partitions) for r in servers}
        assert sorted(p for ps in held.values() for p in ps) == list(range(PARTITIONS))
        assert all(len(ps) == PARTITIONS // 2 for ps in held.values()), held
        marks = await write(made, meta, b"one-", 1)
        assert marks == {p: 9 for p in range(PARTITIONS)}
        # health and metrics of the first server
        assert first.http is not None
        ready = await http_get(f"{first.http.url}/readyz")
        assert ready.status == 200 and '"status": "ok"' in ready.body
        assert (await http_get(f"{first.http.url}/livez")).status == 200
        text = (await http_get(f"{first.http.url}/metrics")).body
        for partition in held[first.manager.server_id]:
            assert (
                f'waltz_server_appended_transactions_total{{partition="{partition}"}} 10.0' in text
            )
            assert f'waltz_server_high_water_mark{{partition="{partition}"}} 9.0' in text
            assert (
                f'waltz_server_commit_latency_seconds_count{{partition="{partition}"}} 10.0' in text
            )
        assert 'waltz_server_requests_total{kind="AppendRequest"} 20.0' in text
        assert 'waltz_server_requests_total{kind="FlushRequest"} 2.0' in text
        assert "waltz_build_info{" in text and 'role="server"' in text
        assert "_created" not in text
        # a consumer: connected, its feed caught up (lag 0), seen by the server
        partition = held[first.manager.server_id][0]
        generation = first.server.partitions[partition].generation
        consumer = await RawClient.connect(
            made.client_transport, first.server.endpoint, "client:77"
        )
        try:
            await consumer.send(MountRequest(ReqId(77, generation, partition, 0), 4, 1))
            await consumer.wait(MountResponse)
            assert len(await consumer.wait(FeedData, 5)) == 5
            elsewhere = held[second.manager.server_id][0]
            await consumer.send(FlushRequest(ReqId(77, generation, elsewhere, 1)))
            await consumer.wait(ErrorResponse)
            text = (await http_get(f"{first.http.url}/metrics")).body
            assert "waltz_server_connected_clients 1.0" in text
            lag = (
                f'waltz_server_feed_lag_transactions{{client="client:77",partition="{partition}"}}'
            )
            assert f"{lag} 0.0" in text
            assert 'waltz_server_errors_total{kind="partition_not_assigned"} 1.0' in text
        finally:
            await consumer.close()
        generations = {
            p: (await meta.partition_assignment(p)).value.generation for p in range(PARTITIONS)
        }
        # the first server stops: its partitions move, with a new generation
        moved = held[first.manager.server_id]
        await first.stop()
        servers = [second]
        await wait_served(servers, meta)
        assert sorted(second.server.partitions) == list(range(PARTITIONS))
        for partition in moved:
            assert (await meta.partition_assignment(partition)).value.generation > generations[
                partition
            ]
        marks = await write(made, meta, b"two-", 2)
        assert marks == {p: 19 for p in range(PARTITIONS)}
        for node in made.nodes:
            for partition in range(PARTITIONS):
                log = await node.log(partition)
                assert [r.transaction_id for r in log] == list(range(len(log)))
                assert len(log) <= 20
                assert [r.data for r in log[:10]] == [
                    b"one-%d-%d" % (partition, i) for i in range(10)
                ]
    finally:
        for running in servers:
            await running.stop()


def test_config_errors_name_the_key(tmp_path: object) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping(
            ServerNodeConfig,
            {"coordination": {"uri": "localhost:2181"}, "transport": {"endpoint": "tcp://x:1"}},
        )
    assert info.value.key == "coordination.uri"
    with pytest.raises(ConfigError) as info:
        config_from_mapping(
            ServerNodeConfig,
            {
                "coordination": {"uri": "zk://127.0.0.1:2181/w"},
                "transport": {"endpoint": "tcp://x:1", "storage_endpoint": "tcp://"},
            },
        )
    assert info.value.key == "transport.storage_endpoint"
    config = load_server_config(
        None,
        env={
            "WALTZ_COORDINATION__URI": "zk://127.0.0.1:2181/w",
            "WALTZ_TRANSPORT__ENDPOINT": "tcp://127.0.0.1:5600",
            "WALTZ_SERVER__LOCK_TABLE": "exact",
        },
    )
    assert config.server.to_server_config().partition.lock_table == "exact"
