"""The listener against hostile and broken peers: the handshake parsed within limits,
a refusal per bad connection, one rate-limited log line, announced windows capped."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import zmq
import zmq.asyncio

from waltz_api.contracts.transport import Connection
from waltz_api.errors import ConfigError, ConnectionClosedError, FrameTooLargeError, ProtocolError
from waltz_transport_zmq import ZmqTransport
from waltz_transport_zmq import protocol as p
from waltz_transport_zmq.logs import PeerLog

pytestmark = pytest.mark.timeout(60)


async def echo(conn: Connection) -> None:
    try:
        while True:
            await conn.send(await conn.recv())
    except ConnectionClosedError:
        return


def hello(**fields: object) -> bytes:
    body: dict[str, object] = {
        "version": p.PROTOCOL_VERSION,
        "client": "c" * 32,
        "seq": 1,
        "replace_key": None,
        "window_frames": 64,
        "window_bytes": 65536,
        "max_frame_size": 1 << 20,
    }
    body.update(fields)
    return p.control(p.KIND_HELLO, body)


# -- the codec --------------------------------------------------------------------------------


def test_a_valid_hello_round_trips() -> None:
    message = p.Hello(
        version=1,
        client="ab" * 16,
        seq=3,
        replace_key="partition-7",
        window_frames=10,
        window_bytes=2000,
        max_frame_size=1 << 20,
    )
    assert p.parse_hello(message.encode()) == message
    welcome = p.Welcome(version=1, id=4, window_frames=5, window_bytes=6, max_frame_size=7)
    assert p.parse_welcome(welcome.encode()) == welcome


@pytest.mark.parametrize(
    ("message", "says"),
    [
        (bytes([p.KIND_HELLO]) + b"[" * 200_000, "above the limit of 4096"),
        (bytes([p.KIND_HELLO]) + b"[" * 2000, "not a flat JSON object"),
        (bytes([p.KIND_HELLO]) + b'{"a":{"b":1}}', "not a flat JSON object"),
        (bytes([p.KIND_HELLO]) + b"\xff", "not UTF-8"),
        (bytes([p.KIND_HELLO]) + b"[1]", "not a JSON object"),
        (bytes([p.KIND_HELLO]) + b'"text"', "not a JSON object"),
        (hello(version=2), "protocol version 2 is not supported"),
        (hello(version="1"), "'version' must be an integer"),
        (hello(seq=-1), "'seq' must be an integer in 0.."),
        (hello(seq=True), "'seq' must be an integer"),
        (hello(window_frames=0), "'window_frames' must be an integer in 1.."),
        (hello(window_frames=2**40), "'window_frames' must be an integer in 1..4294967295"),
        (hello(window_bytes=2**70), "'window_bytes'"),
        (hello(client=""), "'client' must not be empty"),
        (hello(client="c" * 129), "'client' must be printable ASCII of at most 128"),
        (hello(client="\ud800"), "'client' must be printable ASCII"),
        (hello(replace_key="a\nb"), "'replace_key' must be printable ASCII"),
        (hello(**{f"f{i}": i for i in range(40)}), "fields, at most 32"),
    ],
)
def test_a_bad_hello_is_a_protocol_error_naming_what_is_wrong(message: bytes, says: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        p.parse_hello(message)
    assert says in str(caught.value)


def test_control_messages_of_the_wrong_size_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="malformed credit"):
        p.parse_credit(p.CREDIT.pack(p.KIND_CREDIT, 1, 1) + b"x")
    with pytest.raises(ProtocolError, match="malformed heartbeat"):
        p.parse_heartbeat(p.HEARTBEAT.pack(p.KIND_HEARTBEAT, 1)[:-1])
    assert p.parse_close(bytes([p.KIND_CLOSE]) + b"bye\n\x1b[31m" + b"x" * 5000) == (
        "bye??[31m" + "x" * (p.MAX_CLOSE_REASON - 9)
    )


# -- a live listener ----------------------------------------------------------------------------


async def raw_exchange(endpoint: str, *messages: bytes, answers: int = 1) -> list[bytes]:
    """Send ``messages`` from a bare DEALER; the listener's first ``answers`` replies."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, os.urandom(16))
    try:
        dealer.connect(endpoint)
        for message in messages:
            await dealer.send(message)
        async with asyncio.timeout(30):
            return [await dealer.recv() for _ in range(answers)]
    finally:
        dealer.close(linger=0)
        context.term()


async def test_a_nesting_bomb_hello_is_refused_and_the_listener_reads_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The issue's input: ``s.send(b"\\x10" + b"[" * 200000)`` to a plaintext listener
    raised a RecursionError in the reader callback, which stopped rescheduling."""
    server, client = ZmqTransport(), ZmqTransport()
    loop = asyncio.get_running_loop()
    escaped: list[object] = []
    loop.set_exception_handler(lambda _, context: escaped.append(context))
    caplog.set_level(logging.WARNING, logger="waltz_transport_zmq.transport")
    try:
        listener = await server.listen("tcp://127.0.0.1:*", echo)
        healthy = await client.connect(listener.endpoint, timeout=30)
        for _ in range(3):
            (answer,) = await raw_exchange(listener.endpoint, b"\x10" + b"[" * 200_000)
            assert answer[:1] == bytes([p.KIND_CLOSE])
            assert "refused: hello of 200000 bytes is above the limit" in p.parse_close(answer)
        await healthy.send(b"still here")
        assert await asyncio.wait_for(healthy.recv(), 30) == b"still here"
        fresh = await client.connect(listener.endpoint, timeout=30)
        await fresh.send(b"new")
        assert await asyncio.wait_for(fresh.recv(), 30) == b"new"
    finally:
        loop.set_exception_handler(None)
        await client.close()
        await server.close()
    assert escaped == []
    refusals = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert 1 <= len(refusals) <= 3 and all("\n" not in r.getMessage() for r in refusals)


async def test_a_broken_message_closes_only_its_connection_with_a_protocol_error() -> None:
    server, client = ZmqTransport(), ZmqTransport()
    try:
        listener = await server.listen("tcp://127.0.0.1:*", echo)
        healthy = await client.connect(listener.endpoint, timeout=30)
        welcome, close = await raw_exchange(
            listener.endpoint, hello(), p.CREDIT.pack(p.KIND_CREDIT, 5, 5), answers=2
        )
        assert welcome[:1] == bytes([p.KIND_WELCOME])
        assert p.parse_close(close) == "protocol error: credit for frames never sent"
        await healthy.send(b"ok")
        assert await asyncio.wait_for(healthy.recv(), 30) == b"ok"
    finally:
        await client.close()
        await server.close()


async def test_an_absurd_announced_window_is_capped_at_the_listeners_own() -> None:
    server = ZmqTransport({"window_frames": 100, "window_bytes": 100_000})
    accepted: asyncio.Queue[Connection] = asyncio.Queue()

    async def keep(conn: Connection) -> None:
        await accepted.put(conn)
        await asyncio.Event().wait()

    try:
        listener = await server.listen("tcp://127.0.0.1:*", keep)
        (welcome,) = await raw_exchange(
            listener.endpoint, hello(window_frames=2**32 - 1, window_bytes=2**63 - 1)
        )
        assert p.parse_welcome(welcome).window_bytes == 100_000
        conn = await asyncio.wait_for(accepted.get(), 30)
        assert (conn._peer_window_frames, conn._peer_window_bytes) == (100, 100_000)  # type: ignore[attr-defined]
    finally:
        await server.close()


async def test_a_replace_key_the_listener_would_refuse_is_a_config_error() -> None:
    transport = ZmqTransport()
    try:
        with pytest.raises(ConfigError, match="replace_key"):
            await transport.connect("tcp://127.0.0.1:1", replace_key="x" * 300)
    finally:
        await transport.close()


# -- the log ----------------------------------------------------------------------------------


def test_the_peer_log_writes_each_peer_once_and_bounds_the_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    peers = PeerLog(
        logging.getLogger("test.peers"),
        burst=3,
        interval=60,
        repeat_after=600,
        clock=lambda: now[0],
    )
    caplog.set_level(logging.INFO, logger="test.peers")
    assert peers.log(logging.WARNING, "a", "refused %s", "a")
    assert not peers.log(logging.WARNING, "a", "refused %s", "a")  # the same peer: once
    assert peers.log(logging.WARNING, "b", "refused %s", "b")
    assert peers.log(logging.WARNING, "c", "refused %s", "c")
    assert not peers.log(logging.WARNING, "d", "refused %s", "d")  # the burst is spent
    now[0] = 61.0
    assert peers.log(logging.WARNING, "d", "refused %s", "d")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a",
        "refused b (1 similar lines left out before this one)",
        "refused c",
        "refused d (1 similar lines left out before this one)",
    ]
    now[0] = 700.0  # long after: the same peer is written about again
    assert peers.log(logging.WARNING, "a", "refused %s", "a")


async def test_a_frame_above_the_peers_smaller_limit_is_refused_at_send() -> None:
    """Each side learns the other's max_frame_size in the handshake: a frame the peer
    would refuse (and close the connection for) fails ``send`` at once instead, and the
    connection stays usable."""
    server = ZmqTransport({"max_frame_size": 1 << 16})
    client = ZmqTransport({"max_frame_size": 1 << 20})
    accepted: asyncio.Queue[Connection] = asyncio.Queue()

    async def keep(conn: Connection) -> None:
        await accepted.put(conn)
        await asyncio.Event().wait()

    try:
        listener = await server.listen("tcp://127.0.0.1:*", keep)
        conn = await client.connect(listener.endpoint, timeout=30)
        served = await asyncio.wait_for(accepted.get(), 30)
        assert conn.max_frame_size == served.max_frame_size == 1 << 16
        with pytest.raises(FrameTooLargeError, match="the peer's max_frame_size 65536"):
            await conn.send(b"x" * ((1 << 16) + 1))
        with pytest.raises(FrameTooLargeError):
            await conn.send_many([b"ok", b"x" * ((1 << 16) + 1)])
        await conn.send(b"y" * (1 << 16))
        assert await asyncio.wait_for(served.recv(), 30) == b"y" * (1 << 16)
        assert not conn.closed
    finally:
        await client.close()
        await server.close()
