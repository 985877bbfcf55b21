"""The outbox: order, batching, bounds and back pressure, ends and failures."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from waltz_api.contracts.transport import Connection
from waltz_api.errors import ConnectionClosedError, TransportError, WaltzError
from waltz_api.messages import FlushRequest, Message
from waltz_api.outbox import Outbox
from waltz_api.types import ReqId


class _Conn(Connection):
    """A connection that records each ``send_many`` batch; ``gate`` holds sends back
    (a peer that does not read) and ``broken`` makes the next send fail."""

    def __init__(self) -> None:
        self.batches: list[list[bytes]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.broken = False
        self.entered = 0
        """How many ``send_many`` calls began."""
        self._closed = False

    @property
    def connection_id(self) -> int:
        return 1

    @property
    def peer(self) -> str:
        return "peer"

    @property
    def closed(self) -> bool:
        return self._closed

    async def send(self, frame: bytes) -> None:
        await self.send_many([frame])

    async def send_many(self, frames: list[bytes]) -> None:
        self.entered += 1
        await self.gate.wait()
        if self.broken:
            raise TransportError("the peer went away")
        self.batches.append(frames)

    async def recv(self) -> bytes:  # pragma: no cover - not used
        raise ConnectionClosedError("send only")

    async def close(self) -> None:
        self._closed = True


def _message(seq: int) -> Message:
    return FlushRequest(ReqId(1, 1, 0, seq))


def _encode(message: Message) -> bytes:
    assert isinstance(message, FlushRequest)
    return b"%d" % message.req_id.seq_num


async def _until(check: Callable[[], bool], what: str) -> None:
    for _ in range(5000):
        if check():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never {what}")


async def test_messages_go_out_in_order_and_a_burst_in_one_batch() -> None:
    conn = _Conn()
    outbox = Outbox(conn, _encode)
    for seq in range(5):
        await outbox.put(_message(seq))
    assert outbox.post(_message(5))
    await outbox.flush_and_stop(timeout=5)
    assert [f for batch in conn.batches for f in batch] == [b"%d" % i for i in range(6)]
    assert len(conn.batches) == 1
    assert outbox.closed


async def test_put_waits_while_full_and_post_refuses() -> None:
    conn = _Conn()
    conn.gate.clear()  # the peer does not read
    outbox = Outbox(conn, _encode, max_frames=2)
    await outbox.put(_message(0))
    await _until(lambda: conn.entered == 1, "took the first")
    assert outbox.queued_frames == 1 and not outbox.full()
    await outbox.put(_message(1))
    await outbox.put(_message(2))
    assert outbox.full()
    assert not outbox.post(_message(3))
    waiting = asyncio.create_task(outbox.put(_message(4)))
    await asyncio.sleep(0.01)
    assert not waiting.done(), "put did not wait for room"
    conn.gate.set()
    await asyncio.wait_for(waiting, 5)
    await outbox.flush_and_stop(timeout=5)
    assert [f for batch in conn.batches for f in batch] == [b"0", b"1", b"2", b"4"]


async def test_a_byte_bound_also_fills_the_queue() -> None:
    conn = _Conn()
    conn.gate.clear()
    outbox = Outbox(conn, _encode, max_bytes=3)
    await outbox.put(_message(0))
    await _until(lambda: conn.entered == 1, "took the first")
    assert outbox.post(_message(10))
    assert outbox.post(_message(11))  # 4 bytes queued now
    assert not outbox.post(_message(12))
    await outbox.close()


async def test_a_transport_failure_ends_it_and_wakes_waiting_senders() -> None:
    conn = _Conn()
    conn.gate.clear()
    failures: list[WaltzError] = []
    outbox = Outbox(conn, _encode, max_frames=1, on_failure=failures.append)
    await outbox.put(_message(0))
    await _until(lambda: conn.entered == 1, "took the first")
    await outbox.put(_message(1))
    waiting = asyncio.create_task(outbox.put(_message(2)))
    await asyncio.sleep(0.01)
    conn.broken = True
    conn.gate.set()
    with pytest.raises(ConnectionClosedError):
        await asyncio.wait_for(waiting, 5)
    await asyncio.wait_for(outbox.task, 5)
    assert [type(f) for f in failures] == [TransportError]
    assert outbox.failure is failures[0]
    # kept without the traceback, whose frames would hold the batch being sent
    assert outbox.failure.__traceback__ is None
    assert outbox.closed and not outbox.post(_message(3))
    with pytest.raises(ConnectionClosedError):
        await outbox.put(_message(4))
    assert not conn.closed, "the outbox never closes the connection"


async def test_abort_drops_what_is_queued() -> None:
    conn = _Conn()
    conn.gate.clear()
    outbox = Outbox(conn, _encode)
    await outbox.put(_message(0))
    await _until(lambda: conn.entered == 1, "took the first")
    await outbox.put(_message(1))
    outbox.abort()
    conn.gate.set()
    await asyncio.wait_for(outbox.task, 5)
    assert conn.batches == [[b"0"]]


async def test_an_unencodable_message_fails_its_sender_not_the_outbox() -> None:
    def encode(message: Message) -> bytes:
        raise ValueError("too large")

    conn = _Conn()
    outbox = Outbox(conn, encode)
    with pytest.raises(ValueError, match="too large"):
        await outbox.put(_message(0))
    assert not outbox.closed
    await outbox.close()


async def test_post_with_slack_goes_beyond_the_bound_up_to_its_multiple() -> None:
    """A server's replies to requests already taken: beyond the bound that stops it
    taking new ones, up to a ceiling."""
    conn = _Conn()
    conn.gate.clear()
    outbox = Outbox(conn, _encode, max_frames=2)
    await outbox.put(_message(0))
    await _until(lambda: conn.entered == 1, "took the first")
    assert outbox.post(_message(1)) and outbox.post(_message(2))
    assert not outbox.post(_message(3)), "at the bound"
    assert outbox.post(_message(3), slack=3) and outbox.post(_message(4), slack=3)
    assert outbox.post(_message(5), slack=3) and outbox.post(_message(6), slack=3)
    assert outbox.full(3) and not outbox.post(_message(7), slack=3), "at 3 times the bound"
    assert outbox.queued_frames == 1 + 6
    conn.gate.set()
    await outbox.flush_and_stop(timeout=5)
    assert [f for batch in conn.batches for f in batch] == [b"%d" % i for i in range(7)]


async def test_put_frames_queues_within_the_bounds_and_waits_for_room() -> None:
    conn = _Conn()
    conn.gate.clear()
    outbox = Outbox(conn, _encode, max_frames=3, max_bytes=100)
    frames = [b"f%d" % i for i in range(10)]
    feeding = asyncio.create_task(outbox.put_frames(frames))
    await _until(lambda: conn.entered == 1, "took the first chunk")
    await asyncio.sleep(0.01)
    assert not feeding.done(), "put_frames did not wait for room"
    assert outbox.full() and outbox.queued_frames <= 3 + 3
    waited = asyncio.create_task(outbox.wait_room())
    await asyncio.sleep(0.01)
    assert not waited.done()
    conn.gate.set()
    await asyncio.wait_for(feeding, 5)
    await asyncio.wait_for(waited, 5)
    await outbox.flush_and_stop(timeout=5)
    sent = [f for batch in conn.batches for f in batch]
    assert sent == frames
    assert max(len(batch) for batch in conn.batches) <= 3


async def test_put_frames_respects_the_byte_bound_and_a_close() -> None:
    conn = _Conn()
    conn.gate.clear()
    outbox = Outbox(conn, _encode, max_bytes=10)
    feeding = asyncio.create_task(outbox.put_frames([b"12345"] * 6))
    await _until(lambda: conn.entered == 1, "took the first chunk")
    await asyncio.sleep(0.01)
    assert outbox.queued_bytes <= 10
    outbox.abort()
    with pytest.raises(ConnectionClosedError):
        await asyncio.wait_for(feeding, 5)
    conn.gate.set()
    await asyncio.wait_for(outbox.task, 5)


class _DirectConn(_Conn):
    """A connection that also sends without waiting (``send_nowait``), as the ZeroMQ
    transport does, while ``credit`` frames are left."""

    def __init__(self, credit: int) -> None:
        super().__init__()
        self.credit = credit
        self.direct: list[list[bytes]] = []
        self.sent: list[bytes] = []
        """Every frame, in the order it went out (either way)."""

    def send_nowait(self, frames: list[bytes]) -> bool:
        if self._closed or len(frames) > self.credit:
            return False
        self.credit -= len(frames)
        self.direct.append(list(frames))
        self.sent.extend(frames)
        return True

    async def send_many(self, frames: list[bytes]) -> None:
        await super().send_many(frames)
        self.sent.extend(frames)


async def test_an_idle_writer_lets_a_connection_send_at_once_in_order() -> None:
    conn = _DirectConn(credit=3)
    outbox = Outbox(conn, _encode, max_frames=100)
    await asyncio.sleep(0)  # the writer is waiting for frames
    # idle: each message goes out at once, no batch through the writer
    await outbox.put(_message(0))
    assert outbox.post(_message(1))
    await outbox.put_frames([b"f2"])
    assert conn.direct == [[b"0"], [b"1"], [b"f2"]] and conn.batches == []
    assert outbox.queued_frames == 0
    # no credit left: queued for the writer, and what follows waits behind it
    await outbox.put(_message(3))
    conn.credit = 10
    await outbox.put(_message(4))
    await outbox.put_frames([b"f5", b"f6"])
    await _until(lambda: len(conn.sent) == 7, "every frame sent")
    assert conn.sent == [b"0", b"1", b"f2", b"3", b"4", b"f5", b"f6"]
    assert conn.batches == [[b"3", b"4", b"f5", b"f6"]]
    # the writer idle again: direct again
    await asyncio.sleep(0)
    assert outbox.post(_message(7))
    assert conn.direct[-1] == [b"7"]
    # closed: nothing goes out either way
    outbox.abort()
    assert not outbox.post(_message(8))
    with pytest.raises(ConnectionClosedError):
        await outbox.put(_message(9))
    await outbox.close()
    assert conn.sent[-1] == b"7"


async def test_post_frames_queues_only_what_fits_whole_and_never_waits() -> None:
    conn = _Conn()
    conn.gate.clear()  # the peer does not read
    outbox = Outbox(conn, _encode, max_frames=3, max_bytes=100)
    await outbox.put(_message(0))
    await _until(lambda: conn.entered == 1, "took the first")
    assert outbox.post_frames([b"a", b"b"])
    assert not outbox.post_frames([b"c", b"d"]), "2 + 2 frames are above the bound of 3"
    assert outbox.queued_frames == 3  # the one being sent and a, b: nothing of c, d
    assert outbox.post_frames([b"c"])
    assert not outbox.post_frames([b"e"])
    conn.gate.set()
    await outbox.flush_and_stop(timeout=5)
    assert [f for batch in conn.batches for f in batch] == [b"0", b"a", b"b", b"c"]
    assert not outbox.post_frames([b"f"]), "closed"
    big = Outbox(_Conn(), _encode, max_bytes=4)
    big_conn = big.conn
    assert isinstance(big_conn, _Conn)
    big_conn.gate.clear()
    await big.put(_message(1))
    await _until(lambda: big_conn.entered == 1, "took the first")
    assert not big.post_frames([b"12345"]), "5 bytes are above the byte bound"
    assert big.post_frames([b"1234"])
    await big.close()
