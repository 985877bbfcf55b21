"""The store state a server's ``/status`` reports (``waltz console`` shows it), on
in-process storage nodes: undecidable while an offline replica could change the last
session's closing mark, writable once recovered."""

from __future__ import annotations

import asyncio

from test_store import NODES, TIMEOUT, Cluster, cluster, preload, write_metadata

from waltz_api.types import UNRESOLVED
from waltz_server.server.main import store_state
from waltz_server.server.voting import Outcome

A, B, C = NODES
__all__ = ["cluster"]  # the fixture, re-exported for pytest


async def test_undecidable_while_a_replica_that_could_decide_is_offline(cluster: Cluster) -> None:
    await write_metadata(cluster, 3, {n: (3, UNRESOLVED) for n in NODES})
    preload(cluster.nodes[A], 12, 3, 4)
    preload(cluster.nodes[B], 9, 3, 4)
    preload(cluster.nodes[C], 7, 3, 4)
    cluster.nodes[C].append_delay = 1000.0  # c cannot catch up: a alone holds 9..11
    cluster.nodes[B].crash()
    store = cluster.store(seed=1)
    assert store_state(store) == "recovering"  # no session yet
    await store.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + TIMEOUT
        while store_state(store) != "undecidable":
            assert loop.time() < deadline, f"state {store_state(store)!r}, not undecidable"
            await asyncio.sleep(0.01)
        session = store.session
        assert session is not None and session.recovery.outcome is Outcome.UNDECIDABLE
        assert not store.ready
    finally:
        await store.close()
    cluster.nodes[C].append_delay = 0.0
    cluster.nodes[B].restart()
    second = cluster.store(seed=2)
    await second.start()
    try:
        await second.wait_ready(TIMEOUT)
        assert store_state(second) == "writable"
    finally:
        await second.close()
