"""The Transport conformance suite.

(Above 800 lines on purpose: the harness, the process peer and one suite class whose
tests follow the Transport contract clause by clause; a plugin author reads and imports
one module.)

A backend author subclasses :class:`TransportSuite` and provides a ``harness``
fixture returning a :class:`TransportHarness` subclass for the transport::

    class TestMyTransport(TransportSuite):
        @pytest.fixture
        def harness(self) -> TransportHarness:
            return MyTransportHarness(name="mine", capabilities={"peer_faults"})

The harness makes transports and fresh endpoints, and starts *peers*: an echo
server the suite can kill (-9), pause (SIGSTOP), resume and restart.
:class:`ProcessPeer` runs any installed transport plugin in a separate process
(``python -m waltz_conformance.transport_peer``); a transport that cannot cross
processes (the in-memory reference) simulates the faults instead.

Capabilities:

- ``peer_faults``: the harness's peers can be killed, paused and restarted.
- ``processes``: the peers are real processes (for the record; the tests are the same).
- ``malformed_input``: :meth:`TransportHarness.send_malformed` writes garbage
  at the socket level to a listener.
- ``control_fuzz``: the transport has a control plane on the wire (handshake,
  flow control, heartbeats): :meth:`TransportHarness.control_plane` describes its
  messages and codec, :meth:`TransportHarness.raw_dialer` opens raw connections
  that send any bytes. The suite fuzzes the codec and a live listener with seeded
  mutations of valid messages (``--waltz-fuzz-iterations`` and ``--waltz-fuzz-seed``,
  or WALTZ_FUZZ_ITERATIONS and WALTZ_FUZZ_SEED, for long runs).
- ``authenticated_peers``: a listener authenticates its clients and every connection it
  accepts carries the identity it accepted (``Connection.peer_identity``);
  :meth:`TransportHarness.authenticated` makes the options of such a listener and of
  clients with distinct credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import re
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from waltz_api.capabilities import AUTHENTICATED_PEERS as AUTHENTICATED_PEERS  # noqa: PLC0414 (re-exported for plugin authors)
from waltz_api.capabilities import CONTROL_FUZZ as CONTROL_FUZZ  # noqa: PLC0414 (re-exported for plugin authors)
from waltz_api.capabilities import MALFORMED_INPUT as MALFORMED_INPUT  # noqa: PLC0414 (re-exported for plugin authors)
from waltz_api.capabilities import PEER_FAULTS as PEER_FAULTS  # noqa: PLC0414 (re-exported for plugin authors)
from waltz_api.capabilities import PROCESSES as PROCESSES  # noqa: PLC0414 (re-exported for plugin authors)
from waltz_api.contracts.transport import Connection, Transport
from waltz_api.errors import (
    ConnectError,
    ConnectionClosedError,
    FrameTooLargeError,
    ProcessStartError,
    ProtocolError,
    TransportError,
)
from waltz_api.supervised import SupervisedProcess
from waltz_conformance.harness import Harness, requires, skip_unless_capable

log = logging.getLogger(__name__)


# Extra time allowed beyond a declared bound: the test machine may be loaded.
SLACK = 2.0


class Peer(ABC):
    """An echo server the suite talks to and injects faults into."""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """Where the peer listens (stable across :meth:`restart`)."""

    async def kill(self) -> None:
        """Die at once, without closing anything (kill -9)."""
        raise NotImplementedError("this harness's peers cannot be killed")

    async def pause(self) -> None:
        """Freeze (SIGSTOP): nothing is read, written or answered until :meth:`resume`."""
        raise NotImplementedError("this harness's peers cannot be paused")

    async def resume(self) -> None:
        raise NotImplementedError("this harness's peers cannot be paused")

    async def restart(self) -> None:
        """Start again on the same endpoint after :meth:`kill`."""
        raise NotImplementedError("this harness's peers cannot be restarted")

    @abstractmethod
    async def stop(self) -> None:
        """Stop for good (idempotent; also after kill or pause)."""


class ProcessPeer(Peer):
    """The echo peer of transport plugin ``plugin`` in its own process (a
    :class:`~waltz_api.supervised.SupervisedProcess`, its output in a temp file).

    Every process it starts is stopped by pid in :meth:`stop` (call it in a
    ``finally``), and a peer whose parent dies exits by itself.
    """

    READY = re.compile(r"^READY (\S+)$", re.MULTILINE)

    def __init__(
        self, plugin: str, endpoint: str, options: Mapping[str, Any], start_timeout: float = 30.0
    ) -> None:
        self.plugin = plugin
        self._requested = endpoint
        self._endpoint: str | None = None
        self.options = dict(options)
        self.start_timeout = start_timeout
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None
        self.child: SupervisedProcess | None = None

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise TransportError("the peer has not started yet")
        return self._endpoint

    @property
    def pid(self) -> int:
        pid = None if self.child is None else self.child.pid
        if pid is None:
            raise TransportError("the peer is not running")
        return pid

    async def start(self) -> None:
        endpoint = self._endpoint or self._requested
        if self._log_dir is None:
            self._log_dir = tempfile.TemporaryDirectory(prefix="waltz-transport-peer-")
        self.child = child = SupervisedProcess(
            [
                sys.executable,
                "-m",
                "waltz_conformance.transport_peer",
                self.plugin,
                endpoint,
                json.dumps(self.options),
            ],
            Path(self._log_dir.name) / "peer.log",
            name=f"the {self.plugin} transport peer",
        )
        child.start()
        try:
            ready = await child.wait_ready(
                self.READY, timeout=self.start_timeout, waiting_for=f"it to listen on {endpoint}"
            )
        except ProcessStartError as exc:
            child.kill()
            raise TransportError(str(exc)) from None
        assert ready is not None
        self._endpoint = ready.group(1)

    async def kill(self) -> None:
        if self.child is not None:
            self.child.kill()

    async def pause(self) -> None:
        if self.child is not None:
            self.child.pause()

    async def resume(self) -> None:
        if self.child is not None:
            self.child.resume()

    async def restart(self) -> None:
        await self.kill()
        await self.start()

    async def stop(self) -> None:
        child = self.child
        if child is not None:
            await child.stop(timeout=5.0)
        if self._log_dir is not None:
            self._log_dir.cleanup()
            self._log_dir = None


@dataclass(kw_only=True)
class TransportHarness(Harness):
    """How the suite builds a backend's transports, endpoints and peers.

    ``options`` are passed to every transport the suite makes (merged under
    per-test overrides).
    """

    options: Mapping[str, Any] = field(default_factory=dict)

    @abstractmethod
    def create(self, options: Mapping[str, Any]) -> Transport:
        """A new transport with exactly these options."""

    @abstractmethod
    def endpoint(self) -> str:
        """A fresh endpoint to listen on (a port-0 request is fine)."""

    @abstractmethod
    async def start_peer(self) -> Peer:
        """Start an echo peer (with the harness's options) and return it, listening."""

    def make_transport(self, **overrides: Any) -> Transport:
        return self.create({**self.options, **overrides})

    def small_buffer_options(self) -> dict[str, Any]:
        """Options that make a connection's buffers small (the stalled-receiver test)."""
        return {}

    @abstractmethod
    def stalled_receiver_bound(self, options: Mapping[str, Any], frame_size: int) -> int:
        """The most bytes ``send`` may accept on one connection whose receiver reads nothing."""

    async def send_malformed(self, endpoint: str) -> None:
        """Write garbage at the socket level to the listener at ``endpoint`` (capability
        ``malformed_input``)."""
        raise NotImplementedError(f"{self.name} cannot send malformed input")

    def control_plane(self) -> ControlPlane:
        """The transport's control-plane messages and codec (capability ``control_fuzz``)."""
        raise NotImplementedError(f"{self.name} has no control plane to fuzz")

    def raw_dialer(self, endpoint: str) -> RawDialer:
        """Raw connections to the listener at ``endpoint`` (capability ``control_fuzz``)."""
        raise NotImplementedError(f"{self.name} cannot open raw connections")

    def authenticated(self, clients: int) -> Authenticated:
        """Options of a listener that authenticates its clients, and of ``clients``
        connecting transports with distinct credentials it accepts (capability
        ``authenticated_peers``)."""
        raise NotImplementedError(f"{self.name} does not authenticate peers")


@dataclass(frozen=True)
class Authenticated:
    """A listener's options and its accepted clients' (capability ``authenticated_peers``):
    each client is (options of its transport, the ``peer_identity`` the listener must
    give its connections). Both are merged over the harness's options."""

    listener: Mapping[str, Any]
    clients: Sequence[tuple[Mapping[str, Any], str]]


@dataclass(frozen=True)
class ControlPlane:
    """A transport's control plane as the fuzzers see it (capability ``control_fuzz``).

    - ``opening(rng)``: a valid first message of a new connection (a hello).
    - ``messages``: valid messages of an open connection (flow control, heartbeats,
      data, close), mutated by the fuzzers.
    - ``decode``: the transport's codec of any message; it must return or raise
      ProtocolError, nothing else, whatever the bytes.
    - ``refusal(message)``: True when a message from the listener refuses a
      connection or closes it for a protocol error.
    - ``malformed_openings`` / ``malformed_messages``: known-bad inputs the listener
      must answer with a refusal (the first on a fresh connection, the others after a
      valid opening).
    """

    opening: Callable[[random.Random], bytes]
    messages: Sequence[bytes]
    decode: Callable[[bytes], object]
    refusal: Callable[[bytes], bool]
    malformed_openings: Sequence[bytes] = ()
    malformed_messages: Sequence[bytes] = ()


class RawConnection(ABC):
    """A connection to a listener that sends raw wire messages, unchecked."""

    @abstractmethod
    async def send(self, message: bytes) -> None: ...

    @abstractmethod
    async def recv(self, timeout: float) -> bytes | None:
        """The next message from the listener, or None after ``timeout`` seconds."""

    @abstractmethod
    async def close(self) -> None: ...


class RawDialer(ABC):
    """Opens raw connections to one listener; :meth:`close` (idempotent) delivers what
    they still hold (within a few seconds), then releases them all."""

    @abstractmethod
    async def open(self) -> RawConnection: ...

    @abstractmethod
    async def close(self) -> None: ...


MUTATION_LIMIT = 256 * 1024
"""A mutated message is cut to this many bytes (far above any control message)."""


def mutate(rng: random.Random, message: bytes, others: Sequence[bytes]) -> bytes:
    """One to three random mutations of ``message``: bit flips, random bytes, cuts,
    insertions, a byte repeated up to 5,000 times in place (deep nesting, long
    fields), a slice repeated, a splice with another message, digit runs made huge or
    negative. (The 200,000-byte cases are :func:`_structural_bombs`.)"""
    data = bytearray(message)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(8)
        at = rng.randrange(len(data) + 1)
        if op == 0 and data:
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
        elif op == 1 and data:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif op == 2:
            del data[at:]
        elif op == 3:
            data[at:at] = rng.randbytes(rng.randint(1, 64))
        elif op == 4 and data:
            i = rng.randrange(len(data))
            data[i:i] = bytes([data[i]]) * rng.choice((2, 100, 5000))
        elif op == 5 and data:
            i = rng.randrange(len(data))
            j = rng.randrange(i, len(data) + 1)
            data[i:j] = data[i:j] * rng.choice((2, 10, 100))
        elif op == 6 and others:
            other = rng.choice(others)
            data = data[:at] + other[rng.randrange(len(other) + 1) :]
        else:
            digits = [i for i, b in enumerate(data[:4096]) if 48 <= b <= 57]
            if digits:
                i = rng.choice(digits)
                data[i : i + 1] = rng.choice((b"-1", b"9" * 30, b"1e400", b"0.5", b"99999999999"))
        del data[MUTATION_LIMIT:]
    return bytes(data)


@dataclass(frozen=True)
class FuzzSettings:
    """Iterations and seed of the fuzzers: fixed in CI, raised for long runs."""

    iterations: int
    seed: int

    @classmethod
    def from_config(cls, config: pytest.Config) -> FuzzSettings:
        iterations = config.getoption("waltz_fuzz_iterations", None) or os.environ.get(
            "WALTZ_FUZZ_ITERATIONS"
        )
        seed = config.getoption("waltz_fuzz_seed", None)
        if seed is None:
            seed = os.environ.get("WALTZ_FUZZ_SEED", "20240601")
        return cls(int(iterations or 0), int(seed))

    def scaled(self, default: int) -> int:
        """``default`` (the CI figure), or the requested iterations."""
        return self.iterations or default


TransportFactory = Callable[..., Transport]
PeerFactory = Callable[[], Awaitable[Peer]]


async def echo_handler(conn: Connection) -> None:
    try:
        while True:
            await conn.send(await conn.recv())
    except ConnectionClosedError:
        return


def _structural_bombs(messages: Sequence[bytes]) -> Iterator[bytes]:
    """Each message with each of its JSON-structural bytes (and quotes) repeated
    200,000 times in place: deep nesting and endless strings, where recursive or
    unbounded parsers fail."""
    for message in messages:
        for index, byte in enumerate(message):
            if byte in b'[{"\\':
                yield message[:index] + bytes([byte]) * 200_000 + message[index + 1 :]
        yield message[:1] + b"[" * 200_000
        yield message[:1] + b"{" * 200_000


def _rss_bytes() -> int:
    try:
        with open(f"/proc/{os.getpid()}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class TransportSuite:
    """The shared tests every transport passes; subclass it and provide ``harness``."""

    @pytest.fixture
    def harness(self) -> TransportHarness:
        raise NotImplementedError("provide a `harness` fixture returning a TransportHarness")

    @pytest.fixture(autouse=True)
    def _check_capabilities(
        self, request: pytest.FixtureRequest, harness: TransportHarness
    ) -> None:
        skip_unless_capable(request, harness)

    @pytest.fixture
    async def transports(self, harness: TransportHarness) -> AsyncIterator[TransportFactory]:
        made: list[Transport] = []

        def make(**overrides: Any) -> Transport:
            transport = harness.make_transport(**overrides)
            made.append(transport)
            return transport

        try:
            yield make
        finally:
            for transport in made:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(transport.close(), 10)

    @pytest.fixture
    async def peers(self, harness: TransportHarness) -> AsyncIterator[PeerFactory]:
        started: list[Peer] = []

        async def start() -> Peer:
            peer = await harness.start_peer()
            started.append(peer)
            return peer

        try:
            yield start
        finally:
            for peer in started:
                await peer.stop()

    # -- helpers ------------------------------------------------------------------------

    @staticmethod
    async def roundtrip(conn: Connection, payload: bytes, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            await conn.send(payload)
            assert await conn.recv() == payload

    @staticmethod
    async def closed_within(what: Callable[[], Awaitable[Any]], bound: float, label: str) -> float:
        """Run ``what`` until it raises ConnectionClosedError; return the seconds it took."""
        start = time.monotonic()
        with pytest.raises(ConnectionClosedError):
            async with asyncio.timeout(bound + SLACK):
                while True:
                    await what()
        elapsed = time.monotonic() - start
        assert elapsed <= bound + SLACK, f"{label} took {elapsed:.2f} s (bound {bound} s)"
        return elapsed

    # -- basics ------------------------------------------------------------------------------

    @pytest.mark.timeout(60)
    async def test_request_response(
        self, harness: TransportHarness, transports: TransportFactory
    ) -> None:
        server, client = transports(), transports()
        listener = await server.listen(harness.endpoint(), echo_handler)
        conn = await client.connect(listener.endpoint)
        assert not conn.closed
        assert isinstance(conn.peer, str) and conn.peer
        for payload in (b"hello", b"", bytes(range(256)) * 40, b"\x00" * 100_000):
            await self.roundtrip(conn, payload)
        second = await client.connect(listener.endpoint)
        assert second.connection_id > conn.connection_id
        await self.roundtrip(second, b"second")
        await conn.close()
        await conn.close()  # idempotent
        assert conn.closed
        with pytest.raises(ConnectionClosedError):
            await conn.send(b"after close")
        with pytest.raises(ConnectionClosedError):
            await conn.recv()
        await self.roundtrip(second, b"still fine")
        await listener.close()

    @pytest.mark.timeout(60)
    async def test_connect_to_nothing_fails_in_time(
        self, harness: TransportHarness, transports: TransportFactory
    ) -> None:
        server, client = transports(), transports()
        listener = await server.listen(harness.endpoint(), echo_handler)
        endpoint = listener.endpoint
        await listener.close()
        start = time.monotonic()
        with pytest.raises(ConnectError):
            await client.connect(endpoint, timeout=1.0)
        assert time.monotonic() - start < 1.0 + SLACK

    @pytest.mark.timeout(60)
    async def test_close_is_reported_to_the_peer(
        self, harness: TransportHarness, transports: TransportFactory
    ) -> None:
        server, client = transports(), transports()
        accepted: asyncio.Queue[Connection] = asyncio.Queue()

        async def hold(conn: Connection) -> None:
            await accepted.put(conn)
            with contextlib.suppress(ConnectionClosedError):
                while True:
                    await conn.recv()

        listener = await server.listen(harness.endpoint(), hold)
        conn = await client.connect(listener.endpoint)
        await conn.send(b"x")
        server_side = await asyncio.wait_for(accepted.get(), 10)
        await server_side.close()
        await self.closed_within(conn.recv, client.failure_detection_bound, "a peer's close")
        # closing the listener closes what it accepted
        other = await client.connect(listener.endpoint)
        await other.send(b"y")
        await asyncio.wait_for(accepted.get(), 10)
        await listener.close()
        await self.closed_within(other.recv, client.failure_detection_bound, "listener close")

    # -- ordering under load ---------------------------------------------------------------------

    @pytest.mark.timeout(120)
    async def test_ordering_under_load(
        self, transports: TransportFactory, peers: PeerFactory
    ) -> None:
        peer = await peers()
        client = transports()
        connections, frames_each = 4, 5000
        conns = [await client.connect(peer.endpoint) for _ in range(connections)]

        async def drive(index: int, conn: Connection) -> None:
            rng = random.Random(index)
            frames = [
                index.to_bytes(2, "big")
                + seq.to_bytes(4, "big")
                + rng.randbytes(rng.randrange(0, 300))
                for seq in range(frames_each)
            ]

            async def sender() -> None:
                position = 0
                while position < len(frames):
                    if rng.random() < 0.5:
                        await conn.send(frames[position])
                        position += 1
                    else:
                        chunk = frames[position : position + rng.randrange(1, 64)]
                        await conn.send_many(chunk)
                        position += len(chunk)

            send_task = asyncio.create_task(sender())
            try:
                for expected in frames:
                    got = await conn.recv()
                    assert got == expected, (
                        f"connection {index}: got frame {got[:6].hex()}, "
                        f"expected {expected[:6].hex()}"
                    )
                await send_task
            finally:
                send_task.cancel()

        async with asyncio.timeout(90):
            await asyncio.gather(*(drive(i, c) for i, c in enumerate(conns)))
        for conn in conns:
            await conn.close()

    # -- peer faults -----------------------------------------------------------------------------

    @requires(PEER_FAULTS)
    @pytest.mark.timeout(60)
    async def test_killed_peer_is_detected(
        self, transports: TransportFactory, peers: PeerFactory
    ) -> None:
        peer = await peers()
        client = transports()
        receiving = await client.connect(peer.endpoint)
        sending = await client.connect(peer.endpoint)
        await self.roundtrip(receiving, b"alive")
        await self.roundtrip(sending, b"alive")
        await peer.kill()
        bound = client.failure_detection_bound
        recv_task = asyncio.create_task(
            self.closed_within(receiving.recv, bound, "recv after kill")
        )

        async def send_one() -> None:
            await sending.send(b"x" * 1000)
            await asyncio.sleep(0.01)

        await self.closed_within(send_one, bound, "send after kill")
        await recv_task
        assert receiving.closed and sending.closed

    @requires(PEER_FAULTS)
    @pytest.mark.timeout(60)
    async def test_paused_peer_is_detected(
        self, transports: TransportFactory, peers: PeerFactory
    ) -> None:
        peer = await peers()
        client = transports()
        receiving = await client.connect(peer.endpoint)
        flooding = await client.connect(peer.endpoint)
        await self.roundtrip(receiving, b"alive")
        await self.roundtrip(flooding, b"alive")
        await peer.pause()
        try:
            bound = client.failure_detection_bound
            recv_task = asyncio.create_task(
                self.closed_within(receiving.recv, bound, "recv from a paused peer")
            )

            # a sender that fills every buffer must not wait forever either
            async def flood() -> None:
                await flooding.send(b"f" * 16384)

            await self.closed_within(flood, bound, "send to a paused peer")
            await recv_task
        finally:
            await peer.resume()
        # after it resumes, the old connections stay closed; a new one works (once the
        # resumed process caught up with what piled up meanwhile: a loaded machine is slow)
        fresh = await client.connect(peer.endpoint, timeout=30)
        await self.roundtrip(fresh, b"after resume")
        with pytest.raises(ConnectionClosedError):
            await receiving.send(b"stale")

    @requires(PEER_FAULTS)
    @pytest.mark.timeout(90)
    async def test_reconnect_after_peer_restart(
        self, transports: TransportFactory, peers: PeerFactory
    ) -> None:
        peer = await peers()
        client = transports()
        conn = await client.connect(peer.endpoint)
        await self.roundtrip(conn, b"before")
        await peer.kill()
        await self.closed_within(conn.recv, client.failure_detection_bound, "recv after kill")
        await peer.restart()
        fresh = await client.connect(peer.endpoint, timeout=20)
        await self.roundtrip(fresh, b"after restart")
        assert fresh.connection_id > conn.connection_id
        with pytest.raises(ConnectionClosedError):
            await conn.send(b"old connection")

    # -- stale connections ---------------------------------------------------------------------

    @pytest.mark.timeout(60)
    async def test_replaced_connection_delivers_nothing_after_replacement(
        self, harness: TransportHarness, transports: TransportFactory
    ) -> None:
        server, client = transports(), transports()
        delivered: list[tuple[bytes, int]] = []
        replacement_seen = asyncio.Event()

        async def record(conn: Connection) -> None:
            with contextlib.suppress(ConnectionClosedError):
                while True:
                    frame = await conn.recv()
                    delivered.append((frame[:1], conn.connection_id))
                    if frame[:1] == b"B":
                        replacement_seen.set()

        listener = await server.listen(harness.endpoint(), record)
        old = await client.connect(listener.endpoint, replace_key="partition-7")
        await old.send(b"A-first")

        async def flood_old() -> int:
            sent = 0
            with contextlib.suppress(ConnectionClosedError):
                for _ in range(200_000):
                    await old.send(b"A" + sent.to_bytes(4, "big"))
                    sent += 1
                    if sent % 64 == 0:
                        await asyncio.sleep(0)
            return sent

        flood = asyncio.create_task(flood_old())
        await asyncio.sleep(0.2)
        new = await client.connect(listener.endpoint, replace_key="partition-7")
        for i in range(100):
            await new.send(b"B" + i.to_bytes(4, "big"))
        await asyncio.wait_for(replacement_seen.wait(), 10)
        sent_old = await asyncio.wait_for(flood, 20)
        assert old.closed, "the replaced connection must be closed on the client too"
        # an independent connection (no key) is not affected
        independent = await client.connect(listener.endpoint)
        await independent.send(b"C")
        await asyncio.sleep(0.5)
        kinds = [kind for kind, _ in delivered]
        first_b = kinds.index(b"B")
        assert b"A" not in kinds[first_b:], (
            f"a frame of the replaced connection was delivered after the replacement's first "
            f"(old connection sent {sent_old})"
        )
        assert kinds.count(b"B") == 100
        with pytest.raises(ConnectionClosedError):
            await old.send(b"A-late")
        # another connection of the same key replaces `new` in turn
        newest = await client.connect(listener.endpoint, replace_key="partition-7")
        await newest.send(b"B")
        await self.closed_within(new.recv, client.failure_detection_bound, "replaced recv")

    @pytest.mark.timeout(60)
    async def test_replacement_drops_the_undelivered_frames_of_the_replaced(
        self, harness: TransportHarness, transports: TransportFactory
    ) -> None:
        """Frames of the old connection still queued at the listener (its handler had not
        read them) are never delivered once the replacement's first frame was."""
        server, client = transports(), transports()
        replacement_seen = asyncio.Event()
        old_delivered_after: list[bytes] = []
        old_ended = asyncio.Event()
        first_id: list[int] = []

        async def handler(conn: Connection) -> None:
            if not first_id:
                first_id.append(conn.connection_id)
                # the old connection's handler is slow: its frames wait in the transport
                await replacement_seen.wait()
                try:
                    while True:
                        old_delivered_after.append(await conn.recv())
                except ConnectionClosedError:
                    old_ended.set()
                return
            with contextlib.suppress(ConnectionClosedError):
                while True:
                    if (await conn.recv()).startswith(b"B"):
                        replacement_seen.set()

        listener = await server.listen(harness.endpoint(), handler)
        old = await client.connect(listener.endpoint, replace_key="k")
        for i in range(50):
            await old.send(b"A%d" % i)
        # the client closes the old connection itself first (its close reaches the
        # listener before the replacement does): what it sent is still queued there
        await old.close()
        await asyncio.sleep(0.5)
        new = await client.connect(listener.endpoint, replace_key="k")
        await new.send(b"B0")
        await asyncio.wait_for(replacement_seen.wait(), 10)
        await asyncio.wait_for(old_ended.wait(), client.failure_detection_bound + SLACK)
        assert old_delivered_after == [], (
            f"{len(old_delivered_after)} frames of the replaced connection were delivered "
            "after its replacement's first"
        )

    # -- frame size --------------------------------------------------------------------------

    @pytest.mark.timeout(60)
    async def test_oversized_frame_refused_by_sender(
        self, harness: TransportHarness, transports: TransportFactory
    ) -> None:
        limit = 64 * 1024
        server, client = transports(max_frame_size=limit), transports(max_frame_size=limit)
        listener = await server.listen(harness.endpoint(), echo_handler)
        conn = await client.connect(listener.endpoint)
        await self.roundtrip(conn, b"x" * limit)
        with pytest.raises(FrameTooLargeError):
            await conn.send(b"x" * (limit + 1))
        with pytest.raises(FrameTooLargeError):
            await conn.send_many([b"ok", b"y" * (limit + 1)])
        assert not conn.closed
        # nothing of the refused calls went out; the connection goes on
        await self.roundtrip(conn, b"after refusal")

    @pytest.mark.timeout(60)
    async def test_oversized_frame_closes_only_that_connection(
        self, harness: TransportHarness, transports: TransportFactory
    ) -> None:
        server = transports(max_frame_size=64 * 1024)
        client = transports(max_frame_size=1024 * 1024)
        listener = await server.listen(harness.endpoint(), echo_handler)
        victim = await client.connect(listener.endpoint)
        bystander = await client.connect(listener.endpoint)
        await self.roundtrip(victim, b"v")
        await self.roundtrip(bystander, b"b")
        # a connection that knows the peer's limit (Connection.max_frame_size) refuses the
        # frame at send and stays usable; one that does not sends it, and the receiver
        # closes the connection
        known = victim.max_frame_size
        assert known is None or known <= 64 * 1024, f"max_frame_size {known} above the peer's"
        try:
            await victim.send(b"z" * (200 * 1024))
        except FrameTooLargeError:
            assert known is not None, "send refused a frame below max_frame_size"
            await self.roundtrip(victim, b"still usable")
        except ConnectionClosedError:
            pass
        else:
            assert known is None, "send took a frame above the peer's max_frame_size"
        if known is None:
            await self.closed_within(victim.recv, client.failure_detection_bound, "oversized frame")
        for i in range(50):
            await self.roundtrip(bystander, b"b%d" % i)
        fresh = await client.connect(listener.endpoint)
        await self.roundtrip(fresh, b"fresh")

    # -- peer identity -------------------------------------------------------------------------

    @pytest.mark.timeout(60)
    async def test_peer_identity_is_none_unless_authenticated(
        self, harness: TransportHarness, transports: TransportFactory
    ) -> None:
        server, client = transports(), transports()
        seen: list[str | None] = []

        async def record(conn: Connection) -> None:
            seen.append(conn.peer_identity)
            await echo_handler(conn)

        listener = await server.listen(harness.endpoint(), record)
        conn = await client.connect(listener.endpoint)
        await self.roundtrip(conn, b"who")
        assert conn.peer_identity is None, "the connecting side proves nobody"
        if AUTHENTICATED_PEERS not in harness.capabilities:
            assert seen == [None]
        else:
            assert len(seen) == 1 and (seen[0] is None or isinstance(seen[0], str))

    @requires(AUTHENTICATED_PEERS)
    @pytest.mark.timeout(90)
    async def test_accepted_connections_carry_the_authenticated_identity(
        self, harness: TransportHarness, transports: TransportFactory
    ) -> None:
        setup = harness.authenticated(2)
        assert len(setup.clients) == 2
        expected = [identity for _, identity in setup.clients]
        assert all(isinstance(i, str) and i for i in expected)
        assert expected[0] != expected[1], "distinct credentials, distinct identities"

        async def tell(conn: Connection) -> None:
            # every frame is answered with the identity this side accepted for its sender
            while True:
                await conn.recv()
                await conn.send(str(conn.peer_identity).encode())

        server = transports(**setup.listener)
        listeners = [await server.listen(harness.endpoint(), tell) for _ in range(2)]
        for (options, identity), name in zip(setup.clients, ("first", "second"), strict=True):
            client = transports(**options)
            for listener in listeners:  # the same identity on every listener
                for replace_key in (None, name, name):  # and on every connection, replaced too
                    conn = await client.connect(listener.endpoint, replace_key=replace_key)
                    assert conn.peer_identity is None
                    async with asyncio.timeout(10):
                        await conn.send(b"who am I?")
                        assert (await conn.recv()).decode() == identity
                    if replace_key is None:
                        await conn.close()

    # -- malformed input -----------------------------------------------------------------------

    @requires(MALFORMED_INPUT)
    @pytest.mark.timeout(60)
    async def test_malformed_input_harms_no_other_connection(
        self, harness: TransportHarness, transports: TransportFactory
    ) -> None:
        server, client = transports(), transports()
        listener = await server.listen(harness.endpoint(), echo_handler)
        conn = await client.connect(listener.endpoint)
        await self.roundtrip(conn, b"before")
        await harness.send_malformed(listener.endpoint)
        for i in range(20):
            await self.roundtrip(conn, b"after %d" % i)
        fresh = await client.connect(listener.endpoint)
        await self.roundtrip(fresh, b"new connection")

    # -- control-plane fuzzing -------------------------------------------------------------------

    @pytest.fixture
    def fuzz(self, request: pytest.FixtureRequest) -> FuzzSettings:
        return FuzzSettings.from_config(request.config)

    @requires(CONTROL_FUZZ)
    @pytest.mark.timeout(120)
    def test_control_codec_fuzz(self, harness: TransportHarness, fuzz: FuzzSettings) -> None:
        """The codec of every control message takes any bytes: a message or a
        ProtocolError, never another exception (RecursionError, UnicodeError...)."""
        plane = harness.control_plane()
        rng = random.Random(fuzz.seed)
        valid = [plane.opening(rng) for _ in range(4)] + list(plane.messages)
        for message in valid:
            plane.decode(message)  # the samples themselves decode
        inputs: Iterator[bytes] = itertools.chain(
            _structural_bombs(valid),
            plane.malformed_openings,
            plane.malformed_messages,
            (mutate(rng, rng.choice(valid), valid) for _ in range(fuzz.scaled(20_000))),
        )
        for count, message in enumerate(inputs):
            try:
                plane.decode(message)
            except ProtocolError:
                pass
            except Exception as exc:
                raise AssertionError(
                    f"input {count} (seed {fuzz.seed}) raised {type(exc).__name__}: {exc}; "
                    f"input starts {message[:60]!r} ({len(message)} bytes)"
                ) from exc

    @requires(CONTROL_FUZZ)
    @pytest.mark.timeout(300)
    async def test_control_plane_fuzz_live(
        self,
        harness: TransportHarness,
        transports: TransportFactory,
        fuzz: FuzzSettings,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """A live listener fed mutated handshakes, and valid handshakes followed by
        mutated flow-control, heartbeat and data messages: each bad connection gets a
        refusal, nothing escapes to the event loop, no error is logged, and a healthy
        connection beside them keeps working, as does a new one."""
        plane = harness.control_plane()
        rng = random.Random(fuzz.seed)
        loop = asyncio.get_running_loop()
        escaped: list[dict[str, Any]] = []
        previous_handler = loop.get_exception_handler()
        loop.set_exception_handler(lambda _, context: escaped.append(context))
        server, client = transports(), transports()
        listener = await server.listen(harness.endpoint(), echo_handler)
        healthy = await client.connect(listener.endpoint)
        dialer = harness.raw_dialer(listener.endpoint)
        caplog.set_level(logging.WARNING)
        try:
            await self.roundtrip(healthy, b"before")

            async def expect_refusal(raw: RawConnection, what: str) -> None:
                deadline = loop.time() + 10 + SLACK
                while (left := deadline - loop.time()) > 0:
                    answer = await raw.recv(left)
                    if answer is not None and plane.refusal(answer):
                        return
                raise AssertionError(f"no refusal of {what} within {10 + SLACK} s")

            # known-bad inputs: each answered on its own connection
            for bad in [*_structural_bombs([plane.opening(rng)]), *plane.malformed_openings]:
                raw = await dialer.open()
                await raw.send(bad)
                await expect_refusal(raw, f"the opening {bad[:40]!r} ({len(bad)} bytes)")
                await raw.close()
            for bad in plane.malformed_messages:
                raw = await dialer.open()
                await raw.send(plane.opening(rng))
                await raw.send(bad)
                await expect_refusal(raw, f"the message {bad[:40]!r} after a valid opening")
                await raw.close()
            # random mutations, live; the listener's first answer (a welcome, a refusal)
            # shows the input arrived
            iterations, answered = fuzz.scaled(300), 0
            for i in range(iterations):
                raw = await dialer.open()
                if rng.random() < 0.5:
                    await raw.send(mutate(rng, plane.opening(rng), plane.messages))
                else:
                    await raw.send(plane.opening(rng))
                    for _ in range(rng.randint(1, 4)):
                        await raw.send(mutate(rng, rng.choice(plane.messages), plane.messages))
                answered += await raw.recv(1.0) is not None
                await raw.close()
                if i % 50 == 0:
                    await self.roundtrip(healthy, b"during %d" % i)
            await dialer.close()  # what is still queued reaches the listener first
            assert answered >= iterations // 2, f"only {answered} of {iterations} answered"
            await self.roundtrip(healthy, b"after")
            fresh = await client.connect(listener.endpoint)
            await self.roundtrip(fresh, b"a new connection")
        finally:
            await dialer.close()
            loop.set_exception_handler(previous_handler)
        assert escaped == [], f"exceptions escaped to the event loop: {escaped[:3]}"
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert errors == [], f"errors logged: {[r.getMessage()[:200] for r in errors[:3]]}"

    # -- back pressure --------------------------------------------------------------------------

    @pytest.mark.timeout(90)
    async def test_memory_bounded_while_receiver_stalls(
        self, harness: TransportHarness, transports: TransportFactory
    ) -> None:
        options = harness.small_buffer_options()
        frame_size = 64 * 1024
        bound = harness.stalled_receiver_bound({**harness.options, **options}, frame_size)
        server, client = transports(**options), transports(**options)
        release = asyncio.Event()
        received: list[bytes] = []
        enough = asyncio.Event()

        async def stalled(conn: Connection) -> None:
            await release.wait()
            with contextlib.suppress(ConnectionClosedError):
                while True:
                    received.append(await conn.recv())
                    if len(received) >= 4 * (bound // frame_size + 1):
                        enough.set()

        listener = await server.listen(harness.endpoint(), stalled)
        conn = await client.connect(listener.endpoint)
        attempt = 64 * 1024 * 1024  # far beyond any sane buffer
        sent = 0
        rss_before = _rss_bytes()

        async def flood() -> None:
            nonlocal sent
            while sent < attempt:
                await conn.send(sent.to_bytes(8, "big") + b"s" * (frame_size - 8))
                sent += frame_size

        sender = asyncio.create_task(flood())
        try:
            # wait until the sender makes no progress for a while: it is blocked
            last, still_since = -1, time.monotonic()
            async with asyncio.timeout(30):
                while time.monotonic() - still_since < 1.5:
                    await asyncio.sleep(0.1)
                    if sent != last:
                        last, still_since = sent, time.monotonic()
                    assert not sender.done(), "send never waited: nothing bounds the buffers"
            assert sent <= bound, f"send accepted {sent} bytes; the declared bound is {bound}"
            rss_growth = _rss_bytes() - rss_before
            assert rss_growth < 48 * 1024 * 1024, f"memory grew by {rss_growth} bytes"
            assert not conn.closed, "a stalled receiver is not a dead one"
            # releasing the receiver releases the sender, in order
            release.set()
            await asyncio.wait_for(enough.wait(), 30)
            assert sent > bound
            for index, frame in enumerate(received[:200]):
                assert int.from_bytes(frame[:8], "big") == index * frame_size
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosedError):
                await sender
