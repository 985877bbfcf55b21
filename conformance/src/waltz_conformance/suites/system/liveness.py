"""Liveness on the append path (DESIGN.md section 5, "what must always happen"):
every append gets a true answer within a bound, a minority of storage failing stops
nothing, and reads wait for a recovery instead of failing.

Bounds are generous enough to hold on a loaded 2-core machine, and each test prints
what it measured."""

from __future__ import annotations

import asyncio
import logging

import pytest

from waltz_api.messages import (
    ErrorCode,
    ErrorResponse,
    FeedData,
    FlushRequest,
    FlushResponse,
    TransactionDataRequest,
    TransactionDataResponse,
)
from waltz_api.types import ReqId
from waltz_conformance.suites.system.checks import check_invariants, check_replicas_converge
from waltz_conformance.suites.system.clients import PartitionClient, next_client_id, read_log
from waltz_conformance.suites.system.harness import TIMEOUT, SystemHarness, start_all, wait_for
from waltz_conformance.suites.system.load import Writers, under_load
from waltz_server.server.testing import RawClient

log = logging.getLogger(__name__)

DECISION_BOUND = 30.0
"""Seconds from the storage nodes' restart until every append in flight is decided."""
GAP_BOUND = 3.0
"""The longest a writer may go without a commit while one storage node dies (the
coordination session timeout is 10 s; a new store session took 4-6 s)."""


class LivenessSuite:
    """Appends answered, minority faults harmless, reads waiting for recovery."""

    pytestmark = pytest.mark.asyncio(loop_scope="class")

    async def test_appends_in_flight_when_every_storage_node_dies_are_each_decided(
        self, harness: SystemHarness
    ) -> None:
        """A power cut of the whole storage tier with appends in flight: once it returns
        every append is decided, committed (the feed carries it) or answered
        NOT_COMMITTED (and never in the log); the flush sent behind them answers only
        after all of them."""
        client = await PartitionClient.connect(harness, 0, client_hwm=None)
        try:
            assert client.raw is not None
            await asyncio.gather(
                *(harness.kill_storage_node(i) for i in range(harness.num_storage_nodes))
            )
            # sent before the server can notice: in flight to storage nodes that are gone
            rids = [await client.append(b"in-flight-%d" % i, -1) for i in range(40)]
            flush = client.rid()
            await client.raw.send(FlushRequest(flush))
            await start_all(harness.storage[: harness.num_storage_nodes])
            loop = asyncio.get_running_loop()
            restarted = loop.time()
            raw = client.raw

            def decisions() -> dict[ReqId, int]:
                """Index in the received messages of each rid's decision."""
                found: dict[ReqId, int] = {}
                for index, message in enumerate(raw.received):
                    if _decides(message, rids):
                        found.setdefault(message.req_id, index)  # type: ignore[attr-defined]
                return found

            async def all_decided() -> bool:
                return len(decisions()) == len(rids) and bool(raw.of(FlushResponse))

            await wait_for(all_decided, DECISION_BOUND, "every append in flight to be decided")
            elapsed = loop.time() - restarted
            log.warning(
                "%s: appends in flight decided %.2f s after the restart", harness.name, elapsed
            )
            # the flush covers them all: every one that committed is at or below its
            # mark (the feed may deliver it after the flush answer), every refusal
            # came before it on the stream
            flushed = raw.of(FlushResponse)[0].transaction_id
            flushed_at = next(i for i, m in enumerate(raw.received) if isinstance(m, FlushResponse))
            assert all(m.transaction_id <= flushed for m in raw.of(FeedData) if m.req_id in rids)
            assert all(
                index < flushed_at
                for index, m in enumerate(raw.received)
                if isinstance(m, ErrorResponse)
            ), "the flush answered before an append was decided"
            unexpected = [m for m in raw.of(ErrorResponse) if m.code is not ErrorCode.NOT_COMMITTED]
            assert not unexpected, unexpected
            # the answers are true
            records = await read_log(harness, 0)
            in_log = {r.req_id for r in records}
            refused = {m.req_id for m in raw.of(ErrorResponse)}
            committed = {m.req_id: m.transaction_id for m in raw.of(FeedData)}
            for rid in rids:
                if rid in refused:
                    assert rid not in in_log, f"{rid} answered NOT_COMMITTED but committed"
                else:
                    assert records[committed[rid]].req_id == rid
        finally:
            await client.close()

    async def test_a_fetch_during_the_new_owners_recovery_waits_for_it(
        self, harness: SystemHarness
    ) -> None:
        """The owner dies while a majority of storage is down: the new owner cannot
        recover yet, and a fetch of a committed transaction waits for its recovery
        instead of answering that it is not committed."""
        client = await PartitionClient.connect(harness, 0, client_hwm=None)
        try:
            rid = await client.append(b"fetch me", -1)
            transaction_id = await client.committed(rid, await client.flush())
            assert transaction_id is not None
        finally:
            await client.close()
        down = [1, 2]
        for index in down:
            await harness.kill_storage_node(index)
        await harness.kill_owner(0)
        fetcher: RawClient | None = None
        try:
            _, endpoint, generation = await harness.owner(0)
            assert harness.client_transport is not None
            fetcher = await RawClient.connect(
                harness.client_transport, endpoint, f"client:{next_client_id()}"
            )
            await fetcher.send(
                TransactionDataRequest(ReqId(next_client_id(), generation, 0, 1), transaction_id)
            )
            await fetcher.changed(0.3)
            assert not fetcher.of(ErrorResponse), fetcher.of(ErrorResponse)
            assert all(r.success for r in fetcher.of(TransactionDataResponse))
            await start_all([harness.storage[i] for i in down])
            answer = (await fetcher.wait(TransactionDataResponse, timeout=TIMEOUT))[0]
            assert answer.success, answer.error
            assert answer.data == b"fetch me"
        finally:
            if fetcher is not None:
                await fetcher.close()
            await harness.heal()

    async def test_one_storage_node_killed_under_load_stops_nothing(
        self, harness: SystemHarness
    ) -> None:
        """kill -9 of one storage node under steady load: commits go on in the same
        store session with no gap beyond normal latency; the node returns, rejoins the
        session and ends with a byte-identical copy."""
        victim = harness.num_storage_nodes - 1
        async with under_load(harness) as writers:
            await writers.progress(30, TIMEOUT, "first acknowledgements")
            sessions = [await harness.session_id(p) for p in range(harness.num_partitions)]
            sampler = asyncio.create_task(_longest_gap(writers))
            await harness.kill_storage_node(victim)
            await writers.progress(100, TIMEOUT, "progress with a storage node down")
            sampler.cancel()
            gap = await _gap(sampler)
            log.warning("%s: longest gap between commits: %.2f s", harness.name, gap)
            assert gap < GAP_BOUND, f"commits stopped for {gap:.2f} s with one storage node down"
            await harness.restart_storage_node(victim)
            await writers.progress(50, TIMEOUT, "progress after the node returned")
            assert [
                await harness.session_id(p) for p in range(harness.num_partitions)
            ] == sessions, "a minority fault started a new store session"
        await check_invariants(harness, writers.writers)
        await check_replicas_converge(harness, range(harness.num_partitions))


async def _longest_gap(writers: Writers) -> float:
    """Sample the writers' acknowledgements until cancelled; the task's result is the
    longest time no partition's writer got one."""
    loop = asyncio.get_running_loop()
    counts = [len(w.acknowledged) for w in writers.writers]
    last = [loop.time()] * len(counts)
    longest = 0.0
    try:
        while True:
            await asyncio.sleep(0.02)
            now = loop.time()
            for index, writer in enumerate(writers.writers):
                count = len(writer.acknowledged)
                if count != counts[index]:
                    counts[index] = count
                    last[index] = now
                longest = max(longest, now - last[index])
    except asyncio.CancelledError:
        return longest


async def _gap(sampler: asyncio.Task[float]) -> float:
    try:
        return await sampler
    except asyncio.CancelledError:
        return float("inf")


def _decides(message: object, rids: list[ReqId]) -> bool:
    """Whether ``message`` decides one of ``rids``: its feed entry, or NOT_COMMITTED."""
    if isinstance(message, FeedData):
        return message.req_id in rids
    return (
        isinstance(message, ErrorResponse)
        and message.req_id in rids
        and message.code is ErrorCode.NOT_COMMITTED
    )
