"""kazoo's connect handshake is bounded: a connection that a server accepts and never
answers (a dying or hung ZooKeeper, or a restarted one not serving yet) is dropped after a
few seconds and retried, instead of being waited on for the whole session timeout (kazoo
waits ``session_timeout / len(hosts)`` for the answer to its Connect request: with one host
and a 120 s session, the session was declared lost while ZooKeeper was back)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz_api.contracts.coordination import SessionState
from waltz_conformance.servers import BlackHole
from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_conformance.suites.coordination import eventually
from waltz_coord_zk import ZooKeeperCoordination
from waltz_coord_zk.handshake import HANDSHAKE_TIMEOUT, HandshakeBound, bounded_kazoo_handler

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

SESSION_TIMEOUT = 120.0
"""As in production: long enough to ride out a ZooKeeper restart."""
BACK_WITHIN = 20.0
"""How soon after ZooKeeper serves again the session must be back (far below the above)."""


@pytest.fixture
def zookeeper(tmp_path: Path) -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer(tmp_path / "zk")
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


async def test_a_connection_that_never_answers_does_not_hold_the_session(
    zookeeper: ZooKeeperServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="waltz_coord_zk.handshake")
    client = ZooKeeperCoordination(
        zookeeper.connect_string, "/handshake", session_timeout=SESSION_TIMEOUT
    )
    await client.start()
    hole: BlackHole | None = None
    try:
        session = client.kazoo_client.client_id[0]
        await asyncio.to_thread(zookeeper.kill)
        await eventually(
            lambda: client.session_state is SessionState.SUSPENDED, 30, "the session suspended"
        )
        hole = BlackHole(zookeeper.port)
        accepted = await asyncio.to_thread(hole.first_accept.wait, 30)
        assert accepted, "the client never connected to the black hole"
        # the client now waits for the answer to its Connect request on that connection
        hole.close_listener()
        await asyncio.to_thread(zookeeper.start)
        serving = time.monotonic()
        await eventually(
            lambda: client.session_state is SessionState.CONNECTED,
            BACK_WITHIN,
            f"the session back within {BACK_WITHIN:g}s of ZooKeeper serving again "
            f"(session timeout {SESSION_TIMEOUT:g}s)",
        )
        back_after = time.monotonic() - serving
        assert client.kazoo_client.client_id[0] == session, "a new session, not the same one"
        assert await client.exists("/") is not None  # it serves requests again
        assert client.session_state is SessionState.CONNECTED, f"lost again after {back_after:.1f}s"
        # the black hole's connection was given up after the first bound, and the bound is
        # back to its start after the handshake that succeeded
        assert f"handshake within {HANDSHAKE_TIMEOUT:g}s" in caplog.text
        assert client.kazoo_client.handler.handshake_bound.current == HANDSHAKE_TIMEOUT
    finally:
        if hole is not None:
            hole.close()
        await client.close()


def test_a_tls_handshake_that_never_answers_is_bounded() -> None:
    """The TCP (and TLS) connect of kazoo's connection is bounded too: a TLS client
    handshake to a listener that never answers fails after the bound, not the timeout
    kazoo asks for (the session timeout)."""
    hole = BlackHole()
    try:
        bound = HandshakeBound(0.5)
        handler = bounded_kazoo_handler(bound)
        started = time.monotonic()
        with pytest.raises(OSError):
            handler.create_connection(
                address=(hole.host, hole.port),
                timeout=SESSION_TIMEOUT,
                use_ssl=True,
                verify_certs=False,
            )
        elapsed = time.monotonic() - started
        assert elapsed < 10 * 0.5, f"the TLS handshake waited {elapsed:.1f}s (bound 0.5s)"
        assert hole.first_accept.is_set()
        assert bound.current == 1.0, "a timed-out handshake doubles the next one's wait"
    finally:
        hole.close()


def test_the_bound_grows_after_timeouts_and_resets_after_a_handshake() -> None:
    bound = HandshakeBound(HANDSHAKE_TIMEOUT)
    assert bound.wait(SESSION_TIMEOUT) == HANDSHAKE_TIMEOUT
    assert bound.wait(1.0) == 1.0  # never above kazoo's own wait
    bound.timed_out()
    bound.timed_out()
    assert bound.wait(SESSION_TIMEOUT) == 4 * HANDSHAKE_TIMEOUT
    bound.succeeded()
    assert bound.wait(SESSION_TIMEOUT) == HANDSHAKE_TIMEOUT
