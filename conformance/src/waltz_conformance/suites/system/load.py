"""Load on a system harness: a :class:`Writer` per partition appending through faults,
and :func:`under_load`, the one way a test makes a change to the cluster while they run."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

from waltz_api import wire
from waltz_api.errors import WaltzError
from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FeedData,
    FlushRequest,
    FlushResponse,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    Message,
    MountRequest,
    MountResponse,
    MountStatus,
)
from waltz_api.types import LockRequest, ReqId
from waltz_conformance.suites.system.clients import next_client_id
from waltz_conformance.suites.system.harness import TIMEOUT, SystemHarness, wait_for
from waltz_server.server.testing import RawClient

M = TypeVar("M", bound=Message)


@dataclass
class Writer:
    """Appends to one partition at its current owner, reconnecting after faults.

    A transaction counts as acknowledged once the feed delivered it to its writer
    (the commit notification of Waltz). The writer's feed starts at the partition's
    high-water mark when it first connects (``base``): a test pays for what it
    writes, not for the log earlier tests left. Rounds of appends are paced
    (``pace`` seconds apart) so a fast in-process cluster does not grow logs that
    every later check reads whole."""

    harness: SystemHarness
    partition: int
    client_id: int = field(default_factory=next_client_id)
    sent: dict[ReqId, bytes] = field(default_factory=dict)
    feed: list[ReqId] = field(default_factory=list)
    """The feed of the partition from ``base + 1``, in order: feed[i] is transaction
    ``base + 1 + i``'s request id."""
    base: int | None = None
    """The partition's high-water mark before this writer's feed (None: not yet known)."""
    pace: float = 0.02
    reconnects: int = 0
    reasons: list[str] = field(default_factory=list)
    not_committed: set[ReqId] = field(default_factory=set)
    """Appends the server answered NOT_COMMITTED (their store session ended first)."""
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    _seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _net: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def acknowledged(self) -> set[ReqId]:
        return {r for r in self.feed if r.client_id == self.client_id}

    @property
    def first(self) -> int:
        """The first transaction id of the feed."""
        return (-1 if self.base is None else self.base) + 1

    @property
    def last(self) -> int:
        """The last transaction id the feed delivered (``base`` when none yet)."""
        return self.first + len(self.feed) - 1

    def _consume(self, client: RawClient) -> None:
        messages = list(client.received)
        client.received.clear()
        for message in messages:
            if isinstance(message, FeedData):
                assert message.transaction_id == self.last + 1, "the feed skipped or repeated"
                self.feed.append(message.req_id)
            elif isinstance(message, ErrorResponse):
                if message.code is ErrorCode.NOT_COMMITTED and message.req_id in self.sent:
                    # decided: never committed (check_invariants holds the server to it)
                    self.not_committed.add(message.req_id)
                    continue
                raise WaltzError(f"server refused: {message.code.name} {message.message}")

    async def _wait(self, client: RawClient, kind: type[M], count: int, generation: int) -> list[M]:
        """``client.wait`` (30 s at most), giving up early when the partition moved
        meanwhile: its old owner no longer answers, the new one will."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        while True:
            try:
                return await client.wait(kind, count, timeout=1.0)
            except TimeoutError:
                if loop.time() > deadline:
                    raise
            _, _, now = await self.harness.owner(self.partition)
            if now != generation:
                raise WaltzError(f"partition {self.partition} moved (generation {now})")

    async def _find_base(self, client: RawClient, generation: int) -> None:
        count = client.counts[HighWaterMarkResponse]
        await client.send(HighWaterMarkRequest(self.rid(generation)))
        response = (await self._wait(client, HighWaterMarkResponse, count + 1, generation))[-1]
        self.base = response.transaction_id
        client.received.clear()

    async def run(self) -> None:
        while not self.stop.is_set():
            client: RawClient | None = None
            try:
                server_id, endpoint, generation = await self.harness.owner(self.partition)
                if server_id < 0:
                    await asyncio.sleep(0.2)
                    continue
                assert self.harness.client_transport is not None
                client = await RawClient.connect(
                    self.harness.client_transport, endpoint, f"client:{self.client_id}", timeout=5
                )
                if self.base is None:
                    await self._find_base(client, generation)
                await client.send(MountRequest(self.rid(generation), self.last, next(self._net)))
                response = (await self._wait(client, MountResponse, 1, generation))[0]
                if response.status is not MountStatus.READY:
                    raise WaltzError(f"mount answered {response.status.name}")
                self._consume(client)
                while not self.stop.is_set():
                    for _ in range(20):
                        rid = self.rid(generation)
                        data = f"p{self.partition}-c{self.client_id}-{rid.seq_num}".encode()
                        self.sent[rid] = data
                        await client.send(
                            AppendRequest(rid, -1, LockRequest(), 1, data, wire.checksum(data))
                        )
                    flushes = client.counts[FlushResponse]
                    await client.send(FlushRequest(self.rid(generation)))
                    await self._wait(client, FlushResponse, flushes + 1, generation)
                    self._consume(client)
                    if self.pace > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.stop.wait(), self.pace)
                await self._drain(client, generation)
            except (WaltzError, TimeoutError, OSError) as exc:
                self.reconnects += 1
                self.reasons.append(f"{type(exc).__name__}: {exc}"[:200])
                await asyncio.sleep(0.3)
                if self.reconnects > 200:
                    raise AssertionError(f"writer {self.partition} keeps failing: {exc}") from exc
            finally:
                if client is not None:
                    await client.close()

    async def _drain(self, client: RawClient, generation: int) -> None:
        """Until the feed delivered everything the partition committed."""
        flushes = client.counts[FlushResponse]
        await client.send(FlushRequest(self.rid(generation)))
        mark = (await self._wait(client, FlushResponse, flushes + 1, generation))[-1].transaction_id
        for _ in range(600):
            self._consume(client)
            if self.last >= mark:
                return
            await client.changed(0.05)
        raise AssertionError("the feed never reached the flushed high-water mark")

    def rid(self, generation: int) -> ReqId:
        return ReqId(self.client_id, generation, self.partition, next(self._seq))


class Writers:
    """A writer per partition, run as tasks; ``progress`` waits for acknowledgements."""

    def __init__(self, harness: SystemHarness) -> None:
        self.harness = harness
        self.writers = [Writer(harness, p) for p in range(harness.num_partitions)]
        self.tasks: list[asyncio.Task[None]] = []
        self.stopped = False

    def start(self) -> None:
        self.tasks = [asyncio.create_task(w.run()) for w in self.writers]

    async def progress(self, count: int, timeout: float, what: str) -> None:
        targets = [len(w.acknowledged) + count for w in self.writers]

        async def reached() -> bool:
            for task in self.tasks:
                if task.done():
                    task.result()
            return all(len(w.acknowledged) >= t for w, t in zip(self.writers, targets, strict=True))

        try:
            await wait_for(reached, timeout, what)
        except AssertionError as exc:
            state = [(w.partition, len(w.acknowledged), w.reasons[-3:]) for w in self.writers]
            raise AssertionError(f"{exc}: {state}") from None

    async def stop(self) -> None:
        """Stop the writers once each drained its feed (everything its partition
        committed); raises what a writer failed with. Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        for writer in self.writers:
            writer.stop.set()
        results = await asyncio.wait_for(
            asyncio.gather(*self.tasks, return_exceptions=True), TIMEOUT
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def under_load(harness: SystemHarness, *, heal: bool = True) -> AsyncIterator[Writers]:
    """Run the body while a writer appends to every partition: the one shape of a
    change made to the cluster under load::

        async with under_load(harness) as writers:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            await harness.kill_storage_node(2)
            await writers.progress(30, TIMEOUT, "progress with a node down")
        await check_invariants(harness, writers.writers)

    On leaving the body the writers stop after draining their feeds (the body may
    stop them itself, to check before it ends); on an error they are cancelled. Either
    way, with ``heal``, every killed storage node and server is then restarted
    (:meth:`SystemHarness.heal`), so the cluster is whole for the checks that follow.
    """
    writers = Writers(harness)
    writers.start()
    try:
        yield writers
        await writers.stop()
    except BaseException:
        await writers.cancel()
        raise
    finally:
        if heal:
            await harness.heal()
