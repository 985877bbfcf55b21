"""Randomized protocol faults against a LOG MODEL PEER (not a server).

The peer keeps a list as its "log" and follows the protocol's ordering promises:
each message is handled as it is received, a commit is streamed to the
partition's mounted connection, a mount streams the log after the client's
high-water mark and then READY. It plays faults at random (seeded): appends
lost, lock failures, connections dropped. No storage, no lock table, no
replication: it checks the CLIENT's promises under faults, nothing more:

- every submission resolves once, committed (no context is lost);
- no context is committed twice (a context is re-executed only after its
  append was proven failed);
- the application receives the log in order, each transaction once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
from client_protocol_peer import ProtocolTestPeer
from client_support import Cluster, Ctx, RecordingApp

from waltz_api.contracts.transport import Connection
from waltz_api.errors import TransportError
from waltz_api.messages import (
    AppendRequest,
    FeedData,
    LockFailure,
    MountRequest,
    MountResponse,
    MountStatus,
)
from waltz_api.types import ReqId
from waltz_api.wire import ProtocolConnection, Role
from waltz_client import AsyncWaltzClient

pytestmark = pytest.mark.timeout(120)


class LogModelPeer(ProtocolTestPeer):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng
        self.log: list[tuple[ReqId, int]] = []
        self.subscriber: tuple[Connection, ProtocolConnection] | None = None
        self.dropped = 0
        self.lost = 0
        self.lock_failures = 0

    async def _serve(self, conn: Connection) -> None:
        proto = ProtocolConnection(Role.ACCEPTOR, sender="log-model-peer")
        try:
            proto.receive_frame(await conn.recv())
            await conn.send(proto.send(proto.hello_response()))
            while True:
                message = proto.receive_frame(await conn.recv())
                if isinstance(message, MountRequest):
                    self.subscriber = (conn, proto)
                    start = message.client_high_water_mark + 1
                    frames = [
                        proto.send(FeedData(r, t, h))
                        for t, (r, h) in enumerate(self.log)
                        if t >= start
                    ]
                    top = len(self.log) - 1
                    frames.append(proto.send(MountResponse(message.req_id, MountStatus.READY, top)))
                    await conn.send_many(frames)
                elif isinstance(message, AppendRequest):
                    await self._append(conn, proto, message)
        except TransportError:
            return

    async def _append(
        self, conn: Connection, proto: ProtocolConnection, message: AppendRequest
    ) -> None:
        roll = self.rng.random()
        if roll < 0.15:
            self.lost += 1  # lost in the server: no answer at all
            return
        if roll < 0.25 and self.log:
            self.lock_failures += 1
            failing = self.rng.randrange(len(self.log))
            await conn.send(proto.send(LockFailure(message.req_id, failing)))
            return
        self.log.append((message.req_id, message.header))
        if self.subscriber is not None:
            sub_conn, sub_proto = self.subscriber
            with contextlib.suppress(TransportError):
                await sub_conn.send(
                    sub_proto.send(FeedData(message.req_id, len(self.log) - 1, message.header))
                )

    async def chaos(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.rng.uniform(0.005, 0.04))
            if self.connections or self.subscriber is not None:
                self.dropped += 1
                self.subscriber = None
                await self.transport.close()  # every connection, as a crash would
                self.transport = type(self.transport)(self.transport.options)
                self._listener = await self.transport.listen(self.endpoint, self._serve)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_faults_never_lose_or_duplicate_a_submission(cluster: Cluster, seed: int) -> None:
    rng = random.Random(seed)
    peer = LogModelPeer(rng)
    await peer.start()
    await cluster.assign(0, peer)
    app = RecordingApp()
    stop = asyncio.Event()
    config = cluster.config(partitions=[0], max_concurrent_transactions=8, retry_interval=0.02)
    chaos: asyncio.Task[None] | None = None
    try:
        async with AsyncWaltzClient(app, config) as client:
            chaos = asyncio.get_running_loop().create_task(peer.chaos(stop))
            contexts = [Ctx(header=i) for i in range(300)]
            results = await asyncio.wait_for(
                asyncio.gather(*(client.submit(c) for c in contexts)), 90
            )
            stop.set()
            await chaos
            chaos = None
            assert all(r.committed for r in results)
            # each context committed exactly once, at the id its result names
            headers = [h for _, h in peer.log]
            assert [headers[r.transaction_id] for r in results] == list(range(len(contexts)))
            assert sorted(headers) == list(range(len(contexts))), "lost or duplicated"
            # the application got the log, in order, once
            deadline = asyncio.get_running_loop().time() + 20
            while app.hwm.get(0, -1) < len(peer.log) - 1:
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.02)
            assert [(t, h) for _, t, h in app.applied] == list(enumerate(headers))
            for ctx in contexts:
                assert ctx.events.count(("completion", True)) == 1
                assert ctx.events[-1] == ("completion", True)
    finally:
        stop.set()
        if chaos is not None:
            chaos.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await chaos
        await peer.close()
    # the faults did happen
    stats = (peer.dropped, peer.lost, peer.lock_failures)
    assert peer.dropped >= 1 and peer.lost > 0 and peer.lock_failures > 0, stats
