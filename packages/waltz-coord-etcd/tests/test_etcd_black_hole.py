"""A member that accepts connections and never answers (hung, or not serving yet) holds
neither a watch nor a request for longer than its bound: the client moves on to the next
member (the etcd side of the ZooKeeper handshake bound, test_zk_handshake_bound.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from waltz_api.errors import CoordinationUnavailableError
from waltz_conformance.servers import BlackHole
from waltz_conformance.servers.etcd import EtcdCluster
from waltz_coord_etcd.gateway import EtcdGateway, b64

pytestmark = [pytest.mark.timeout(120)]


async def test_a_watch_is_not_held_by_a_member_that_never_answers() -> None:
    hole = BlackHole()
    gateway = EtcdGateway([f"{hole.host}:{hole.port}"], request_timeout=1.0)
    await gateway.open()
    started = time.monotonic()
    try:
        with pytest.raises(CoordinationUnavailableError, match="accepted a watch stream"):
            async with asyncio.timeout(30):  # the test's own bound: today's code waited forever
                async for _ in gateway.stream("watch", {"create_request": {"key": b64("/a")}}):
                    pass
        elapsed = time.monotonic() - started
        assert elapsed < 10, f"the watch waited {elapsed:.1f}s on a member that never answers"
        assert hole.first_accept.is_set()
    finally:
        await gateway.close()
        hole.close()


@pytest.mark.system
async def test_a_read_moves_on_from_a_member_that_never_answers(
    etcd_cluster: EtcdCluster,
) -> None:
    """The first member named never answers: an idempotent request goes on to a real
    member after its share of the request timeout, and succeeds within that timeout."""
    etcd_cluster.ensure_all_running()
    hole = BlackHole()
    gateway = EtcdGateway(
        [f"{hole.host}:{hole.port}", etcd_cluster.endpoints[0]],
        request_timeout=6.0,
        connect_timeout=1.0,
    )
    await gateway.open()
    started = time.monotonic()
    try:
        answer = await gateway.call("kv/range", {"key": b64("/no-such-key")}, idempotent=True)
        elapsed = time.monotonic() - started
        assert "header" in answer  # etcd's answer, from the real member
        assert hole.first_accept.is_set(), "the black hole was not tried first"
        assert elapsed < 6.0, f"the read took {elapsed:.1f}s"
    finally:
        await gateway.close()
        hole.close()
