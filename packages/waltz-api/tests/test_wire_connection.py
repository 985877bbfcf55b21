"""ProtocolConnection under arbitrary interleavings (hypothesis stateful).

Two connected peers (an initiator and an acceptor) with a queue of frames in
flight each way. Any action may happen at any time: starting or answering the
handshake, sending, delivering, corrupting a frame in flight. Checked throughout:
no application message crosses before the handshake completes, delivered
messages arrive in order and unchanged, FAILED is final, and nothing but a
ProtocolError ever escapes.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from waltz_api import wire
from waltz_api.errors import ProtocolError
from waltz_api.messages import FeedData, FlushRequest, Hello, HelloResponse, Message
from waltz_api.types import ReqId

OPEN = wire.ConnectionState.OPEN
FAILED = wire.ConnectionState.FAILED

APP_MESSAGES = st.one_of(
    st.builds(FeedData, st.builds(ReqId, *[st.integers(0, 9)] * 4), st.integers(0, 99), st.just(1)),
    st.builds(FlushRequest, st.builds(ReqId, *[st.integers(0, 9)] * 4)),
)


class TwoPeers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.peers = {
            "a": wire.ProtocolConnection(wire.Role.INITIATOR, sender="a"),
            "b": wire.ProtocolConnection(wire.Role.ACCEPTOR, sender="b"),
        }
        # frames in flight towards each peer, with the message each was made from
        # (None once corrupted)
        self.inbound: dict[str, deque[tuple[bytes, Message | None]]] = {
            "a": deque(),
            "b": deque(),
        }
        self.corrupted = False
        self.failed: set[str] = set()

    @staticmethod
    def other(name: str) -> str:
        return "b" if name == "a" else "a"

    def _send(self, name: str, message: Message) -> None:
        peer = self.peers[name]
        before = peer.state
        try:
            frame = peer.send(message)
        except ProtocolError:
            # refused: a send in the wrong state changes nothing (except an already failed one)
            assert peer.state is before
            return
        self.inbound[self.other(name)].append((frame, message))

    @rule()
    def start_handshake(self) -> None:
        self._send("a", Hello(self.peers["a"].versions, "a"))

    @rule()
    def answer_hello(self) -> None:
        acceptor = self.peers["b"]
        try:
            response = acceptor.hello_response()
        except ProtocolError:
            assert acceptor.state is not wire.ConnectionState.SENDING_HELLO_RESPONSE
            return
        self._send("b", response)

    @rule(name=st.sampled_from(["a", "b"]), message=APP_MESSAGES)
    def send(self, name: str, message: Message) -> None:
        if self.peers[name].state is not OPEN:
            with pytest.raises(ProtocolError):
                self.peers[name].send(message)
            return
        self._send(name, message)

    @rule(name=st.sampled_from(["a", "b"]))
    def deliver(self, name: str) -> None:
        if not self.inbound[name]:
            return
        frame, sent = self.inbound[name].popleft()
        peer = self.peers[name]
        was_open = peer.state is OPEN
        try:
            received = peer.receive_frame(frame)
        except ProtocolError:
            assert peer.state is FAILED
            self.failed.add(name)
            return
        assert name not in self.failed
        if sent is not None:
            assert received == sent
        if not isinstance(received, (Hello, HelloResponse)):
            assert was_open, "an application message crossed before the handshake completed"

    @precondition(lambda self: self.inbound["a"] or self.inbound["b"])
    @rule(data=st.data())
    def corrupt_a_frame_in_flight(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from([n for n in ("a", "b") if self.inbound[n]]))
        queue = self.inbound[name]
        index = data.draw(st.integers(0, len(queue) - 1))
        frame = bytearray(queue[index][0])
        position = data.draw(st.integers(0, len(frame) - 1))
        frame[position] ^= data.draw(st.integers(1, 255))
        queue[index] = (bytes(frame), None)

    @invariant()
    def failed_is_final(self) -> None:
        for name in self.failed:
            assert self.peers[name].state is FAILED

    @invariant()
    def open_peers_agree_on_the_version(self) -> None:
        for peer in self.peers.values():
            if peer.state is OPEN:
                assert peer.version == 1


TwoPeers.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_two_peers = TwoPeers.TestCase
