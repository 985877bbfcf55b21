"""The conformance harness of the ``zk`` plugin, on a real ZooKeeper server.

Needs the ``test`` extra (waltz-conformance). Sessions are expired for real:
a second client attaches to the same session (same id and password) and
closes it, so the server ends the session and deletes its ephemeral znodes,
exactly as when a client stops heartbeating.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient

from waltz_api.contracts.coordination import Coordination, SessionState
from waltz_api.errors import CoordinationError
from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_conformance.suites.coordination import (
    CROSS_PROCESS,
    SERVER_RESTART,
    CoordinationHarness,
)
from waltz_coord_zk.coordination import ZooKeeperCoordination
from waltz_coord_zk.security import ZkSecurity

log = logging.getLogger(__name__)

EXPIRY_ATTEMPTS = 5


def expire_zookeeper_session(
    connect_string: str, session_id: int, password: bytes, **kazoo_options: Any
) -> None:
    """End a session on the server by attaching to it from a second client and
    closing that client (blocking; run it in a thread). ``kazoo_options``: TLS and
    login of a secured server."""
    other = KazooClient(
        hosts=connect_string, client_id=(session_id, password), timeout=4.0, **kazoo_options
    )
    try:
        other.start(timeout=15)
    finally:
        other.stop()
        other.close()


@dataclass
class ZooKeeperCoordinationHarness(CoordinationHarness):
    """Clients of ``zk`` on ``server`` (a :class:`ZooKeeperServer` that is running);
    ``client_options`` are the URI query options of a secured server (TLS, login, ACL)."""

    server: ZooKeeperServer | None = None
    client_options: Mapping[str, str] = field(default_factory=dict)

    @property
    def security(self) -> ZkSecurity:
        return ZkSecurity.from_options(self.client_options)

    def _server(self) -> ZooKeeperServer:
        if self.server is None:
            raise CoordinationError("ZooKeeperCoordinationHarness needs a running server")
        return self.server

    async def connect(self, root: str) -> Coordination:
        return ZooKeeperCoordination(
            self._server().connect_string,
            root,
            session_timeout=self.session_timeout,
            security=self.security,
        )

    def client_uri(self, root: str) -> str:
        return self._server().uri(root, self.client_options)

    async def expire_session(self, client: Coordination) -> None:
        if not isinstance(client, ZooKeeperCoordination):
            raise TypeError(f"not a ZooKeeper client: {client!r}")
        session_id, password = client.kazoo_client.client_id
        loop = asyncio.get_running_loop()
        for attempt in range(1, EXPIRY_ATTEMPTS + 1):
            await loop.run_in_executor(
                None,
                functools.partial(
                    expire_zookeeper_session,
                    self._server().connect_string,
                    session_id,
                    password,
                    **self.security.kazoo_options(),
                ),
            )
            # The client may, rarely, win its session back before the second client
            # closed it; then expire it again.
            for _ in range(100):
                if client.session_state is SessionState.LOST:
                    return
                await asyncio.sleep(0.05)
            log.warning("session %#x survived expiry attempt %d", session_id, attempt)
        raise CoordinationError(f"could not expire ZooKeeper session {session_id:#x}")

    async def kill_server(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._server().kill)

    async def restart_server(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._server().start)


def harness(options: Mapping[str, Any] | None = None) -> ZooKeeperCoordinationHarness:
    """The harness named in the plugin descriptor; ``options["server"]`` is a running
    :class:`ZooKeeperServer` (the ``zookeeper_server`` pytest fixture)."""
    opts = dict(options or {})
    return ZooKeeperCoordinationHarness(
        name="zk",
        capabilities=frozenset({SERVER_RESTART, CROSS_PROCESS}),
        session_timeout=float(opts.get("session_timeout", 8.0)),
        server=opts["server"],
        client_options=dict(opts.get("client_options", {})),
    )
