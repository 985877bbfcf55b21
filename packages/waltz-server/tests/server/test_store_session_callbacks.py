"""Run to completion in the store session (issue 31): the write loops stay asleep while
appends are posted and their replies counted in callbacks, and a failure in a callback
fails its replica as the loop would. Written for the mutants that survived on the
changed lines (docs/simulation.md, "Mutation score")."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from fakes import FakeReplicaConnection
from test_partition import P, Stream, append, serving, settle, wait_until

from waltz_api.errors import TransportError
from waltz_api.types import Record
from waltz_server.server.replica import ReplicaConnection
from waltz_server.server.store import StoreConfig
from waltz_server.server.store_session import StoreSession, _Writer


async def test_the_write_loops_sleep_while_appends_commit_in_callbacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Run to completion: once the write loops wait, appends are posted and their
    replies counted in callbacks (``_send_waiting``, ``_replied``) and no loop is woken
    (each wakes only for a catch-up, a failure or its idle probe, 2 s here), whether the
    appends come one at a time or many in one loop iteration."""
    waits: list[str] = []
    original = _Writer.wait

    async def wait(self: _Writer, timeout: float) -> bool:
        waits.append(self.node)
        return await original(self, timeout)

    monkeypatch.setattr(_Writer, "wait", wait)
    async with serving() as (partition, _):
        stream = Stream()
        await partition.submit(append(data=b"zero"), stream)
        assert await settle(partition, stream) == 0
        session = partition.store.session
        assert session is not None
        writers = session._writers
        await wait_until(
            lambda: len(writers) == 3 and all(w.waiting for w in writers.values()),
            "the three write loops wait",
        )
        before = len(waits)
        for i in range(1, 6):  # one at a time: every reply comes before the next append
            await partition.submit(append(data=b"one %d" % i), stream)
            assert await settle(partition, stream) == i
        for i in range(6, 30):  # many in one loop iteration
            await partition.submit(append(data=b"many %d" % i), stream)
        assert await settle(partition, stream) == 29
        assert all(w.waiting for w in writers.values())
        assert waits[before:] == [], "a write loop was woken on the hot path"


async def test_a_batch_that_cannot_be_posted_in_a_callback_fails_its_replica_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica whose ``start_append`` raises when a callback posts it a batch (the
    records of a loop iteration, ``_send_waiting``; the next batch after a reply,
    ``_replied``) leaves the writers at once and is tried again, as when its write loop
    posts: not at its loop's next idle probe (60 s here), nor taking the other
    replicas' posts down with it."""
    held: list[tuple[FakeReplicaConnection, Sequence[Record], asyncio.Future[None]]] = []
    plan: list[str] = []  # what the next posts to a:1 do: "raise", "hold"
    original = FakeReplicaConnection.start_append

    def start_append(
        self: FakeReplicaConnection, records: Sequence[Record]
    ) -> asyncio.Future[None]:
        if self.node.name != "a:1" or not plan:
            return original(self, records)
        if plan.pop(0) == "raise":
            raise TransportError("a:1: the connection is closed")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        held.append((self, records, future))
        return future

    left: list[str] = []
    leave = StoreSession._leave

    def spy(
        self: StoreSession, node: str, connection: ReplicaConnection, cause: BaseException
    ) -> None:
        left.append(node)
        leave(self, node, connection, cause)

    monkeypatch.setattr(FakeReplicaConnection, "start_append", start_append)
    monkeypatch.setattr(StoreSession, "_leave", spy)
    config = StoreConfig(
        retry_initial=0.001, retry_max=0.02, idle_probe_interval=60.0, max_inflight_batches=1
    )
    async with serving(config) as (partition, _):
        stream = Stream()
        session = partition.store.session
        assert session is not None

        async def all_waiting() -> None:
            writers = session._writers
            await wait_until(
                lambda: len(writers) == 3 and all(w.waiting for w in writers.values()),
                "the three write loops wait",
            )

        await all_waiting()
        plan[:] = ["raise"]  # posted by _send_waiting
        await partition.submit(append(data=b"zero"), stream)
        assert await settle(partition, stream) == 0
        await wait_until(lambda: left == ["a:1"], "a:1 left")
        await all_waiting()  # a:1 back, caught up

        plan[:] = ["hold", "raise"]  # the second posted by _replied, after the first's reply
        await partition.submit(append(data=b"one"), stream)
        assert await settle(partition, stream) == 1
        await partition.submit(append(data=b"two"), stream)  # behind a:1's one in flight
        assert await settle(partition, stream) == 2
        assert len(held) == 1 and left == ["a:1"]
        connection, records, future = held[0]
        connection.node.partition(P).log.extend(records)
        future.set_result(None)
        await wait_until(lambda: left == ["a:1", "a:1"], "a:1 left again")
        await all_waiting()
        await partition.submit(append(data=b"three"), stream)
        assert await settle(partition, stream) == 3
