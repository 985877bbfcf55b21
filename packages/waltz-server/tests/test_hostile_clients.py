"""Hostile input on real processes: a ``waltz dev`` cluster against hostile clients in
their own processes (``hostile_client.py``) and raw sockets, while a good client keeps
committing. The server's memory against clients that stop reading (the RSS figures are
printed; more in ``bench/hostile_clients.py``), a nesting-bomb handshake to a server and a
storage node, a transaction above the frame limit (the client's or the server's), bad
lock sets through the client library and too many locks from a raw client."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from waltz_api.cluster import ClusterMetadata, coordination_from_uri
from waltz_api.contracts.transport import DEFAULT_MAX_FRAME_SIZE
from waltz_api.errors import ConnectionClosedError, InvalidArgumentError
from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FlushRequest,
    FlushResponse,
    TransactionDataRequest,
    TransactionDataResponse,
)
from waltz_api.types import MAX_LOCKS_PER_TRANSACTION, LockRequest, ReqId
from waltz_api.wire import checksum
from waltz_client import (
    AsyncWaltzClient,
    ClientConfig,
    TransactionBuilder,
    TransactionContext,
    TransactionTooLargeError,
)
from waltz_client.simple import MemoryMarks as Marks
from waltz_client.simple import Put
from waltz_server.server.testing import RawClient
from waltz_transport_zmq import ZmqTransport
from waltz_transport_zmq import protocol as zmq_protocol

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

MIB = 1024 * 1024
BOUND = 64 * MIB
"""The most a hostile connection may grow the server: its outbox (8 MiB, up to four
times that with replies already under way) and the transport's window (4 MiB). Without
the window cap, a client announcing an absurd window grew it by 130-210 MiB here."""

_spec = importlib.util.spec_from_file_location(
    "hostile_client", Path(__file__).with_name("hostile_client.py")
)
assert _spec is not None and _spec.loader is not None
hostile = importlib.util.module_from_spec(_spec)
sys.modules["hostile_client"] = hostile
_spec.loader.exec_module(hostile)


@dataclass
class Cluster:
    info: dict[str, Any]
    server_pid: int
    generation: int

    @property
    def endpoint(self) -> str:
        return str(self.info["servers"][0])

    def rss(self) -> int:
        return int(hostile.rss_bytes(self.server_pid))


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    with hostile.dev_cluster(tmp_path_factory.mktemp("hostile"), "--partitions", "1") as info:
        yield info


@pytest.fixture
async def cluster(dev: dict[str, Any]) -> AsyncIterator[Cluster]:
    coordination = coordination_from_uri(dev["coordination"])
    await coordination.start()
    try:
        generation = (await ClusterMetadata(coordination).partition_assignment(0)).value.generation
    finally:
        await coordination.close()
    yield Cluster(dev, hostile.role_pid(dev["child_pids"], "server"), generation)


async def commit_while(client: AsyncWaltzClient, done: asyncio.Event) -> int:
    """Commit small transactions (8 in flight) until ``done``; how many."""
    count = 0

    async def worker() -> None:
        nonlocal count
        while not done.is_set():
            await client.submit(Put(b"g" * 100))
            count += 1

    await asyncio.gather(*(worker() for _ in range(8)))
    return count


async def test_hostile_clients_leave_server_memory_bounded_and_others_committing(
    cluster: Cluster,
) -> None:
    config = ClientConfig(cluster.info["coordination"], transport="zmq", request_timeout=60)
    async with AsyncWaltzClient(Marks(), config) as client:
        big = (await client.submit(Put(b"B" * MIB))).transaction_id
        args = [cluster.endpoint, "0", str(cluster.generation), str(big), "300"]
        # a first attack grows the server to its plateau (allocator, buffers); then each
        # kind of hostile client in turn: the server stays within BOUND of that plateau
        rounds = [
            ("data", []),
            ("data", ["--absurd-window"]),
            ("data", ["--absurd-window", "--freeze"]),
            ("feed", ["--absurd-window"]),
            ("data", ["--absurd-window"]),
        ]
        plateau = 0
        figures = [f"server RSS before the attacks: {cluster.rss() / MIB:.0f} MiB"]
        for index, (mode, flags) in enumerate(rounds):
            peak = cluster.rss()
            done = asyncio.Event()
            good = asyncio.ensure_future(commit_while(client, done))
            attacker = hostile.Attacker(args[0], mode, *args[1:], *flags)
            try:
                await asyncio.to_thread(attacker.wait_sent)
                until = time.monotonic() + 5
                while time.monotonic() < until:
                    peak = max(peak, cluster.rss())
                    await asyncio.sleep(0.1)
            finally:
                attacker.stop()
                done.set()
            committed = await asyncio.wait_for(good, 120)
            assert committed > 0, f"round {index}: the good client committed nothing"
            growth = "(the plateau)" if index == 0 else f"({(peak - plateau) / MIB:+.0f} MiB)"
            figures.append(
                f"{mode} {' '.join(flags) or '(plain)'}: server RSS peak {peak / MIB:.0f} MiB "
                f"{growth}, the good client committed {committed}"
            )
            if index == 0:
                plateau = peak
            else:
                assert peak - plateau < BOUND, (
                    f"round {index} ({mode} {flags}): the server grew by "
                    f"{(peak - plateau) / MIB:.0f} MiB over its plateau of {plateau / MIB:.0f} MiB"
                )
        # the figure (pytest -s shows it; the assertion above is the check)
        print(f"\nhostile clients (bound {BOUND // MIB} MiB over the plateau):")  # noqa: T201
        print("\n".join(f"  {line}" for line in figures))  # noqa: T201


async def test_a_client_pipelining_large_reads_is_served_not_disconnected(
    cluster: Cluster,
) -> None:
    """Before: the server closed a connection whose replies filled its outbox faster
    than the transport took them (8 replies of 1 MiB), a client that reads included."""
    config = ClientConfig(cluster.info["coordination"], transport="zmq", request_timeout=60)
    async with AsyncWaltzClient(Marks(), config) as client:
        big = (await client.submit(Put(b"P" * MIB))).transaction_id
    transport = ZmqTransport()
    try:
        reader = await RawClient.connect(transport, cluster.endpoint, "pipelining", timeout=30)
        for seq in range(100):
            await reader.send(TransactionDataRequest(ReqId(77, cluster.generation, 0, seq), big))
        replies = await reader.wait(TransactionDataResponse, 100, timeout=120)
        assert all(r.success and r.data == b"P" * MIB for r in replies)
        await reader.close()
    finally:
        await transport.close()


async def test_an_append_with_too_many_locks_from_a_raw_client_is_refused(
    cluster: Cluster,
) -> None:
    """The client library refuses it before sending; the server refuses it too."""
    transport = ZmqTransport()
    try:
        raw = await RawClient.connect(transport, cluster.endpoint, "raw-locks", timeout=30)
        await raw.send(FlushRequest(ReqId(78, cluster.generation, 0, 1)))
        before = (await raw.wait(FlushResponse, 1, timeout=60))[0].transaction_id
        locks = LockRequest(write=tuple(range(MAX_LOCKS_PER_TRANSACTION + 1)))
        data = b"too many locks"
        request = AppendRequest(
            ReqId(78, cluster.generation, 0, 2), before, locks, 0, data, checksum(data)
        )
        await raw.send(request)
        (refused,) = await raw.wait(ErrorResponse, 1, timeout=60)
        assert refused.code is ErrorCode.BAD_REQUEST
        assert f"limit of {MAX_LOCKS_PER_TRANSACTION}" in refused.message
        await raw.send(FlushRequest(ReqId(78, cluster.generation, 0, 3)))
        after = (await raw.wait(FlushResponse, 2, timeout=60))[-1].transaction_id
        assert after == before  # nothing was appended
        await raw.close()
    finally:
        await transport.close()


async def raw_answer(endpoint: str, message: bytes, timeout: float = 30.0) -> bytes:
    """Send ``message`` to ``endpoint`` from a bare DEALER (a fresh identity); the first
    message the listener sends back."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, os.urandom(16))
    try:
        dealer.connect(endpoint)
        await dealer.send(message)
        async with asyncio.timeout(timeout):
            return bytes(await dealer.recv())
    finally:
        dealer.close(linger=0)
        context.term()


async def test_a_nesting_bomb_hello_is_refused_by_a_server_and_a_storage_node_in_one_line(
    cluster: Cluster,
) -> None:
    """The issue's input, ``s.send(b"\\x10" + b"[" * 200000)``, to the listeners of a real
    server and a real storage node: it raised an uncaught RecursionError in the reader
    callback, which stopped rescheduling itself. Now each is refused on its own
    connection, logged in one line, and the listener serves on."""
    bomb = bytes([zmq_protocol.KIND_HELLO]) + b"[" * 200_000
    logs = Path(cluster.info["logs"])
    listeners = {
        "server": (cluster.endpoint, logs / "server-0.log"),
        "storage node": (str(cluster.info["storage_nodes"][0]), logs / "storage-0.log"),
    }
    before = {name: log.read_text() for name, (_, log) in listeners.items()}
    config = ClientConfig(cluster.info["coordination"], transport="zmq", request_timeout=60)
    async with AsyncWaltzClient(Marks(), config) as client:
        first = (await client.submit(Put(b"before the bombs"))).transaction_id
        for name, (endpoint, _) in listeners.items():
            for _ in range(3):
                answer = await raw_answer(endpoint, bomb)
                assert answer[:1] == bytes([zmq_protocol.KIND_CLOSE]), (name, answer[:40])
                reason = zmq_protocol.parse_close(answer)
                assert "refused: hello of 200000 bytes is above the limit of" in reason, name
            # the listener still takes a new connection: a valid hello is welcomed
            hello = zmq_protocol.Hello(
                version=zmq_protocol.PROTOCOL_VERSION,
                client=os.urandom(16).hex(),
                seq=1,
                replace_key=None,
                window_frames=16,
                window_bytes=1 << 20,
                max_frame_size=1 << 20,
            )
            welcome = await raw_answer(endpoint, hello.encode())
            assert welcome[:1] == bytes([zmq_protocol.KIND_WELCOME]), (name, welcome[:40])
        # and the cluster commits on its existing connections
        after = (await client.submit(Put(b"after the bombs"))).transaction_id
        assert after > first
    for pid in cluster.info["child_pids"]:
        os.kill(pid, 0)  # every process of the cluster still runs
    for name, (_, log) in listeners.items():
        new = log.read_text()[len(before[name]) :]
        refusals = [line for line in new.splitlines() if "refused a connection" in line]
        assert 1 <= len(refusals) <= 3, f"{name} logged {len(refusals)} refusals:\n{new[-2000:]}"
        assert all("hello of 200000 bytes is above the limit" in line for line in refusals)
        assert "Traceback" not in new and "RecursionError" not in new, new[-3000:]


async def test_a_transaction_above_the_frame_limit_fails_submit_at_once(
    cluster: Cluster,
) -> None:
    """Before: a payload above the 64 MiB frame limit made submit() hang (no result
    after 90 s). Now it fails at once naming the limit; the client commits on."""
    config = ClientConfig(cluster.info["coordination"], transport="zmq", request_timeout=60)
    async with AsyncWaltzClient(Marks(), config) as client:
        await client.submit(Put(b"warm"))  # mounted: the refusal below is not a start-up
        with pytest.raises(TransactionTooLargeError) as refused:
            # the deadline is the check: it hung for good before
            await asyncio.wait_for(client.submit(Put(b"x" * DEFAULT_MAX_FRAME_SIZE)), 20)
        assert f"max_frame_size of {DEFAULT_MAX_FRAME_SIZE} bytes" in str(refused.value)
        assert (await client.submit(Put(b"fits"))).transaction_id >= 0


async def test_a_transaction_above_the_servers_smaller_frame_limit_fails_submit_at_once(
    cluster: Cluster,
) -> None:
    """A client whose own max_frame_size is larger than the server's: the server's limit
    (announced in the handshake) is the one that counts."""
    config = ClientConfig(
        cluster.info["coordination"],
        transport="zmq",
        transport_options={"max_frame_size": 2 * DEFAULT_MAX_FRAME_SIZE},
        request_timeout=60,
    )
    async with AsyncWaltzClient(Marks(), config) as client:
        await client.submit(Put(b"warm"))
        with pytest.raises(TransactionTooLargeError) as refused:
            await asyncio.wait_for(client.submit(Put(b"x" * DEFAULT_MAX_FRAME_SIZE)), 20)
        assert f"max_frame_size of {DEFAULT_MAX_FRAME_SIZE} bytes" in str(refused.value)
        assert (await client.submit(Put(b"fits"))).transaction_id >= 0


class Locked(TransactionContext):
    def __init__(self, locks: list[tuple[str, int]]) -> None:
        super().__init__()
        self.locks = locks

    def partition_id(self, num_partitions: int) -> int:
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        for name, lock_id in self.locks:
            builder.write_lock(name, lock_id)
        builder.set_data(b"locked")
        return True


@pytest.mark.parametrize(
    ("locks", "says"),
    [
        ([("account", i) for i in range(MAX_LOCKS_PER_TRANSACTION + 1)], "above the limit of"),
        ([("bad\ud800name", 1)], "cannot be encoded as UTF-8"),
        ([("n" * 100_000, 1)], "100000 UTF-8 bytes, above the limit of"),
        ([("account", 2**63)], "does not fit in a signed 64-bit integer"),
    ],
    ids=["too-many-locks", "lone-surrogate", "long-name", "id-out-of-range"],
)
async def test_a_bad_lock_set_fails_submit_at_once_naming_what_is_wrong(
    cluster: Cluster, locks: list[tuple[str, int]], says: str
) -> None:
    config = ClientConfig(cluster.info["coordination"], transport="zmq", request_timeout=60)
    async with AsyncWaltzClient(Marks(), config) as client:
        before = (await client.submit(Put(b"before"))).transaction_id
        with pytest.raises(InvalidArgumentError, match=re.escape(says)):
            # the deadline is the check: a raw UnicodeEncodeError or a retry would miss it
            await asyncio.wait_for(client.submit(Locked(locks)), 20)
        after = (await client.submit(Put(b"after"))).transaction_id
        assert after == before + 1  # nothing was appended in between


async def refused_connections(endpoint: str, count: int) -> None:
    """``count`` connections that each send a frame no Waltz handshake is made of; each
    must be closed by the listener (after its refusal, if it sends one)."""
    transport = ZmqTransport()
    try:
        for i in range(count):
            conn = await transport.connect(endpoint, timeout=30)
            await conn.send(b"\xff not a waltz hello %d" % i)
            async with asyncio.timeout(30):
                with contextlib.suppress(ConnectionClosedError):
                    while True:
                        await conn.recv()
    finally:
        await transport.close()


async def test_a_flood_of_bad_handshakes_is_refused_and_logged_at_a_bounded_rate(
    cluster: Cluster,
) -> None:
    """Each refused connection was one warning line: a client opening connection after
    connection could flood the log. Now at most 10 lines a minute (the next one says how
    many were left out), while the cluster commits on."""
    logs = Path(cluster.info["logs"])
    listeners = {
        "server": (cluster.endpoint, logs / "server-0.log"),
        "storage node": (str(cluster.info["storage_nodes"][0]), logs / "storage-0.log"),
    }
    before = {name: log.read_text() for name, (_, log) in listeners.items()}
    config = ClientConfig(cluster.info["coordination"], transport="zmq", request_timeout=60)
    async with AsyncWaltzClient(Marks(), config) as client:
        for endpoint, _ in listeners.values():
            await refused_connections(endpoint, 40)
        assert (await client.submit(Put(b"after the flood"))).transaction_id >= 0
    for name, (_, log) in listeners.items():
        new = log.read_text()[len(before[name]) :]
        refused = [line for line in new.splitlines() if "handshake failed" in line]
        assert 1 <= len(refused) <= 10, f"{name} logged {len(refused)} refusals:\n{new[-3000:]}"
