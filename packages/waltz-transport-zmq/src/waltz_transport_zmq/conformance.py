"""The conformance harness of the ZeroMQ transport: real sockets, peers in real processes.

Imported only by the conformance suite (it needs ``waltz_conformance``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import shutil
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from waltz_api.capabilities import (
    AUTHENTICATED_PEERS,
    CONTROL_FUZZ,
    MALFORMED_INPUT,
    PEER_FAULTS,
    PROCESSES,
)
from waltz_api.contracts.transport import DEFAULT_MAX_FRAME_SIZE, Transport
from waltz_conformance.suites.transport import (
    Authenticated,
    ControlPlane,
    Peer,
    ProcessPeer,
    RawConnection,
    RawDialer,
    TransportHarness,
)
from waltz_transport_zmq import protocol as p
from waltz_transport_zmq.keys import generate_keypair
from waltz_transport_zmq.options import ZmqOptions
from waltz_transport_zmq.protocol import KIND_HELLO
from waltz_transport_zmq.transport import ZmqTransport

_counter = itertools.count(1)


@dataclass(kw_only=True)
class ZmqTransportHarness(TransportHarness):
    """``scheme`` is ``tcp`` (loopback, port chosen by the OS) or ``ipc`` (a temp dir)."""

    scheme: str = "tcp"
    ipc_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="waltz-zmq-"))

    def create(self, options: Mapping[str, Any]) -> Transport:
        return ZmqTransport(options)

    def endpoint(self) -> str:
        if self.scheme == "ipc":
            return f"ipc://{self.ipc_dir}/s{os.getpid()}-{next(_counter)}.sock"
        return "tcp://127.0.0.1:*"

    async def start_peer(self) -> Peer:
        peer = ProcessPeer("zmq", self.endpoint(), self.options)
        await peer.start()
        return peer

    def small_buffer_options(self) -> dict[str, Any]:
        return {"window_bytes": 256 * 1024, "window_frames": 64}

    def stalled_receiver_bound(self, options: Mapping[str, Any], frame_size: int) -> int:
        # credit flow control: a sender stops once window_bytes are unconsumed, so at most
        # one frame beyond the window is ever accepted
        opts = ZmqOptions.from_mapping(options)
        return min(opts.window_bytes + frame_size, opts.window_frames * frame_size)

    def control_plane(self) -> ControlPlane:
        return ControlPlane(
            opening=_hello,
            messages=[
                p.CREDIT.pack(p.KIND_CREDIT, 0, 0),
                p.HEARTBEAT.pack(p.KIND_HEARTBEAT, 0),
                p.DATA_HEADER.pack(p.KIND_DATA, 0) + b"payload",
                p.DATA_HEADER.pack(p.KIND_BATCH, 0)
                + p.LENGTH.pack(3)
                + b"one"
                + p.LENGTH.pack(3)
                + b"two",
                p.close_message("bye"),
                p.Welcome(
                    version=p.PROTOCOL_VERSION,
                    id=1,
                    window_frames=64,
                    window_bytes=65536,
                    max_frame_size=1 << 20,
                ).encode(),
            ],
            decode=lambda message: p.decode(message, DEFAULT_MAX_FRAME_SIZE),
            refusal=lambda message: message[:1] == bytes([p.KIND_CLOSE]),
            malformed_openings=_MALFORMED_HELLOS,
            malformed_messages=[
                p.CREDIT.pack(p.KIND_CREDIT, 10, 10),  # credit for frames never sent
                p.CREDIT.pack(p.KIND_CREDIT, 0, 0)[:-1],
                p.HEARTBEAT.pack(p.KIND_HEARTBEAT, 5),  # 5 sent, none arrived
                p.HEARTBEAT.pack(p.KIND_HEARTBEAT, 0) + b"x",
                p.DATA_HEADER.pack(p.KIND_DATA, 7) + b"a gap",
                p.DATA_HEADER.pack(p.KIND_BATCH, 0) + p.LENGTH.pack(100) + b"cut",
                p.DATA_HEADER.pack(p.KIND_BATCH, 0),
                bytes([p.KIND_DATA, 0]),
                bytes([99]) + b"unknown kind",
            ],
        )

    def raw_dialer(self, endpoint: str) -> RawDialer:
        return _ZmqRawDialer(endpoint)

    def authenticated(self, clients: int) -> Authenticated:
        # CurveZMQ: a server key pair, one key pair per client, all clients authorized
        keys = Path(tempfile.mkdtemp(prefix="waltz-zmq-keys-"))
        authorized = keys / "authorized"
        authorized.mkdir()
        server = generate_keypair(keys, "server")
        made: list[tuple[dict[str, Any], str]] = []
        for index in range(clients):
            pair = generate_keypair(keys, f"client{index}")
            shutil.copy(pair.public_file, authorized)
            made.append(
                (
                    {
                        "curve_server_public_key": str(server.public_file),
                        "curve_client_key": str(pair.secret_file),
                    },
                    pair.public_key,
                )
            )
        return Authenticated(
            listener={
                "curve_server_key": str(server.secret_file),
                "curve_authorized_keys": str(authorized),
            },
            clients=made,
        )

    async def send_malformed(self, endpoint: str) -> None:
        rng = random.Random(7)
        loop = asyncio.get_running_loop()
        # 1. raw garbage on the stream socket: the ZMTP handshake fails, libzmq drops it
        await loop.run_in_executor(None, _raw_garbage, endpoint, rng.randbytes(4096))
        # 2. well-formed ZeroMQ carrying garbage: unknown kinds, bad hellos, multipart, junk
        context = zmq.asyncio.Context()
        try:
            for attempt in range(3):
                dealer = context.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 500)
                dealer.connect(endpoint)
                junk = [rng.randbytes(rng.randrange(1, 200)) for _ in range(20)] + [
                    bytes([KIND_HELLO]) + b"{not json",
                    bytes([KIND_HELLO]) + b'{"version": 1}',
                    bytes([KIND_HELLO]) + b'{"version": 99, "client": "x", "seq": 1}',
                    bytes([KIND_HELLO]) + b"[1, 2, 3]",
                    b"",
                    bytes([1, 0, 0, 0, 0]) + b"data from nobody",
                ]
                for message in junk:
                    await dealer.send(message)
                await dealer.send_multipart([b"two", b"parts", b"three"])
                # a stream that opens properly, then breaks the protocol
                if attempt == 0:
                    await dealer.send(
                        bytes([KIND_HELLO])
                        + b'{"version":1,"client":"evil","seq":1,"window_frames":4,'
                        b'"window_bytes":100}'
                    )
                    for _ in range(5):
                        await dealer.send(rng.randbytes(50))
                await asyncio.sleep(0.2)
                dealer.close()
        finally:
            context.term()


def _hello(rng: random.Random, **fields: Any) -> bytes:
    body: dict[str, Any] = {
        "version": p.PROTOCOL_VERSION,
        "client": rng.randbytes(16).hex(),
        "seq": rng.randrange(1, 2**31),
        "replace_key": rng.choice([None, "fuzz"]),
        "window_frames": 64,
        "window_bytes": 65536,
        "max_frame_size": 1 << 20,
    }
    body.update(fields)
    return p.control(p.KIND_HELLO, body)


_rng = random.Random(0)
_MALFORMED_HELLOS = [
    bytes([p.KIND_HELLO]) + b"[" * 200_000,  # a nesting bomb (was a RecursionError)
    bytes([p.KIND_HELLO]) + b"[" * 900 + b"]" * 900,  # deep but small
    bytes([p.KIND_HELLO]) + b'{"version":1,"x":' + b"[" * 500 + b"]" * 500 + b"}",
    bytes([p.KIND_HELLO]) + b"not json",
    bytes([p.KIND_HELLO]) + b"\xff\xfe\x00",
    bytes([p.KIND_HELLO]) + b"[1,2,3]",
    bytes([p.KIND_HELLO]) + b"1" * 4000,
    bytes([p.KIND_HELLO]),
    _hello(_rng, version="1"),
    _hello(_rng, version=2),
    _hello(_rng, version=True),
    _hello(_rng, seq=-1),
    _hello(_rng, seq=2**64),
    _hello(_rng, seq=1.5),
    _hello(_rng, window_frames=0),
    _hello(_rng, window_bytes=-5),
    _hello(_rng, window_frames=int("9" * 1000)),
    _hello(_rng, client=""),
    _hello(_rng, client="c" * 10_000),
    _hello(_rng, client="\ud800"),  # a lone surrogate, as JSON escapes allow
    _hello(_rng, client=["a"]),
    _hello(_rng, replace_key="line\nbreak"),
    _hello(_rng, replace_key={"a": 1}),
    _hello(_rng, **{f"extra{i}": i for i in range(40)}),
    bytes([p.KIND_HELLO]) + b'{"version":1,"client":"x","seq":NaN}',
]


class _ZmqRawConnection(RawConnection):
    def __init__(self, dealer: zmq.asyncio.Socket) -> None:
        self._socket = dealer

    async def send(self, message: bytes) -> None:
        await self._socket.send(message)

    async def recv(self, timeout: float) -> bytes | None:
        if not await self._socket.poll(int(max(timeout, 0.0) * 1000)):
            return None
        return await self._socket.recv()

    async def close(self) -> None:
        self._socket.close()


class _ZmqRawDialer(RawDialer):
    """DEALER sockets of a context of their own, one per raw connection."""

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self._context = zmq.asyncio.Context()
        self._sockets: list[zmq.asyncio.Socket] = []

    async def open(self) -> RawConnection:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 2000)  # what was sent still goes after close
        dealer.setsockopt(zmq.ROUTING_ID, os.urandom(16))
        dealer.connect(self._endpoint)
        self._sockets.append(dealer)
        return _ZmqRawConnection(dealer)

    async def close(self) -> None:
        if self._context.closed:
            return
        for dealer in self._sockets:
            dealer.close()
        await asyncio.get_running_loop().run_in_executor(None, self._context.term)


def _raw_garbage(endpoint: str, garbage: bytes) -> None:
    if endpoint.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: Any = endpoint[len("ipc://") :]
    else:
        host, port = endpoint[len("tcp://") :].rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = (host, int(port))
    with sock:
        sock.settimeout(5)
        sock.connect(address)
        with contextlib.suppress(OSError):
            sock.sendall(garbage)
            sock.recv(1024)


def harness(options: Mapping[str, Any] | None = None) -> ZmqTransportHarness:
    """The harness over tcp:// (``{"scheme": "ipc"}`` for ipc://)."""
    given = dict(options or {})
    scheme = str(given.pop("scheme", "tcp"))
    return ZmqTransportHarness(
        name=f"zmq-{scheme}",
        capabilities=frozenset(
            {PROCESSES, PEER_FAULTS, MALFORMED_INPUT, CONTROL_FUZZ, AUTHENTICATED_PEERS}
        ),
        options=given,
        scheme=scheme,
    )
