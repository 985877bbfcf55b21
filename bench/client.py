"""The client's own cost: feed consumption and submissions, beside the raw protocol.

There is no Waltz server here (it is not ready yet): the far end is a scripted
*echo peer* on real ZeroMQ loopback sockets in the same process and loop. It
streams FeedData on a mount and answers every AppendRequest at once with the
FeedData that "commits" it, and every TransactionDataRequest with 100 bytes.
So the figures are the client library's overhead (codec, transport, monitor,
callbacks), an upper bound of what it can do with a real server.

1. Feed consumption, transactions/s: headers only (plain callbacks on the
   callback thread; async callbacks on the loop), and with data fetched lazily
   per transaction (one RPC round trip each, then cached).
2. Submit throughput through the client (200 in flight per partition), three ways
   (:data:`APIS`: ``enqueue``, a task each; ``submit_nowait``, a future each;
   ``submit_many``, a window at a time), p50/p99 latency of one submit, beside the raw
   protocol (append requests pipelined by hand over a ProtocolConnection, same
   window) in the same run.
3. With ``--real``: the same submit and feed cases against the real server in
   this process (``local`` coordination, three StorageNodes on the fs engine with
   real fsync, ZeroMQ loopback, the server's default hwm-array lock table).
Also printed: peak RSS. Figures only; never pass/fail.

    .venv/bin/python bench/client.py [--feed 50000] [--submits 20000] [--real]
        [--processes] [--window 200]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import logging
import resource
import tempfile
import time
from pathlib import Path

from waltz_api.cluster import coordination_from_uri
from waltz_api.contracts.transport import Connection, Transport
from waltz_api.errors import TransportError
from waltz_api.messages import (
    AppendRequest,
    FeedData,
    MountRequest,
    MountResponse,
    MountStatus,
    TransactionDataRequest,
    TransactionDataResponse,
)
from waltz_api.plugins import get_registry
from waltz_api.types import LockRequest, ReqId
from waltz_api.wire import ProtocolConnection, Role, checksum, encode_feed_data
from waltz_client import (
    AsyncWaltzClient,
    ClientConfig,
    SubmissionResult,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_server.cluster_admin import ClusterAdmin

DATA = bytes(range(100))
WINDOW = 200


class EchoPeer:
    """Scripted protocol peer: commits every append at once (not a server)."""

    def __init__(self, feed_length: int) -> None:
        self.transport: Transport = get_registry().get("transport", "zmq").factory({})
        self.feed_length = feed_length
        self.next_id = 0
        self.endpoint = ""

    async def start(self) -> None:
        listener = await self.transport.listen("tcp://127.0.0.1:0", self._serve)
        self.endpoint = listener.endpoint

    async def _serve(self, conn: Connection) -> None:
        proto = ProtocolConnection(Role.ACCEPTOR, sender="bench-echo-peer")
        try:
            proto.receive_frame(await conn.recv())
            await conn.send(proto.send(proto.hello_response()))
            while True:
                message = proto.receive_frame(await conn.recv())
                if isinstance(message, MountRequest):
                    await self._mount(conn, proto, message)
                elif isinstance(message, AppendRequest):
                    tid = self.next_id
                    self.next_id += 1
                    await conn.send(proto.send(FeedData(message.req_id, tid, message.header)))
                elif isinstance(message, TransactionDataRequest):
                    await conn.send(
                        proto.send(
                            TransactionDataResponse(
                                message.req_id, message.transaction_id, True, DATA, checksum(DATA)
                            )
                        )
                    )
        except TransportError:
            return

    async def _mount(self, conn: Connection, proto: ProtocolConnection, m: MountRequest) -> None:
        start = m.client_high_water_mark + 1
        other = ReqId(10**6, m.req_id.generation, m.req_id.partition_id, 1)
        for chunk in range(start, self.feed_length, 1000):
            end = min(chunk + 1000, self.feed_length)
            await conn.send_many(encode_feed_data(FeedData(other, t, 0) for t in range(chunk, end)))
        self.next_id = max(self.next_id, self.feed_length)
        top = self.next_id - 1
        await conn.send(proto.send(MountResponse(m.req_id, MountStatus.READY, top)))

    async def close(self) -> None:
        await self.transport.close()


class Counting(WaltzClientCallbacks):
    def __init__(self, target: int, fetch: bool) -> None:
        self.hwm = -1
        self.target = target
        self.fetch = fetch
        self.done = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    def apply_transaction(self, transaction: Transaction) -> None:
        if self.fetch:
            transaction.get_data()
        self.hwm = transaction.transaction_id
        if self.hwm >= self.target:
            self.loop.call_soon_threadsafe(self.done.set)


class AsyncCounting(Counting):
    async def client_high_water_mark(self, partition_id: int) -> int:  # type: ignore[override]
        return self.hwm

    async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        if self.fetch:
            await transaction.fetch_data()
        self.hwm = transaction.transaction_id
        if self.hwm >= self.target:
            self.done.set()


class Append(TransactionContext):
    """A plain ``execute``: runs on the callback thread (one thread hop per attempt)."""

    def partition_id(self, num_partitions: int) -> int:
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data(DATA)
        return True


class AsyncAppend(Append):
    """An ``async def execute``: runs on the event loop."""

    async def execute(self, builder: TransactionBuilder) -> bool:  # type: ignore[override]
        builder.set_data(DATA)
        return True


async def make_cluster(root: Path, endpoint: str) -> str:
    uri = f"local://{root}?root=/bench"
    coordination = coordination_from_uri(uri)
    await coordination.start()
    try:
        metadata = ClusterAdmin(coordination)
        await metadata.create_cluster(num_partitions=1, num_replicas=1, storage_nodes=["s:1"])
        current = await metadata.partition_assignment(0)
        await metadata.assign_partition(0, 1, endpoint, expected_version=current.version)
    finally:
        await coordination.close()
    return uri


async def feed_case(n: int, *, fetch: bool, use_async: bool, prefetch: bool = False) -> float:
    peer = EchoPeer(n)
    await peer.start()
    with tempfile.TemporaryDirectory() as tmp:
        uri = await make_cluster(Path(tmp), peer.endpoint)
        callbacks = (AsyncCounting if use_async else Counting)(n - 1, fetch)
        started = time.perf_counter()
        config = ClientConfig(uri, transport="zmq", prefetch_data=prefetch)
        async with AsyncWaltzClient(callbacks, config):
            await asyncio.wait_for(callbacks.done.wait(), 600)
            elapsed = time.perf_counter() - started
    await peer.close()
    return n / elapsed


APIS = ("enqueue", "nowait", "many")
"""How the cases submit: ``enqueue`` (a task each, ``max_concurrent_transactions`` the
window), ``nowait`` (``submit_nowait``: a future each, the next one submitted from the
done callback of the last, no task per transaction), ``many`` (``submit_many`` of a
window's transactions at a time, each batch waited for)."""


async def drive(
    client: AsyncWaltzClient,
    context: type[Append],
    n: int,
    window: int,
    *,
    api: str,
    latencies: list[float],
) -> None:
    """``n`` submissions through ``client``, ``window`` in flight, as ``api`` says."""
    loop = asyncio.get_running_loop()
    if api == "many":
        for start in range(0, n, window):
            t0 = loop.time()
            results = await client.submit_many([context() for _ in range(min(window, n - start))])
            elapsed = loop.time() - t0
            for result in results:
                if isinstance(result, BaseException):
                    raise result
                latencies.append(elapsed)
        return
    if api == "nowait":
        finished = loop.create_future()
        state = {"sent": 0, "done": 0}

        def submit_next() -> None:
            state["sent"] += 1
            future = client.submit_nowait(context())
            future.add_done_callback(functools.partial(settled, loop.time()))

        def settled(t0: float, future: asyncio.Future[SubmissionResult]) -> None:
            latencies.append(loop.time() - t0)
            if future.exception() is not None and not finished.done():
                finished.set_exception(future.exception())  # type: ignore[arg-type]
            state["done"] += 1
            if state["sent"] < n:
                submit_next()
            elif state["done"] == n and not finished.done():
                finished.set_result(None)

        for _ in range(min(window, n)):
            submit_next()
        await finished
        return
    # as an application would: it keeps the submissions in flight, not every one
    in_flight: set[asyncio.Task[SubmissionResult]] = set()
    for _ in range(n):
        t0 = loop.time()
        task = await client.enqueue(context())
        task.add_done_callback(functools.partial(_record, latencies, loop, t0))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    while in_flight:
        await asyncio.gather(*in_flight)


async def submit_case(
    n: int, context: type[Append], api: str = "enqueue"
) -> tuple[float, list[float]]:
    peer = EchoPeer(0)
    await peer.start()
    latencies: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        uri = await make_cluster(Path(tmp), peer.endpoint)
        callbacks = AsyncCounting(n - 1, False)
        config = ClientConfig(uri, transport="zmq", max_concurrent_transactions=WINDOW)
        async with AsyncWaltzClient(callbacks, config) as client:
            started = time.perf_counter()
            await drive(client, context, n, WINDOW, api=api, latencies=latencies)
            elapsed = time.perf_counter() - started
    await peer.close()
    return n / elapsed, latencies


async def raw_case(n: int, endpoint: str | None = None, generation: int = 0) -> float:
    """The same appends without the client: hand-made requests, WINDOW in flight (to the
    echo peer, or to ``endpoint``: the real server). Counted done when the feed carries
    them (the hand-made client id is far from any allocated one)."""
    peer = None
    if endpoint is None:
        peer = EchoPeer(0)
        await peer.start()
        endpoint = peer.endpoint
    raw_id = 10**6
    transport: Transport = get_registry().get("transport", "zmq").factory({})
    conn = await transport.connect(endpoint)
    proto = ProtocolConnection(Role.INITIATOR, sender=f"client:{raw_id}")
    await conn.send(proto.start_handshake())
    proto.receive_frame(await conn.recv())
    await conn.send(proto.send(MountRequest(ReqId(raw_id, generation, 0, 0), 10**9, 1)))
    credit = asyncio.Semaphore(WINDOW)
    mounted = asyncio.Event()
    done = asyncio.Event()
    received = 0

    async def reader() -> None:
        nonlocal received
        while received < n:
            message = proto.receive_frame(await conn.recv())
            if isinstance(message, MountResponse):
                if message.status is not MountStatus.READY:  # CLIENT_AHEAD: mount at the top
                    await conn.send(
                        proto.send(
                            MountRequest(
                                ReqId(raw_id, generation, 0, 1), message.high_water_mark, 1
                            )
                        )
                    )
                    continue
                mounted.set()
            elif isinstance(message, FeedData) and message.req_id.client_id == raw_id:
                received += 1
                credit.release()
        done.set()

    task = asyncio.get_running_loop().create_task(reader())
    await mounted.wait()
    started = time.perf_counter()
    for seq in range(2, n + 2):
        await credit.acquire()
        await conn.send(
            proto.send(
                AppendRequest(
                    ReqId(raw_id, generation, 0, seq), -1, LockRequest(), 0, DATA, checksum(DATA)
                )
            )
        )
    await done.wait()
    elapsed = time.perf_counter() - started
    await task
    await transport.close()
    if peer is not None:
        await peer.close()
    return n / elapsed


class RealCluster:
    """An in-process cluster of real components (see the module docstring)."""

    async def start(self, root: Path) -> str:
        from waltz_dev.inprocess import InProcessCluster

        self.cluster = InProcessCluster(root, log_level="WARNING")
        await self.cluster.start()
        assert self.cluster.coordination is not None
        self.coordination = self.cluster.coordination
        self.uri = self.cluster.coordination_uri
        return self.uri

    async def stop(self) -> None:
        await self.cluster.close()


async def client_throughput(
    uri: str, context: type[Append], n: int, window: int | None = None, api: str = "enqueue"
) -> tuple[float, list[float], float]:
    """``n`` submissions through the client, ``window`` in flight: tx/s, latencies, and
    this process's CPU seconds per transaction."""
    latencies: list[float] = []
    callbacks = AsyncCounting(10**12, False)
    window = WINDOW if window is None else window
    config = ClientConfig(uri, transport="zmq", partitions=[0], max_concurrent_transactions=window)
    async with AsyncWaltzClient(callbacks, config) as client:
        await client.submit(context())  # mounted
        cpu = time.process_time()
        started = time.perf_counter()
        await drive(client, context, n, window, api=api, latencies=latencies)
        rate = n / (time.perf_counter() - started)
        cpu = (time.process_time() - cpu) / n
    return rate, latencies, cpu


async def client_one_at_a_time(uri: str, context: type[Append], n: int) -> list[float]:
    """K=1: one submission at a time; the latency of each."""
    config = ClientConfig(uri, transport="zmq", partitions=[0])
    latencies: list[float] = []
    async with AsyncWaltzClient(AsyncCounting(10**12, False), config) as client:
        await client.submit(context())
        for _ in range(n):
            t0 = time.perf_counter()
            await client.submit(context())
            latencies.append(time.perf_counter() - t0)
    return latencies


async def raw_one_at_a_time(endpoint: str, generation: int, n: int) -> list[float]:
    """K=1 with the raw protocol: one append at a time, latency until its FeedData (the
    floor: the network hops and one round of fdatasync on the storage nodes)."""
    raw_id = 2 * 10**6
    transport: Transport = get_registry().get("transport", "zmq").factory({})
    conn = await transport.connect(endpoint)
    proto = ProtocolConnection(Role.INITIATOR, sender=f"client:{raw_id}")
    await conn.send(proto.start_handshake())
    proto.receive_frame(await conn.recv())
    await conn.send(proto.send(MountRequest(ReqId(raw_id, generation, 0, 0), 10**9, 1)))
    while True:  # CLIENT_AHEAD tells the mark: mount there
        message = proto.receive_frame(await conn.recv())
        if isinstance(message, MountResponse):
            if message.status is MountStatus.READY:
                break
            mark = message.high_water_mark
            await conn.send(proto.send(MountRequest(ReqId(raw_id, generation, 0, 1), mark, 1)))
    latencies = []
    for seq in range(2, n + 2):
        rid = ReqId(raw_id, generation, 0, seq)
        t0 = time.perf_counter()
        await conn.send(proto.send(AppendRequest(rid, -1, LockRequest(), 0, DATA, checksum(DATA))))
        while True:
            message = proto.receive_frame(await conn.recv())
            if isinstance(message, FeedData) and message.req_id == rid:
                break
        latencies.append(time.perf_counter() - t0)
    await transport.close()
    return latencies


async def process_cases(submits: int, one_at_a_time: int) -> None:
    """The client library beside the raw protocol against a cluster of real processes
    (this process is only the client)."""
    from process_cluster import peak_rss_mb, process_cluster

    async with process_cluster(1) as cluster:
        owner = (await cluster.metadata.partition_assignment(0)).value
        print(
            "cluster of real processes (ZooKeeper, 3 storage nodes with fsync, 1 server, zmq), "
            f"1 partition, {WINDOW} in flight:"
        )
        raw = await raw_case(submits, owner.endpoint, owner.generation)
        print(f"  raw protocol (no client):              {raw:8,.0f} tx/s")
        for (label, context), api in itertools.product(CONTEXTS, APIS):
            rate, latencies, cpu = await client_throughput(cluster.uri, context, submits, api=api)
            print(
                f"  {api:>7}, {label}: {rate:8,.0f} tx/s ({rate / raw:4.0%} of "
                f"raw)  p50 {pct(latencies, 0.5):.2f} ms  p99 {pct(latencies, 0.99):.2f} ms  "
                f"client CPU {cpu * 1e6:.0f} us/tx"
            )
        floor = await raw_one_at_a_time(owner.endpoint, owner.generation, one_at_a_time)
        print(f"one at a time (K=1), {one_at_a_time} each:")
        print(
            f"  raw protocol (the floor):       p50 {pct(floor, 0.5):6.2f} ms  "
            f"p99 {pct(floor, 0.99):6.2f} ms"
        )
        for label, context in (("plain execute", Append), ("async execute", AsyncAppend)):
            latencies = await client_one_at_a_time(cluster.uri, context, one_at_a_time)
            ratio = pct(latencies, 0.5) / pct(floor, 0.5)
            print(
                f"  AsyncWaltzClient.submit, {label}: p50 {pct(latencies, 0.5):6.2f} ms "
                f"({ratio:.2f}x the floor)  p99 {pct(latencies, 0.99):6.2f} ms"
            )
        print(f"  server peak RSS: {peak_rss_mb(cluster.server.pid):.0f} MB")


async def real_cases(submits: int, feed: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = RealCluster()
        uri = await cluster.start(Path(tmp))
        try:
            print("real server in this process (local coordination, 3 fs storage nodes, zmq):")
            for (label, context), api in itertools.product(CONTEXTS, APIS):
                rate, latencies, _ = await client_throughput(uri, context, submits, api=api)
                print(
                    f"  {api:>7}, {label}: {rate:8,.0f} tx/s   "
                    f"p50 {pct(latencies, 0.5):.2f} ms  p99 {pct(latencies, 0.99):.2f} ms"
                )
            owner = (await ClusterAdmin(cluster.coordination).partition_assignment(0)).value
            rate = await raw_case(submits, owner.endpoint, owner.generation)
            print(f"  raw protocol (no client):              {rate:8,.0f} tx/s")
            top = 3 * submits - 1
            for label, fetch in (("headers only", False), ("with data", True)):
                callbacks = AsyncCounting(top, fetch)
                config = ClientConfig(uri, transport="zmq", prefetch_data=fetch)
                started = time.perf_counter()
                async with AsyncWaltzClient(callbacks, config):
                    await asyncio.wait_for(callbacks.done.wait(), 600)
                    rate = (top + 1) / (time.perf_counter() - started)
                print(f"  feed from the start, {label}: {rate:10,.0f} tx/s ({top + 1} tx)")
        finally:
            await cluster.stop()


CONTEXTS = (("plain execute", Append), ("async execute", AsyncAppend))


def _record(latencies: list[float], loop: asyncio.AbstractEventLoop, t0: float, _: object) -> None:
    latencies.append(loop.time() - t0)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def main() -> None:
    global WINDOW  # noqa: PLW0603 (--window: read by every case)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--feed", type=int, default=50000)
    parser.add_argument("--data-feed", type=int, default=5000)
    parser.add_argument("--submits", type=int, default=20000)
    parser.add_argument("--real", action="store_true", help="also against the real server")
    parser.add_argument(
        "--processes",
        action="store_true",
        help="also against a cluster of real processes (needs ZooKeeper installed)",
    )
    parser.add_argument(
        "--window", type=int, default=WINDOW, help="submissions (and raw appends) in flight"
    )
    parser.add_argument("--one-at-a-time", type=int, default=300, help="K=1 submissions")
    parser.add_argument("--no-echo", action="store_true", help="skip the echo peer cases")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    WINDOW = args.window

    if args.no_echo:
        if args.real:
            await real_cases(args.submits, args.feed)
        if args.processes:
            await process_cases(args.submits, args.one_at_a_time)
        return
    print("feed consumption (scripted echo peer over zmq loopback, one process):")
    rate = await feed_case(args.feed, fetch=False, use_async=False)
    print(f"  headers only, plain callbacks (callback thread): {rate:10,.0f} tx/s")
    rate = await feed_case(args.feed, fetch=False, use_async=True)
    print(f"  headers only, async callbacks (event loop):      {rate:10,.0f} tx/s")
    rate = await feed_case(args.data_feed, fetch=True, use_async=False)
    print(f"  with data (lazy RPC per tx), plain callbacks:    {rate:10,.0f} tx/s")
    rate = await feed_case(args.data_feed, fetch=True, use_async=True)
    print(f"  with data (lazy RPC per tx), async callbacks:    {rate:10,.0f} tx/s")
    rate = await feed_case(args.feed, fetch=True, use_async=False, prefetch=True)
    print(f"  with data, prefetch_data=True, plain callbacks:  {rate:10,.0f} tx/s")

    print(f"submits, 100-byte data, {WINDOW} in flight:")
    for (label, context), api in itertools.product(CONTEXTS, APIS):
        rate, latencies = await submit_case(args.submits, context, api)
        print(
            f"  {api:>7}, {label}: {rate:8,.0f} tx/s   "
            f"p50 {pct(latencies, 0.5):.2f} ms  p99 {pct(latencies, 0.99):.2f} ms"
        )
    rate = await raw_case(args.submits)
    print(f"  raw protocol (no client):              {rate:8,.0f} tx/s")
    if args.real:
        await real_cases(args.submits, args.feed)
    if args.processes:
        await process_cases(args.submits, args.one_at_a_time)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS: {peak:.0f} MiB")


if __name__ == "__main__":
    asyncio.run(main())
