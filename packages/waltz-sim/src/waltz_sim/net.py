"""The simulated network and the ``sim`` transport plugin.

Every simulated process that talks owns a :class:`SimTransport`; connections run
between two of them through the world's :class:`SimNetwork`, which decides when a
frame arrives. What the Transport contract promises, the network keeps: frames of
one connection arrive in order, each exactly once, or the connection breaks
(``recv``/``send`` raise ConnectionClosedError); a break is reported within the
failure-detection bound; back pressure bounds what is in flight. So the faults it
injects are the ones the contract allows:

- delay: every frame takes a latency drawn from the seed (base latency, jitter, and
  a slow link's extra delay), never overtaking an earlier frame of its connection;
- partitions between any two processes (one direction or both, the coordination
  service included as the process ``coordination``): frames wait while a direction
  is cut; a cut that outlasts the detection delay breaks the connections across it
  (each end at its own time, within the bound); connects across it time out;
- connection resets (both ends break, frames in flight are lost);
- a crashed process's connections break at its peers after a latency (the kernel's
  reset) or, after a power loss or while it is paused, after the detection delay.

Loss or reordering *within* a connection would break the contract, so it never
happens; a frame is only ever lost together with its connection.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from waltz_api.contracts.transport import (
    DEFAULT_FAILURE_DETECTION_BOUND,
    Connection,
    ConnectionHandler,
    Listener,
    Transport,
)
from waltz_api.errors import (
    ConfigError,
    ConnectError,
    ConnectionClosedError,
    FrameTooLargeError,
    TransportError,
)
from waltz_sim.loop import WORLD_CONTEXT, Incarnation, SimLoop, current_incarnation

if TYPE_CHECKING:
    from waltz_sim.trace import Trace

log = logging.getLogger(__name__)

SCHEME = "sim://"
COORDINATION = "coordination"
"""The process name of the coordination service in partitions."""
DEFAULT_BUFFER_BYTES = 1024 * 1024


@dataclass
class NetworkConfig:
    """Latencies in seconds (drawn uniformly between the bounds for each frame)."""

    latency: tuple[float, float] = (0.0002, 0.002)
    failure_detection_bound: float = DEFAULT_FAILURE_DETECTION_BOUND
    buffer_bytes: int = DEFAULT_BUFFER_BYTES


@dataclass
class NetworkStats:
    frames: int = 0
    bytes: int = 0
    connections: int = 0
    breaks: int = 0


class NetWorld(Protocol):
    """What the network needs of its world (``waltz_sim.world.World``)."""

    @property
    def loop(self) -> SimLoop: ...

    @property
    def trace(self) -> Trace: ...

    @property
    def network(self) -> SimNetwork: ...

    @property
    def transport_uids(self) -> Iterator[int]: ...

    def coordination_links_changed(self) -> None: ...


class SimNetwork:
    """Links between processes: latency, cuts, slow links, and the live connections."""

    def __init__(self, world: NetWorld, rng: random.Random, config: NetworkConfig) -> None:
        self.world = world
        self.rng = rng
        self.config = config
        self.listeners: dict[str, SimListener] = {}
        self._cuts: dict[tuple[str, str], int] = {}
        self._slow: dict[tuple[str, str], list[float]] = {}
        self.pairs: dict[int, _Pair] = {}
        self._pair_ids = itertools.count(1)
        self.stats = NetworkStats()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.world.loop

    # -- links ----------------------------------------------------------------------

    def reachable(self, source: str, destination: str) -> bool:
        return not self._cuts.get((source, destination))

    def connected(self, a: str, b: str) -> bool:
        """Both directions between ``a`` and ``b`` work."""
        return self.reachable(a, b) and self.reachable(b, a)

    def latency(self, source: str, destination: str) -> float:
        low, high = self.config.latency
        delay = self.rng.uniform(low, high)
        slow = self._slow.get((source, destination))
        if slow:
            delay += max(slow) * self.rng.uniform(0.5, 1.0)
        return delay

    def detection_delay(self) -> float:
        """When an end notices a silent peer: within the failure-detection bound."""
        return self.config.failure_detection_bound * self.rng.uniform(0.5, 1.0)

    def cut(self, source: str, destination: str) -> None:
        """Frames from ``source`` to ``destination`` stop (they wait, and the connections
        across break if the cut outlasts their detection delay)."""
        key = (source, destination)
        self._cuts[key] = self._cuts.get(key, 0) + 1
        for pair in list(self.pairs.values()):
            if {pair.a.process_name, pair.b.process_name} == {source, destination} or (
                source == destination == pair.a.process_name == pair.b.process_name
            ):
                for end in (pair.a, pair.b):
                    self.loop.call_at(
                        self.loop.time() + self.detection_delay(),
                        self._detect_cut,
                        pair,
                        end,
                        context=WORLD_CONTEXT,
                    )
        self.world.coordination_links_changed()

    def heal(self, source: str, destination: str) -> None:
        key = (source, destination)
        count = self._cuts.get(key, 0) - 1
        if count > 0:
            self._cuts[key] = count
        else:
            self._cuts.pop(key, None)
            for pair in list(self.pairs.values()):
                for end in (pair.a, pair.b):
                    if end.process_name == source and end.remote.process_name == destination:
                        end.release_held()
        self.world.coordination_links_changed()

    def slow(self, source: str, destination: str, extra: float) -> None:
        self._slow.setdefault((source, destination), []).append(extra)

    def unslow(self, source: str, destination: str, extra: float) -> None:
        delays = self._slow.get((source, destination))
        if delays and extra in delays:
            delays.remove(extra)
            if not delays:
                del self._slow[(source, destination)]

    def _detect_cut(self, pair: _Pair, end: SimConnection) -> None:
        if end.closed:
            return
        if pair.dead or not self.connected(pair.a.process_name, pair.b.process_name):
            end.break_(f"no heartbeat from {end.remote.process_name} (network cut)")
            # the other end learns at its own detection time (also scheduled by the cut,
            # and it breaks then even if the cut healed); nothing crosses meanwhile
            pair.dead = True

    # -- process life ----------------------------------------------------------------

    def process_crashed(self, incarnation: Incarnation, power_loss: bool) -> None:
        """Break every connection of ``incarnation``: at once on its side; its peers learn
        after a latency (the kernel's reset), or after the detection delay (power loss)."""
        for pair in list(self.pairs.values()):
            for end in (pair.a, pair.b):
                if end.transport.incarnation is incarnation:
                    end.break_("the process crashed")
                    remote = end.remote
                    delay = (
                        self.detection_delay()
                        if power_loss
                        else self.latency(end.process_name, remote.process_name)
                    )
                    self.loop.call_at(
                        self.loop.time() + delay,
                        remote.break_,
                        f"the peer {end.process_name} crashed",
                        context=WORLD_CONTEXT,
                    )

    def process_paused(self, incarnation: Incarnation) -> None:
        """The peers of a paused process stop hearing it: each breaks the connection once
        its detection delay passed, if the process is still paused (the same pause)."""
        epoch = incarnation.pause_epoch
        for pair in list(self.pairs.values()):
            for end in (pair.a, pair.b):
                if end.transport.incarnation is incarnation and not end.closed:
                    self.loop.call_at(
                        self.loop.time() + self.detection_delay(),
                        self._detect_pause,
                        incarnation,
                        epoch,
                        end,
                        context=WORLD_CONTEXT,
                    )

    def _detect_pause(self, incarnation: Incarnation, epoch: int, end: SimConnection) -> None:
        if incarnation.pause_epoch == epoch and not incarnation.running and incarnation.alive:
            end.remote.break_(f"no heartbeat from {end.process_name} (paused)")
            end.break_("the peer gave up on this paused process")

    def reset(self, pair: _Pair) -> None:
        """A connection reset: both ends break after a latency."""
        for end in (pair.a, pair.b):
            self.loop.call_at(
                self.loop.time() + self.latency(end.remote.process_name, end.process_name),
                end.break_,
                "connection reset by the network",
                context=WORLD_CONTEXT,
            )


@dataclass(eq=False)
class _Pair:
    id: int
    a: SimConnection  # the connecting side
    b: SimConnection  # the accepting side
    dead: bool = False
    """One end noticed a cut: nothing crosses any more."""


class SimConnection(Connection):
    """One end of a simulated connection."""

    def __init__(self, transport: SimTransport, connection_id: int, peer: str) -> None:
        self.transport = transport
        self.process_name = transport.process_name
        self._id = connection_id
        self._peer = peer
        self.pair: _Pair | None = None
        self.remote: SimConnection = self  # set when paired
        self._inbox: deque[bytes] = deque()
        self._eof_after = False
        self._closed = False
        self._reason = "closed"
        self._recv_waiter: asyncio.Future[None] | None = None
        self._room_waiters: list[asyncio.Future[None]] = []
        self.outstanding = 0
        """Bytes sent by this end not yet taken by the remote's recv (back pressure)."""
        self._last_arrival = 0.0
        self._wire: deque[tuple[float, bytes | None]] = deque()
        """Frames on their way to the remote end, with their arrival times (in order)."""
        self._wire_timer: asyncio.TimerHandle | None = None
        self._held: deque[bytes | None] = deque()
        """Frames waiting for a cut direction to heal (None: the end of input)."""
        self.identity: str | None = None
        """On an accepted end: the connecting transport's ``identity`` option (what a
        security handshake would have proved; the ACL's key)."""

    @property
    def network(self) -> SimNetwork:
        return self.transport.network

    @property
    def connection_id(self) -> int:
        return self._id

    @property
    def peer(self) -> str:
        return self._peer

    @property
    def peer_identity(self) -> str | None:
        return self.identity

    @property
    def closed(self) -> bool:
        return self._closed

    def _error(self) -> ConnectionClosedError:
        return ConnectionClosedError(
            f"connection {self._id} to {self._peer} is closed: {self._reason}"
        )

    # -- sending --------------------------------------------------------------------

    async def send(self, frame: bytes) -> None:
        if not isinstance(frame, bytes | bytearray | memoryview):
            raise TypeError(f"a frame is bytes, not {type(frame).__name__}")
        size = len(frame)
        if size > self.transport.max_frame_size:
            raise FrameTooLargeError(
                f"frame of {size} bytes exceeds max_frame_size {self.transport.max_frame_size}; "
                "split the payload or raise the transport's max_frame_size option"
            )
        limit = self.network.config.buffer_bytes
        while True:
            if self._closed:
                raise self._error()
            if self.outstanding == 0 or self.outstanding + size <= limit:
                break
            waiter = asyncio.get_running_loop().create_future()
            self._room_waiters.append(waiter)
            await waiter
        if size > self.remote.transport.max_frame_size:
            self.remote.break_(f"it received a frame of {size} bytes above max_frame_size")
            self.break_("the peer refused a frame above its max_frame_size")
            raise self._error()
        self.outstanding += size
        stats = self.network.stats
        stats.frames += 1
        stats.bytes += size
        self._transmit(bytes(frame))

    async def send_many(self, frames: list[bytes]) -> None:
        limit = self.transport.max_frame_size
        for frame in frames:
            if len(frame) > limit:
                raise FrameTooLargeError(
                    f"frame of {len(frame)} bytes exceeds max_frame_size {limit}; nothing of "
                    "this send_many was sent; split the payload or raise max_frame_size"
                )
        for frame in frames:
            await self.send(frame)

    def _transmit(self, frame: bytes | None) -> None:
        """Put ``frame`` (None: end of input) on the wire toward the remote end."""
        network = self.network
        pair = self.pair
        if pair is None or pair.dead:
            return
        if self._held or not network.reachable(self.process_name, self.remote.process_name):
            self._held.append(frame)
            return
        loop = network.loop
        arrival = loop.time() + network.latency(self.process_name, self.remote.process_name)
        if arrival < self._last_arrival:
            arrival = self._last_arrival  # a connection never reorders
        self._last_arrival = arrival
        self._wire.append((arrival, frame))
        if self._wire_timer is None:
            self._wire_timer = loop.call_at(arrival, self._land, context=WORLD_CONTEXT)

    def _land(self) -> None:
        """Hand the remote end every frame whose time has come, in the order sent."""
        self._wire_timer = None
        loop = self.network.loop
        now = loop.time()
        wire = self._wire
        while wire and wire[0][0] <= now:
            self.remote._arrive(wire.popleft()[1])
        if wire:
            self._wire_timer = loop.call_at(wire[0][0], self._land, context=WORLD_CONTEXT)

    def release_held(self) -> None:
        held, self._held = self._held, deque()
        for frame in held:
            self._transmit(frame)

    def _arrive(self, frame: bytes | None) -> None:
        pair = self.pair
        if pair is None or pair.dead:
            return
        if self._closed:
            if frame is not None:
                # a frame for a closed socket: the peer gets a reset
                network = self.network
                network.loop.call_at(
                    network.loop.time()
                    + network.latency(self.process_name, self.remote.process_name),
                    self.remote.break_,
                    f"connection reset by {self.process_name}",
                    context=WORLD_CONTEXT,
                )
            return
        if frame is None:
            self._eof_after = True
        else:
            self._inbox.append(frame)
            # every frame, where and when it landed, is part of what a replay repeats
            self.network.world.trace.mix_frame(self.network.loop.time(), pair.id, frame)
        self._wake_receiver()

    def _wake_receiver(self) -> None:
        waiter = self._recv_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _room(self) -> None:
        waiters, self._room_waiters = self._room_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- receiving ------------------------------------------------------------------

    async def recv(self) -> bytes:
        while True:
            if self._closed:
                raise self._error()
            if self._inbox:
                frame = self._inbox.popleft()
                remote = self.remote
                remote.outstanding -= len(frame)
                remote._room()
                return frame
            if self._eof_after:
                self.break_("the peer closed the connection")
                raise self._error()
            waiter = asyncio.get_running_loop().create_future()
            self._recv_waiter = waiter
            try:
                await waiter
            finally:
                self._recv_waiter = None

    # -- closing --------------------------------------------------------------------

    async def close(self) -> None:
        if self._closed:
            return
        self._transmit(None)  # the peer reads what was sent, then the end
        self.break_("closed by this side")

    def break_(self, reason: str) -> None:
        """This end is closed now; what it had queued is dropped."""
        if self._closed:
            return
        self._closed = True
        self._reason = reason
        self._inbox.clear()
        self.outstanding = 0
        pair = self.pair
        if pair is not None and pair.a._closed and pair.b._closed:
            self.network.pairs.pop(pair.id, None)
        self.transport._forget(self)
        waiter = self._recv_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._room()


class SimListener(Listener):
    def __init__(self, transport: SimTransport, name: str, handler: ConnectionHandler) -> None:
        self.transport = transport
        self.name = name
        self.handler = handler
        self.closed = False
        self.accepted: dict[SimConnection, asyncio.Task[None]] = {}
        # lineage (client transport uid, replace_key) -> (client connection id, server end)
        self.lineages: dict[tuple[str, str], tuple[int, SimConnection]] = {}

    @property
    def endpoint(self) -> str:
        return SCHEME + self.name

    def accept(self, client_end: SimConnection, replace_key: str | None) -> SimConnection:
        transport = self.transport
        server_end = SimConnection(
            transport,
            transport.next_id(),
            f"{client_end.process_name} ({client_end.transport.uid})",
        )
        identity = client_end.transport.options.get("identity")
        server_end.identity = identity if isinstance(identity, str) else None
        if replace_key is not None:
            lineage = (client_end.transport.uid, replace_key)
            older = self.lineages.get(lineage)
            if older is not None:
                older_id, older_end = older
                if older_id >= client_end.connection_id:
                    raise ConnectError(
                        f"connection {client_end.connection_id} to {self.endpoint} is older than "
                        f"connection {older_id} of the same replace_key; it was replaced"
                    )
                older_end.break_("replaced by a newer connection of the same replace_key")
                older_end.remote.break_("replaced by a newer connection of the same replace_key")
            self.lineages[lineage] = (client_end.connection_id, server_end)
        network = transport.network
        pair = _Pair(next(network._pair_ids), client_end, server_end)
        network.pairs[pair.id] = pair
        network.stats.connections += 1
        client_end.pair = server_end.pair = pair
        client_end.remote, server_end.remote = server_end, client_end
        transport._connections[server_end] = None
        task = network.loop.create_task(
            self._run_handler(server_end), context=transport.incarnation.context.copy()
        )
        self.accepted[server_end] = task
        return server_end

    async def _run_handler(self, conn: SimConnection) -> None:
        try:
            await self.handler(conn)
        except ConnectionClosedError:
            log.debug("sim connection %d ended in its handler", conn.connection_id)
        except Exception:
            log.exception("connection handler for %s failed", conn.peer)
        finally:
            self.accepted.pop(conn, None)
            await conn.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        network = self.transport.network
        if network.listeners.get(self.name) is self:
            del network.listeners[self.name]
        self.transport._listeners.pop(self, None)
        for conn in list(self.accepted):
            await conn.close()
        tasks = list(self.accepted.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class SimTransport(Transport):
    """The transport of one simulated process (plugin ``sim``)."""

    _uids = itertools.count(1)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        self.incarnation = current_incarnation()
        world: NetWorld = self.incarnation.process.world
        self.network: SimNetwork = world.network
        self.uid = f"{self.incarnation.name}/t{next(world.transport_uids)}"
        self._ids = itertools.count(1)
        self._connections: dict[SimConnection, None] = {}
        self._listeners: dict[SimListener, None] = {}
        self._closed = False
        self.incarnation.resources.append(self)
        value = self.options.get("max_frame_size", self.max_frame_size)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(
                f"transport option max_frame_size must be a positive integer, got {value!r}",
                key="max_frame_size",
            )

    @property
    def process_name(self) -> str:
        return self.incarnation.process.name

    @property
    def failure_detection_bound(self) -> float:
        return self.network.config.failure_detection_bound

    def next_id(self) -> int:
        return next(self._ids)

    def _forget(self, conn: SimConnection) -> None:
        self._connections.pop(conn, None)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("this sim transport is closed; create a new one")

    async def listen(self, endpoint: str, handler: ConnectionHandler) -> Listener:
        self._check_open()
        name = _parse(endpoint)
        if name in self.network.listeners:
            raise TransportError(f"sim endpoint {endpoint!r} is already bound; choose another name")
        listener = SimListener(self, name, handler)
        self.network.listeners[name] = listener
        self._listeners[listener] = None
        return listener

    async def connect(
        self, endpoint: str, *, timeout: float = 10.0, replace_key: str | None = None
    ) -> Connection:
        self._check_open()
        name = _parse(endpoint)
        network = self.network
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = SimConnection(self, self.next_id(), endpoint)
        me = self.process_name
        while True:
            listener = network.listeners.get(name)
            target = listener.transport.process_name if listener is not None else None
            if target is None or network.connected(me, target):
                break
            # a SYN into a cut: nothing answers; TCP keeps trying until the timeout
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise ConnectError(f"connecting to {endpoint} timed out after {timeout} s")
            await asyncio.sleep(min(0.25, remaining))
        await asyncio.sleep(network.latency(me, target or me))
        listener = network.listeners.get(name)
        if listener is None or listener.closed or listener.transport._closed:
            raise ConnectError(f"nothing listens on {endpoint!r} (connection refused)")
        listener.accept(conn, replace_key)
        self._connections[conn] = None
        await asyncio.sleep(network.latency(listener.transport.process_name, me))
        if conn.closed:
            raise ConnectError(
                f"the connection to {endpoint} broke while connecting: {conn._reason}"
            )
        return conn

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for listener in list(self._listeners):
            await listener.close()
        for conn in list(self._connections):
            await conn.close()

    # -- the process's fate -------------------------------------------------------------

    def on_crash(self, power_loss: bool) -> None:
        self._closed = True
        for listener in list(self._listeners):
            listener.closed = True
            if self.network.listeners.get(listener.name) is listener:
                del self.network.listeners[listener.name]
        self._listeners.clear()
        self.network.process_crashed(self.incarnation, power_loss)

    def on_pause(self) -> None:
        self.network.process_paused(self.incarnation)

    def on_resume(self) -> None:
        """Nothing: connections its peers gave up on are broken already."""


def _parse(endpoint: str) -> str:
    if (
        not isinstance(endpoint, str)
        or not endpoint.startswith(SCHEME)
        or len(endpoint) == len(SCHEME)
    ):
        raise ConfigError(
            f"sim transport endpoint {endpoint!r} is invalid: use sim://NAME", key="endpoint"
        )
    return endpoint[len(SCHEME) :]


def create_sim_transport(options: Mapping[str, Any] | None = None) -> SimTransport:
    """The plugin factory (``transport = "sim"``); call it inside a simulated process."""
    return SimTransport(options)


__all__ = [
    "COORDINATION",
    "SCHEME",
    "NetworkConfig",
    "SimNetwork",
    "SimTransport",
    "create_sim_transport",
]
