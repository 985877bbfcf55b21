"""A PROTOCOL TEST PEER: the far end of the client's connections, scripted by a test.

It is not a Waltz server and stands in for none: it stores nothing, checks no
lock, commits nothing by itself. It accepts connections on a real transport
(the ``memory`` plugin), does the real Hello handshake as the acceptor, decodes
every frame with the real codec (``waltz_api.wire``), and hands each message to
the test, which decides what to answer. What it checks is the client's side of
the protocol: what the client sends, in which order, and how it reacts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import TypeVar

from waltz_api.contracts.transport import Connection, Listener, Transport
from waltz_api.errors import TransportError
from waltz_api.messages import Message, TransactionDataRequest, TransactionDataResponse
from waltz_api.plugins import get_registry
from waltz_api.types import ReqId
from waltz_api.wire import ProtocolConnection, Role, checksum

_names = itertools.count()
M = TypeVar("M", bound=Message)


@dataclass(eq=False)
class PeerConnection:
    conn: Connection
    proto: ProtocolConnection
    received: list[Message] = field(default_factory=list)

    async def send(self, *messages: Message) -> None:
        await self.conn.send_many([self.proto.send(m) for m in messages])


class ProtocolTestPeer:
    """A scripted protocol peer (``memory`` or ``zmq`` transport): ``expect`` the
    client's messages, answer them."""

    def __init__(self, *, transport: str = "memory", answer_data: bool = True) -> None:
        self.transport_name = transport
        self.transport: Transport = get_registry().get("transport", transport).factory({})
        self.endpoint = (
            f"memory://waltz-client-protocol-peer-{next(_names)}"
            if transport == "memory"
            else "tcp://127.0.0.1:0"
        )
        self.connections: list[PeerConnection] = []
        self.data: dict[tuple[int, int], bytes] = {}
        """Transaction data the peer answers TransactionDataRequests with (answer_data)."""
        self.answer_data = answer_data
        self.data_requests: list[TransactionDataRequest] = []
        self._inbox: asyncio.Queue[tuple[PeerConnection, Message]] = asyncio.Queue()
        self._backlog: list[tuple[PeerConnection, Message]] = []
        self._listener: Listener | None = None

    async def start(self) -> ProtocolTestPeer:
        self._listener = await self.transport.listen(self.endpoint, self._serve)
        self.endpoint = self._listener.endpoint
        return self

    async def close(self) -> None:
        await self.transport.close()

    async def _serve(self, conn: Connection) -> None:
        proto = ProtocolConnection(Role.ACCEPTOR, sender="protocol-test-peer")
        try:
            proto.receive_frame(await conn.recv())
            await conn.send(proto.send(proto.hello_response()))
            peer = PeerConnection(conn, proto)
            self.connections.append(peer)
            while True:
                message = proto.receive_frame(await conn.recv())
                peer.received.append(message)
                if isinstance(message, TransactionDataRequest) and self.answer_data:
                    self.data_requests.append(message)
                    await peer.send(self._data_response(message))
                    continue
                await self._inbox.put((peer, message))
        except TransportError:
            return

    def _data_response(self, request: TransactionDataRequest) -> TransactionDataResponse:
        key = (request.req_id.partition_id, request.transaction_id)
        data = self.data.get(key)
        if data is None:
            return TransactionDataResponse(
                request.req_id, request.transaction_id, False, error="no such transaction"
            )
        return TransactionDataResponse(
            request.req_id, request.transaction_id, True, data, checksum(data)
        )

    async def expect(
        self, kind: type[M], timeout: float = 10.0, *, partition: int | None = None
    ) -> tuple[PeerConnection, M]:
        """The next message of ``kind`` (of ``partition``), keeping others for later."""

        def matches(message: Message) -> bool:
            if not isinstance(message, kind):
                return False
            req_id: ReqId = message.req_id  # type: ignore[attr-defined]
            return partition is None or req_id.partition_id == partition

        for i, (peer, message) in enumerate(self._backlog):
            if matches(message):
                del self._backlog[i]
                assert isinstance(message, kind)
                return peer, message
        async with asyncio.timeout(timeout):
            while True:
                peer, message = await self._inbox.get()
                if matches(message):
                    assert isinstance(message, kind)
                    return peer, message
                self._backlog.append((peer, message))

    async def next_message(self, timeout: float = 10.0) -> tuple[PeerConnection, Message]:
        """The client's next message, whatever its kind (those kept by ``expect`` first)."""
        if self._backlog:
            return self._backlog.pop(0)
        async with asyncio.timeout(timeout):
            return await self._inbox.get()

    async def nothing_more(self, kind: type[Message], wait: float = 0.3) -> None:
        """Assert that no message of ``kind`` arrives within ``wait`` seconds."""
        with contextlib.suppress(TimeoutError):
            _, message = await self.expect(kind, wait)
            raise AssertionError(f"unexpected {message} from the client")

    async def drop_connections(self) -> None:
        """Close every accepted connection (what a server crash looks like to a client)."""
        for peer in self.connections:
            await peer.conn.close()
        self.connections.clear()
