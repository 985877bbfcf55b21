"""Raw protocol clients of a system harness's partitions: one mounted on a partition's
owner (:class:`PartitionClient`), and a bulk read of the committed log (:func:`read_log`)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Sequence

from waltz_api import wire
from waltz_api.errors import WaltzError
from waltz_api.messages import (
    AppendRequest,
    ErrorResponse,
    FeedData,
    FlushRequest,
    FlushResponse,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    LockFailure,
    MountRequest,
    MountResponse,
    MountStatus,
    RangeReadRequest,
    RangeReadResponse,
)
from waltz_api.types import Lock, LockRequest, Record, ReqId
from waltz_conformance.suites.system.harness import RANGE_READ_TIMEOUT, TIMEOUT, SystemHarness
from waltz_server.server.testing import RawClient

_client_ids = itertools.count(1000)


def next_client_id() -> int:
    """A client id no other client of the harnesses in this process uses."""
    return next(_client_ids)


class PartitionClient:
    """A raw protocol client mounted on the current owner of one partition."""

    def __init__(self, harness: SystemHarness, partition: int, client_id: int) -> None:
        self.harness = harness
        self.partition = partition
        self.client_id = client_id
        self.raw: RawClient | None = None
        self.generation = -1
        self._seq = itertools.count(1)
        self._net = itertools.count(1)

    @classmethod
    async def connect(
        cls, harness: SystemHarness, partition: int, client_hwm: int | None = -1
    ) -> PartitionClient:
        """A client mounted at ``client_hwm`` (None: at the partition's high-water mark,
        so its feed holds only what commits from now on)."""
        client = cls(harness, partition, next_client_id())
        await client.mount(client_hwm)
        return client

    async def mount(self, client_hwm: int | None) -> None:
        assert self.harness.client_transport is not None
        server_id, endpoint, generation = await self.harness.owner(self.partition)
        if server_id < 0:
            raise WaltzError(f"partition {self.partition} has no owner")
        self.raw = await RawClient.connect(
            self.harness.client_transport, endpoint, f"client:{self.client_id}", timeout=10
        )
        self.generation = generation
        if client_hwm is None:
            await self.raw.send(HighWaterMarkRequest(self.rid()))
            answer = await self.raw.wait(HighWaterMarkResponse, timeout=TIMEOUT)
            client_hwm = answer[0].transaction_id
        await self.raw.send(MountRequest(self.rid(), client_hwm, next(self._net)))
        response = (await self.raw.wait(MountResponse, timeout=TIMEOUT))[0]
        if response.status is not MountStatus.READY:
            raise WaltzError(f"mount answered {response.status.name}")

    def rid(self, generation: int | None = None) -> ReqId:
        generation = self.generation if generation is None else generation
        return ReqId(self.client_id, generation, self.partition, next(self._seq))

    async def append(
        self,
        data: bytes,
        client_hwm: int,
        locks: Sequence[Lock] = (),
        generation: int | None = None,
    ) -> ReqId:
        assert self.raw is not None
        rid = self.rid(generation)
        request = AppendRequest(
            rid, client_hwm, LockRequest.from_locks(locks), 0, data, wire.checksum(data)
        )
        await self.raw.send(request)
        return rid

    async def flush(self) -> int:
        """The partition's high-water mark once every earlier append is decided."""
        assert self.raw is not None
        count = self.raw.counts[FlushResponse]
        await self.raw.send(FlushRequest(self.rid()))
        return (await self.raw.wait(FlushResponse, count + 1, timeout=TIMEOUT))[-1].transaction_id

    async def commit(self, payloads: Iterable[bytes], per_flush: int) -> int:
        """Append each of ``payloads`` (no locks), with a flush after every ``per_flush``
        of them and after the last; returns the high-water mark the last flush answered
        (-1 when there was nothing to append)."""
        high, pending = -1, 0
        for data in payloads:
            await self.append(data, -1)
            pending += 1
            if pending == per_flush:
                high, pending = await self.flush(), 0
        if pending:
            high = await self.flush()
        return high

    def lock_failures(self) -> dict[ReqId, int]:
        assert self.raw is not None
        return {f.req_id: f.transaction_id for f in self.raw.of(LockFailure)}

    def errors(self) -> list[ErrorResponse]:
        assert self.raw is not None
        return self.raw.of(ErrorResponse)

    async def feed_until(self, transaction_id: int) -> list[FeedData]:
        """The feed received so far, once it reached ``transaction_id``."""
        assert self.raw is not None
        for _ in range(int(TIMEOUT / 0.05)):
            feed = self.raw.of(FeedData)
            if feed and feed[-1].transaction_id >= transaction_id:
                return feed
            if transaction_id < 0:
                return feed
            await self.raw.changed(0.05)
        raise AssertionError(f"the feed never reached transaction {transaction_id}")

    async def committed(self, rid: ReqId, hwm: int) -> int | None:
        """The transaction id ``rid`` committed as (None if it did not), from the feed."""
        for data in await self.feed_until(hwm):
            if data.req_id == rid:
                return data.transaction_id
        return None

    async def close(self) -> None:
        if self.raw is not None:
            await self.raw.close()


async def read_log(harness: SystemHarness, partition: int) -> list[Record]:
    """The committed log of ``partition``, in bulk from its current owner (asked again
    when the partition moves meanwhile)."""
    failures: list[str] = []
    for _ in range(20):
        try:
            return await _read_log_once(harness, partition)
        except (WaltzError, TimeoutError, OSError) as exc:
            failures.append(f"{type(exc).__name__}: {exc}"[:200])
            await asyncio.sleep(0.5)
    raise AssertionError(f"could not read the log of partition {partition}: {failures[-3:]}")


async def _read_log_once(harness: SystemHarness, partition: int) -> list[Record]:
    assert harness.client_transport is not None
    _, endpoint, generation = await harness.owner(partition)
    client = await RawClient.connect(harness.client_transport, endpoint, "checker")
    try:
        records: list[Record] = []
        loop = asyncio.get_running_loop()
        for _ in range(100_000):
            request = RangeReadRequest(
                ReqId(999, generation, partition, len(records)), len(records), 500, 1 << 20
            )
            count, errors = client.counts[RangeReadResponse], client.counts[ErrorResponse]
            await client.send(request)
            # bounded well below TIMEOUT: a read sent to an owner that just lost the
            # partition is not answered, and the retry asks the new owner
            deadline = loop.time() + RANGE_READ_TIMEOUT
            next_check = loop.time() + 1.0
            while client.counts[RangeReadResponse] == count:
                if client.counts[ErrorResponse] > errors:
                    raise WaltzError(f"range read refused: {client.of(ErrorResponse)[-1]}")
                if client.closed or loop.time() > deadline:
                    raise WaltzError("no answer to a range read")
                if loop.time() > next_check:  # moved meanwhile: ask the new owner now
                    next_check = loop.time() + 1.0
                    if (await harness.owner(partition))[2] != generation:
                        raise WaltzError(f"partition {partition} moved during a range read")
                await client.changed(0.1)
            response = client.of(RangeReadResponse)[-1]
            records.extend(response.records)
            if not response.records or len(records) > response.high_water_mark:
                break
        return records
    finally:
        await client.close()
