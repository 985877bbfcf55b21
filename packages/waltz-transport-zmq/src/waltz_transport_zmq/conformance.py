"""The conformance harness of the ZeroMQ transport: real sockets, peers in real processes.

Imported only by the conformance suite (it needs ``waltz_conformance``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from waltz_api.contracts.transport import Transport
from waltz_conformance.suites.transport import Peer, ProcessPeer, TransportHarness
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
        capabilities=frozenset({"processes", "peer_faults", "malformed_input"}),
        options=given,
        scheme=scheme,
    )
