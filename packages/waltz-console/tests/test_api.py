"""The console's HTTP API without a browser: a real aiohttp server over a real
collector following a real (local) coordination store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from waltz_api.cluster import coordination_from_uri
from waltz_api.errors import ConfigError
from waltz_api.ports import free_port
from waltz_console.auth import CSRF_HEADER, Sessions, load_token
from waltz_console.collector import Collector
from waltz_console.main import make_transport, parse_listen
from waltz_console.web import Console
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.server.preferred import PreferredPartitionStore

TOKEN = "a-console-token-long-enough"
NODES = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
DEADLINE = 30.0


async def _until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {DEADLINE} s: {what}")
        await asyncio.sleep(0.05)


class Harness:
    def __init__(self, uri: str, client: TestClient[Any, Any], collector: Collector) -> None:
        self.uri = uri
        self.client = client
        self.collector = collector

    async def get(self, path: str) -> tuple[int, Any]:
        response = await self.client.get(path)
        return response.status, await response.json()

    async def post(self, path: str, body: Any, *, header: bool = True) -> tuple[int, Any]:
        headers = {CSRF_HEADER: "1"} if header else {}
        response = await self.client.post(path, json=body, headers=headers)
        return response.status, await response.json()


async def _create_cluster(uri: str) -> None:
    coordination = coordination_from_uri(uri)
    await coordination.start()
    try:
        await ClusterAdmin(coordination).create_cluster(
            num_partitions=3, num_replicas=2, storage_nodes=NODES, cluster_key=uuid.uuid4()
        )
    finally:
        await coordination.close()


@contextlib.asynccontextmanager
async def _harness(uri: str) -> AsyncIterator[Harness]:
    loop = asyncio.get_running_loop()
    collector = Collector(uri, interval=0.2)
    console = Console(
        collector, Sessions(TOKEN, loop.time), lambda: make_transport("zmq", {}), timeout=1.0
    )
    await collector.start()
    client: TestClient[Any, Any] = TestClient(TestServer(console.app()))
    await client.start_server()
    try:
        yield Harness(uri, client, collector)
    finally:
        await client.close()
        await collector.close()
        await console.close()


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Harness]:
    uri = f"local://{tmp_path / 'coordination'}?root=/waltz"
    (tmp_path / "coordination").mkdir()
    await _create_cluster(uri)
    async with _harness(uri) as harness:

        async def ready() -> bool:
            return harness.collector.snapshot.cluster["cluster_key"] is not None

        await _until(ready, "the console read the cluster")
        yield harness


async def test_the_page_and_its_assets_come_from_the_console(api: Harness) -> None:
    response = await api.client.get("/")
    text = await response.text()
    assert response.status == 200 and "/static/app.js" in text
    assert "http://" not in text and "https://" not in text  # nothing from another host
    assert "default-src 'self'" in response.headers["Content-Security-Policy"]
    for asset in ("app.js", "app.css", "favicon.svg"):
        assert (await api.client.get(f"/static/{asset}")).status == 200


async def test_overview_partitions_and_bad_input(api: Harness) -> None:
    status, overview = await api.get("/api/overview")
    assert status == 200
    assert overview["cluster"]["partitions"] == 3 and overview["cluster"]["storage_nodes"] == 3
    assert not overview["authenticated"]
    status, body = await api.get("/api/partitions?offset=1&limit=1")
    assert status == 200 and body["total"] == 3
    assert [r["partition"] for r in body["rows"]] == [1]
    assert body["rows"][0]["owner"] is None and not body["rows"][0]["owner_alive"]
    for path, code, message in [
        ("/api/partitions/7", 404, "partition 7 does not exist: the cluster has partitions 0..2"),
        ("/api/partitions/x", 400, "partition must be a whole number, got 'x'"),
        ("/api/partitions?limit=abc", 400, "limit must be a whole number, got 'abc'"),
        ("/api/partitions?offset=-3", 400, "offset must be at least 0, got -3"),
        ("/api/partitions/1/transactions?count=0", 400, "count must be at least 1, got 0"),
        ("/api/partitions/1/transactions?start=1-2", 400, "start must be a whole number"),
        ("/api/partitions/1/transactions", 503, "partition 1 has no live server now"),
        ("/api/events?after=z", 400, "after must be a whole number"),
        ("/api/nothing", 404, "no such API route: GET /api/nothing"),
    ]:
        status, body = await api.get(path)
        assert status == code, (path, body)
        assert message in body["error"], (path, body)


async def test_actions_need_a_login_the_header_and_a_confirmation(api: Harness) -> None:
    body = {"confirm": True, "partition": 0, "storage_node": NODES[0]}
    status, answer = await api.post("/api/actions/remove-replica", body)
    assert status == 401 and "log in first" in answer["error"]
    status, answer = await api.post("/api/login", {"token": "wrong-token-of-some-length"})
    assert status == 401 and "wrong token" in answer["error"]
    status, answer = await api.post("/api/login", {"token": TOKEN}, header=False)
    assert status == 403
    assert (await api.get("/api/session"))[1] == {"authenticated": False}
    status, answer = await api.post("/api/login", {"token": TOKEN})
    assert status == 200 and (await api.get("/api/session"))[1] == {"authenticated": True}

    status, answer = await api.post("/api/actions/remove-replica", body, header=False)
    assert status == 403
    status, answer = await api.post("/api/actions/remove-replica", {**body, "confirm": False})
    assert status == 400 and '"confirm": true' in answer["error"]
    status, answer = await api.post("/api/actions/reboot", body)
    assert status == 404 and "add-replica" in answer["error"]
    status, answer = await api.post(
        "/api/actions/remove-replica", {**body, "storage_node": "not a node"}
    )
    assert status == 400 and "is not host:port" in answer["error"]
    status, answer = await api.post("/api/actions/remove-replica", {**body, "partition": "x"})
    assert status == 400 and "partition must be a partition id" in answer["error"]

    # a change the cluster admin code makes, seen by the collector's watches
    status, answer = await api.post("/api/actions/remove-replica", body)
    assert status == 200, answer
    assert answer["message"] == f"partition 0: replica on {NODES[0]} removed (its data stays)"

    async def removed() -> bool:
        row = api.collector.snapshot.partition(0)
        return row is not None and NODES[0] not in [r["node"] for r in row["replicas"]]

    await _until(removed, "the removal shows")
    messages = [e["message"] for e in api.collector.events]
    assert f"partition 0: replica on {NODES[0]} removed" in messages
    assert f"operator: {answer['message']}" in messages
    # the last replica is refused with the admin code's own reason
    status, answer = await api.post(
        "/api/actions/remove-replica", {**body, "storage_node": NODES[1]}
    )
    assert status == 400 and "last replica" in answer["error"]
    status, answer = await api.post(
        "/api/actions/remove-replica", {**body, "storage_node": NODES[2]}
    )
    assert status == 200 and "holds no replica of it; nothing done" in answer["message"]

    status, answer = await api.post(
        "/api/actions/preferred-partitions",
        {"confirm": True, "endpoint": "tcp://10.1.1.1:5600", "partitions": "0, 9"},
    )
    assert status == 400 and "partitions [9] do not exist" in answer["error"]
    status, answer = await api.post(
        "/api/actions/preferred-partitions",
        {"confirm": True, "endpoint": "tcp://10.1.1.1:5600", "partitions": "2, 0"},
    )
    assert status == 200 and answer["message"] == "tcp://10.1.1.1:5600: preferred partitions [0, 2]"
    metadata = api.collector.metadata
    assert metadata is not None
    stored = await PreferredPartitionStore(metadata.coordination).read()
    assert stored.endpoints == {"tcp://10.1.1.1:5600": (0, 2)}

    await api.post("/api/logout", {})
    status, _ = await api.post("/api/actions/remove-replica", body)
    assert status == 401


async def test_unreachable_coordination_is_said_and_retried(tmp_path: Path) -> None:
    uri = f"local://{tmp_path / 'coordination'}?root=/waltz"
    (tmp_path / "coordination").mkdir()
    async with _harness(uri) as harness:

        async def says_why() -> bool:
            error = harness.collector.snapshot.cluster["coordination_error"]
            return error is not None and "no Waltz cluster" in error

        await _until(says_why, "the console says there is no cluster")
        status, overview = await harness.get("/api/overview")
        assert status == 200 and overview["cluster"]["cluster_key"] is None
        status, answer = await harness.post("/api/login", {"token": TOKEN})
        status, answer = await harness.post("/api/actions/verify", {"confirm": True})
        assert status == 503 and "not reachable" in answer["error"]

        await _create_cluster(uri)

        async def connected() -> bool:
            cluster = harness.collector.snapshot.cluster
            return cluster["cluster_key"] is not None and cluster["coordination_error"] is None

        await _until(connected, "the console connects once the cluster exists")


async def test_the_event_stream_pushes_updates(api: Harness) -> None:
    response = await api.client.get("/api/stream")
    assert response.headers["Content-Type"] == "text/event-stream"
    first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), DEADLINE)
    assert first.startswith(b"event: update\ndata: ")
    second = await asyncio.wait_for(response.content.readuntil(b"\n\n"), DEADLINE)
    assert b'"version"' in second
    response.close()


async def test_an_unreachable_coordination_service_is_named() -> None:
    """Nothing listens at the ZooKeeper address: the console says so, with the address,
    within its timeout (and keeps serving)."""
    uri = f"zk://127.0.0.1:{free_port()}/waltz"
    collector = Collector(uri, interval=0.2, timeout=1.0)
    await collector.start()
    try:

        async def says_why() -> bool:
            error = collector.snapshot.cluster["coordination_error"] or ""
            return "could not connect to ZooKeeper at 127.0.0.1:" in error

        await _until(says_why, "the console names the unreachable service")
        assert collector.snapshot.cluster["coordination"] == uri
    finally:
        await collector.close()


def test_token_from_env_file_or_new(tmp_path: Path) -> None:
    assert load_token(None, "x" * 20) == ("x" * 20, False)
    with pytest.raises(ConfigError, match="characters long; use at least 16"):
        load_token(None, "short")
    path = tmp_path / "sub" / "console.token"
    token, made = load_token(path, None)
    assert made and len(token) >= 16
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_token(path, None) == (token, False)
    other, made = load_token(None, None)
    assert made and other != token


def test_sessions_expire_and_log_out() -> None:
    now = [0.0]
    sessions = Sessions(TOKEN, lambda: now[0], session_ttl=10)
    assert sessions.login("nope") is None
    session = sessions.login(TOKEN)
    assert session is not None and sessions.valid(session)
    assert not sessions.valid("forged") and not sessions.valid(None)
    now[0] = 11.0
    assert not sessions.valid(session)
    again = sessions.login(TOKEN)
    sessions.logout(again)
    assert not sessions.valid(again)


def test_listen_address() -> None:
    assert parse_listen("127.0.0.1:8090") == ("127.0.0.1", 8090)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("8090", "host:", "host:99999", ":80"):
        with pytest.raises(ConfigError, match="--listen must be HOST:PORT"):
            parse_listen(bad)


async def test_new_commits_without_a_known_latency_read_the_metrics_early() -> None:
    """A server's ``/metrics`` is read every 5 s; when its status shows commits on a
    partition whose latency the page does not know, at the next probe (2 s apart at
    most), so the first commits' latency shows at once."""
    from waltz_console.views import Snapshot

    collector = Collector("local:///nonexistent-console-test", http_urls=["http://s1"])
    loop = asyncio.get_running_loop()

    def status(hwm: int) -> dict[str, Any]:
        return {
            "role": "server",
            "server_id": 1,
            "partitions": [{"partition": 0, "high_water_mark": hwm}],
        }

    def shown(p99: float | None) -> None:
        collector.snapshot = Snapshot({}, [], [], [{"partition": 0, "commit_p99_ms": p99}], [])

    shown(None)
    assert not collector._commits_without_latency("http://s1", status(10))  # never read
    collector._marks_at_metrics["http://s1"] = {0: 10}
    collector.probes.metrics_read["http://s1"] = loop.time() - 3.0
    assert not collector._commits_without_latency("http://s1", status(10))  # no commit
    assert collector._commits_without_latency("http://s1", status(11))
    shown(4.0)
    assert not collector._commits_without_latency("http://s1", status(11))  # known
    shown(None)
    collector.probes.metrics_read["http://s1"] = loop.time()
    assert not collector._commits_without_latency("http://s1", status(11))  # read just now
