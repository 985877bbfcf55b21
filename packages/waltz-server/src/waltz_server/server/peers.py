"""Servers watching each other: pings over the transport, a failure detector, suspicion.

:class:`PeerMonitor` is the I/O shell around :class:`~waltz_server.server.liveness.FailureDetector`.
For every other registered server it keeps one connection to that server's client
endpoint (the usual Hello handshake), sends a :class:`~waltz_api.messages.PeerPing`
every ``heartbeat_interval`` and counts a :class:`~waltz_api.messages.PeerPong` that
names the expected server id as a sign of life (a restarted server at the same
endpoint answers with its new id, which does not count). A tick every
``heartbeat_interval`` lets silence accrue; a peer silent for ``suspect_after`` is
suspected, and ``on_change`` is called whenever the set of suspects changes. A
connection that breaks is made again at once; the silence keeps growing meanwhile.

Other signals can be tracked with the same clock (:meth:`track`, :meth:`heard`): the
cluster manager tracks the leader record's renewals this way.

Only the event loop's clock (``loop.time()``, ``asyncio.sleep``) is used, no thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Hashable, Mapping

from waltz_api import wire
from waltz_api.contracts.transport import Connection, Transport
from waltz_api.errors import ProtocolError, TransportError, WaltzError
from waltz_api.messages import PeerPing, PeerPong
from waltz_server.server.liveness import Changes, FailureDetector, LivenessConfig

log = logging.getLogger(__name__)

NO_SERVER = -1


class PeerMonitor:
    """Pings the other servers and suspects the silent ones (see the module docstring).

    Use::

        monitor = PeerMonitor(transport, LivenessConfig(), on_change=rebalance.set)
        await monitor.start()
        monitor.set_identity(7)                          # this server's id (for its pings)
        monitor.set_peers({3: "tcp://10.0.0.3:5600"})    # the other registered servers
        monitor.suspects                                 # frozenset of suspected server ids
        await monitor.close()
    """

    def __init__(
        self,
        transport: Transport,
        config: LivenessConfig | None = None,
        *,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.transport = transport
        self.config = config or LivenessConfig()
        self.detector = FailureDetector.from_config(self.config)
        self.on_change = on_change
        self.server_id = NO_SERVER
        self._peers: dict[int, str] = {}
        self._probes: dict[int, asyncio.Task[None]] = {}
        self._tick_task: asyncio.Task[None] | None = None
        self._closed = False
        self.pings_answered = 0
        """Pongs received from the expected server (for tests and figures)."""

    # -- what the cluster manager reads and sets ---------------------------------------------

    @property
    def suspects(self) -> frozenset[int]:
        """The peers (server ids) suspected now."""
        return frozenset(k for k in self.detector.suspects if isinstance(k, int))

    @property
    def peers(self) -> dict[int, str]:
        return dict(self._peers)

    def set_identity(self, server_id: int) -> None:
        """This server's id, sent in its pings (for the peers' logs)."""
        self.server_id = server_id

    def set_peers(self, peers: Mapping[int, str]) -> None:
        """Watch exactly these servers (id -> client endpoint); this server is left out."""
        wanted = {i: e for i, e in peers.items() if i != self.server_id and e}
        for server_id in [i for i in self._peers if wanted.get(i) != self._peers[i]]:
            del self._peers[server_id]
            self.detector.untrack(server_id)
            task = self._probes.pop(server_id, None)
            if task is not None:
                task.cancel()
        for server_id, endpoint in wanted.items():
            if server_id in self._peers:
                continue
            self._peers[server_id] = endpoint
            self.detector.track(server_id)
            if not self._closed and self._tick_task is not None:
                self._start_probe(server_id, endpoint)

    def track(self, key: Hashable) -> None:
        """Track another signal with the same clock (its silence starts at 0)."""
        self.detector.track(key)

    def heard(self, key: Hashable) -> None:
        """A sign of life of ``key`` (a peer's pong, a renewal of a tracked record)."""
        self._report(self.detector.heard(key, asyncio.get_running_loop().time()))

    def is_suspected(self, key: Hashable) -> bool:
        return self.detector.is_suspected(key)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._tick_task is not None or self._closed:
            return
        self.detector.tick(asyncio.get_running_loop().time())
        self._tick_task = asyncio.create_task(self._ticks(), name="peer-ticks")
        for server_id, endpoint in self._peers.items():
            self._start_probe(server_id, endpoint)

    async def close(self) -> None:
        self._closed = True
        tasks = [t for t in (self._tick_task, *self._probes.values()) if t is not None]
        self._probes.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    # -- the loops ----------------------------------------------------------------------------

    def _report(self, changes: Changes) -> None:
        if not changes:
            return
        for key in sorted(changes.suspected, key=str):
            log.log(
                logging.WARNING if isinstance(key, int) else logging.DEBUG,
                "server %d suspects %s: silent for %.1f s",
                self.server_id,
                _name(key),
                self.config.suspect_after,
            )
        for key in sorted(changes.cleared, key=str):
            log.log(
                logging.INFO if isinstance(key, int) else logging.DEBUG,
                "server %d: %s answers again",
                self.server_id,
                _name(key),
            )
        if self.on_change is not None:
            self.on_change()

    async def _ticks(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.heartbeat_interval)
            self._report(self.detector.tick(loop.time()))

    def _start_probe(self, server_id: int, endpoint: str) -> None:
        old = self._probes.pop(server_id, None)
        if old is not None:
            old.cancel()
        self._probes[server_id] = asyncio.create_task(
            self._probe(server_id, endpoint), name=f"peer-probe-{server_id}"
        )

    async def _probe(self, server_id: int, endpoint: str) -> None:
        """Keep a connection to the peer and ping it; reconnect whenever it breaks."""
        interval = self.config.heartbeat_interval
        while True:
            conn: Connection | None = None
            reader: asyncio.Task[None] | None = None
            try:
                conn = await self.transport.connect(endpoint, timeout=self.config.suspect_after)
                protocol = await self._handshake(conn)
                reader = asyncio.create_task(
                    self._read(conn, protocol, server_id), name=f"peer-read-{server_id}"
                )
                seq = 0
                while not conn.closed and not reader.done():
                    seq += 1
                    await conn.send(protocol.send(PeerPing(seq, self.server_id)))
                    await asyncio.sleep(interval)
            except (TransportError, ProtocolError, TimeoutError) as exc:
                log.debug("probe of server %d at %s: %s", server_id, endpoint, exc)
            finally:
                if reader is not None:
                    reader.cancel()
                    with contextlib.suppress(BaseException):
                        await reader
                if conn is not None:
                    with contextlib.suppress(WaltzError):
                        await conn.close()
            await asyncio.sleep(interval)

    async def _handshake(self, conn: Connection) -> wire.ProtocolConnection:
        protocol = wire.ProtocolConnection(
            wire.Role.INITIATOR,
            sender=f"server:{self.server_id}",
            max_frame_size=self.transport.max_frame_size,
        )
        await conn.send(protocol.start_handshake())
        protocol.receive_frame(await asyncio.wait_for(conn.recv(), self.config.suspect_after))
        if protocol.state is not wire.ConnectionState.OPEN:
            raise ProtocolError(f"no common protocol version with {conn.peer}")
        return protocol

    async def _read(self, conn: Connection, protocol: wire.ProtocolConnection, peer: int) -> None:
        try:
            while True:
                message = protocol.receive_frame(await conn.recv())
                if isinstance(message, PeerPong) and message.server_id == peer:
                    self.pings_answered += 1
                    self.heard(peer)
        except (TransportError, ProtocolError) as exc:
            log.debug("probe connection to server %d ends: %s", peer, exc)


def _name(key: Hashable) -> str:
    return f"server {key}" if isinstance(key, int) else str(key)
