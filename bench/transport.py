"""The zmq transport beside bare pyzmq, with 100-byte payloads, in one run.

Every case runs both ends in this process on one asyncio event loop over real
loopback TCP sockets (the same conditions for bare pyzmq and for the
transport), best of ``--repeat`` rounds in which the cases take turns:

1. One-way messages/s: a sender task sends N payloads, a receiver task takes
   them; time until the last one arrived.
   - bare pyzmq PUSH/PULL with asyncio sockets (``await send/recv`` per message)
   - bare pyzmq PUSH/PULL "drained": plain sockets, the FD read from the loop and
     drained without blocking (what the transport itself does: the fair ceiling)
   - zmq transport, ``send`` without coalescing (one ZeroMQ message per frame)
   - zmq transport, ``send`` with coalescing (frames of one loop iteration packed)
   - zmq transport, ``send_many`` of 100 frames
2. Pipelined request/response round trips/s: the client sends N requests,
   at most WINDOW in flight, while it reads the replies; the server echoes each.
   - bare pyzmq DEALER/ROUTER, asyncio sockets and drained, single-frame payloads
   - zmq transport without and with coalescing
3. Ping-pong latency (one request in flight): p50/p99 in microseconds.

Also printed: peak RSS of the process. Figures only; never pass/fail.

    .venv/bin/python bench/transport.py [--messages 200000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

import zmq
import zmq.asyncio

from waltz_api.contracts.transport import Connection, ConnectionHandler
from waltz_api.errors import ConnectionClosedError
from waltz_transport_zmq import ZmqTransport

PAYLOAD = b"p" * 100
# requests in flight in the pipelined cases (a ROUTER drops replies beyond its HWM)
WINDOW = 1000
HWM = 10000

Send = Callable[[bytes], Awaitable[object]]
Receive = Callable[[], Awaitable[object]]
_Socket = TypeVar("_Socket", bound="zmq.Socket[Any]")


# -- the measurements, alike for bare pyzmq and the transport ----------------------------


async def pipelined(n: int, send: Send, receive: Receive) -> float:
    """Round trips/s: a task sends ``n`` requests, at most WINDOW in flight, while this
    one reads the replies."""
    window = asyncio.Semaphore(WINDOW)

    async def sender() -> None:
        for _ in range(n):
            await window.acquire()
            await send(PAYLOAD)

    start = time.perf_counter()
    task = asyncio.create_task(sender())
    for _ in range(n):
        await receive()
        window.release()
    elapsed = time.perf_counter() - start
    await task
    return n / elapsed


async def ping_pong(n: int, send: Send, receive: Receive) -> list[float]:
    """The latency of each of ``n`` round trips, one at a time."""
    latencies = []
    for _ in range(n):
        start = time.perf_counter()
        await send(PAYLOAD)
        await receive()
        latencies.append(time.perf_counter() - start)
    return latencies


# -- bare pyzmq -----------------------------------------------------------------------


def _push_pull(ctx: zmq.Context[_Socket]) -> tuple[_Socket, _Socket]:
    """A PULL socket on a free loopback port and a PUSH socket connected to it."""
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, HWM)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, HWM)
    push.connect(f"tcp://127.0.0.1:{port}")
    return pull, push


def _router_dealer(ctx: zmq.Context[_Socket], hwm: bool = True) -> tuple[_Socket, _Socket]:
    """A ROUTER socket on a free loopback port and a DEALER socket connected to it (with
    ``hwm``, both with HWM messages queued each way, else the default)."""
    router = ctx.socket(zmq.ROUTER)
    if hwm:
        router.setsockopt(zmq.SNDHWM, HWM)
        router.setsockopt(zmq.RCVHWM, HWM)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    if hwm:
        dealer.setsockopt(zmq.SNDHWM, HWM)
        dealer.setsockopt(zmq.RCVHWM, HWM)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer


def _close(ctx: zmq.Context[_Socket], *sockets: _Socket) -> None:
    for socket in sockets:
        socket.close(linger=0)
    ctx.term()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def bare_push_pull(n: int) -> float:
    ctx = zmq.asyncio.Context()
    pull, push = _push_pull(ctx)
    await push.send(b"warm")
    await pull.recv()
    try:

        async def sender() -> None:
            for _ in range(n):
                await push.send(PAYLOAD)

        start = time.perf_counter()
        task = asyncio.create_task(sender())
        for _ in range(n):
            await pull.recv()
        elapsed = time.perf_counter() - start
        await task
        return n / elapsed
    finally:
        _close(ctx, push, pull)


class _Reader:
    """The best a hand-written asyncio program gets from pyzmq, and what the transport
    itself does: the socket's FD watched by the loop and drained without blocking (no
    Future per message). The FD is edge-triggered and a send on the socket may consume
    its signal, so a sender calls :meth:`poke` to make the loop look again."""

    def __init__(self, socket: zmq.Socket[bytes], on_message: Callable[[], None]) -> None:
        self.socket = socket
        self.on_message = on_message
        self.loop = asyncio.get_running_loop()
        self.scheduled = False
        self.fd = cast(int, socket.getsockopt(zmq.FD))
        self.loop.add_reader(self.fd, self.readable)

    def poke(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.readable)

    def readable(self) -> None:
        self.scheduled = False
        try:
            for _ in range(512):
                self.on_message()
        except zmq.Again:
            return
        self.poke()

    def close(self) -> None:
        self.loop.remove_reader(self.fd)


async def bare_push_pull_drained(n: int) -> float:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull, push = _push_pull(ctx)
    done: asyncio.Future[float] = asyncio.get_running_loop().create_future()
    count = -1  # the warm-up message
    warm = asyncio.Event()

    def on_message() -> None:
        nonlocal count
        pull.recv(zmq.NOBLOCK)
        count += 1
        if count == 0:
            warm.set()
        if count == n:
            done.set_result(time.perf_counter())

    reader = _Reader(pull, on_message)
    try:
        push.send(b"warm")
        await asyncio.wait_for(warm.wait(), 10)
        start = time.perf_counter()
        for _ in range(n):
            while True:
                try:
                    push.send(PAYLOAD, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    await asyncio.sleep(0)
        end = await asyncio.wait_for(done, 120)
        return n / (end - start)
    finally:
        reader.close()
        _close(ctx, push, pull)


async def bare_dealer_router_drained(n: int) -> float:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, dealer = _router_dealer(ctx)
    loop = asyncio.get_running_loop()
    window = asyncio.Semaphore(WINDOW)
    done: asyncio.Future[float] = loop.create_future()
    replies = -1  # the warm-up round trip
    warm = asyncio.Event()

    def on_request() -> None:
        identity = router.recv(zmq.NOBLOCK)
        body = router.recv(zmq.NOBLOCK)
        router.send(identity, zmq.SNDMORE)
        router.send(body)
        server.poke()

    def on_reply() -> None:
        nonlocal replies
        dealer.recv(zmq.NOBLOCK)
        replies += 1
        window.release()
        if replies == 0:
            warm.set()
        if replies == n:
            done.set_result(time.perf_counter())

    server, client = _Reader(router, on_request), _Reader(dealer, on_reply)
    try:
        await window.acquire()
        dealer.send(b"warm")
        client.poke()
        await asyncio.wait_for(warm.wait(), 10)
        start = time.perf_counter()
        for _ in range(n):
            await window.acquire()
            while True:
                try:
                    dealer.send(PAYLOAD, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    await asyncio.sleep(0)
            client.poke()
        end = await asyncio.wait_for(done, 120)
        return n / (end - start)
    finally:
        server.close()
        client.close()
        _close(ctx, dealer, router)


async def bare_dealer_router(n: int) -> float:
    ctx = zmq.asyncio.Context()
    router, dealer = _router_dealer(ctx)

    async def serve() -> None:
        while True:
            identity, body = await router.recv_multipart()
            await router.send_multipart([identity, body])

    server = asyncio.create_task(serve())
    await dealer.send(b"warm")
    await dealer.recv()
    try:
        return await pipelined(n, dealer.send, dealer.recv)
    finally:
        await _cancel(server)
        _close(ctx, dealer, router)


async def bare_ping_pong(n: int) -> list[float]:
    ctx = zmq.asyncio.Context()
    router, dealer = _router_dealer(ctx, hwm=False)

    async def serve() -> None:
        while True:
            await router.send_multipart(await router.recv_multipart())

    server = asyncio.create_task(serve())
    try:
        return await ping_pong(n, dealer.send, dealer.recv)
    finally:
        await _cancel(server)
        _close(ctx, dealer, router)


# -- the zmq transport ------------------------------------------------------------------


async def _echo(conn: Connection) -> None:
    try:
        while True:
            await conn.send(await conn.recv())
    except ConnectionClosedError:
        return


@contextlib.asynccontextmanager
async def _transport_connection(
    coalesce: bool, handler: ConnectionHandler
) -> AsyncIterator[Connection]:
    """A client transport's connection to a server transport that runs ``handler``."""
    server, client = ZmqTransport({"coalesce": coalesce}), ZmqTransport({"coalesce": coalesce})
    try:
        listener = await server.listen("tcp://127.0.0.1:*", handler)
        yield await client.connect(listener.endpoint, timeout=10)
    finally:
        await client.close()
        await server.close()


async def transport_one_way(n: int, coalesce: bool, batch: int = 0) -> float:
    received = asyncio.get_running_loop().create_future()

    async def sink(conn: Connection) -> None:
        await conn.recv()  # warm-up
        for _ in range(n):
            await conn.recv()
        received.set_result(time.perf_counter())

    async with _transport_connection(coalesce, sink) as conn:
        await conn.send(b"warm")
        start = time.perf_counter()
        if batch:
            frames = [PAYLOAD] * batch
            for _ in range(n // batch):
                await conn.send_many(frames)
        else:
            for _ in range(n):
                await conn.send(PAYLOAD)
        end: float = await asyncio.wait_for(received, 120)
        return n / (end - start)


async def transport_round_trips(n: int, coalesce: bool) -> float:
    async with _transport_connection(coalesce, _echo) as conn:
        await conn.send(b"warm")
        await conn.recv()
        return await pipelined(n, conn.send, conn.recv)


async def transport_ping_pong(n: int, coalesce: bool) -> list[float]:
    async with _transport_connection(coalesce, _echo) as conn:
        return await ping_pong(n, conn.send, conn.recv)


# -- the run ------------------------------------------------------------------------------


async def interleaved(
    repeat: int, cases: list[tuple[str, Callable[[], Awaitable[float]]]]
) -> list[tuple[str, float]]:
    """Best of ``repeat`` for each case, the cases taking turns in each round (the machine
    is shared: a burst of load then hits every case alike)."""
    results: dict[str, float] = {label: 0.0 for label, _ in cases}
    for _ in range(repeat):
        for label, case in cases:
            results[label] = max(results[label], await case())
    return list(results.items())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(rows: list[tuple[str, float]], bare: float, drained: float) -> None:
    print(f"  {'':44s} {'per second':>12s}  {'vs asyncio':>10s}  {'vs drained':>10s}")
    for label, value in rows:
        print(f"  {label:44s} {value:12,.0f}  {value / bare:10.0%}  {value / drained:10.0%}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pings", type=int, default=5000)
    args = parser.parse_args()
    n, r = args.messages, args.repeat
    print(
        f"100-byte payloads, {n} messages per run, best of {r}; pyzmq {zmq.__version__}, "
        f"libzmq {zmq.zmq_version()}; both ends on one event loop over loopback TCP\n"
    )

    print("one-way messages/s")
    rows = await interleaved(
        r,
        [
            ("bare pyzmq PUSH/PULL (asyncio sockets)", lambda: bare_push_pull(min(n, 50_000))),
            ("bare pyzmq PUSH/PULL (drained loop)", lambda: bare_push_pull_drained(n)),
            ("zmq transport send, no coalescing", lambda: transport_one_way(n, False)),
            ("zmq transport send, coalescing", lambda: transport_one_way(n, True)),
            ("zmq transport send_many(100)", lambda: transport_one_way(n, True, 100)),
        ],
    )
    report(rows, rows[0][1], rows[1][1])

    print(f"\npipelined request/response round trips/s ({WINDOW} in flight)")
    rows = await interleaved(
        r,
        [
            # pyzmq's asyncio ROUTER/DEALER is slow enough here that fewer messages suffice
            (
                "bare pyzmq DEALER/ROUTER (asyncio sockets)",
                lambda: bare_dealer_router(min(n, 20_000)),
            ),
            ("bare pyzmq DEALER/ROUTER (drained loop)", lambda: bare_dealer_router_drained(n)),
            ("zmq transport, no coalescing", lambda: transport_round_trips(n, False)),
            ("zmq transport, coalescing", lambda: transport_round_trips(n, True)),
        ],
    )
    report(rows, rows[0][1], rows[1][1])

    print("\nping-pong latency (one request in flight), microseconds")
    cases: list[tuple[str, Callable[[], Awaitable[list[float]]]]] = [
        ("bare pyzmq DEALER/ROUTER", lambda: bare_ping_pong(args.pings)),
        ("zmq transport, no coalescing", lambda: transport_ping_pong(args.pings, False)),
        ("zmq transport, coalescing", lambda: transport_ping_pong(args.pings, True)),
    ]
    for label, case in cases:
        latencies = await case()
        print(
            f"  {label:40s} p50 {percentile(latencies, 0.5) * 1e6:8.1f}  "
            f"p99 {percentile(latencies, 0.99) * 1e6:8.1f}  "
            f"mean {statistics.fmean(latencies) * 1e6:8.1f}"
        )

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS of this process: {peak:.0f} MiB")


if __name__ == "__main__":
    asyncio.run(main())
