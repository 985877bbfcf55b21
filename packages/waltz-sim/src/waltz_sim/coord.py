"""The simulated coordination service and the ``sim`` coordination plugin.

A ZooKeeper-like service in the world (:class:`SimCoordinationService`) and one
client per simulated process that asks for one (:class:`SimCoordination`, URI
``sim://<world>/<root>``). The semantics are the Coordination contract's; what the
world adds is time and failure, chosen by the seed:

- every request and every answer crosses the network (latency); an answer lost
  because the link dropped in between makes the outcome unknown
  (CoordinationUnavailableError), although the request may have been applied;
- a client is *connected* while the service is up, its process runs, and the
  network joins the process and the process ``coordination`` both ways. A client
  that stops being connected notices within a third of the session timeout
  (SUSPENDED), and declares itself LOST once SUSPENDED for a whole session
  timeout; the service expires a session it has not heard from for the session
  timeout (while it is up: an outage gives every session a fresh timeout when it
  ends, as ZooKeeper does), deleting its ephemeral entries;
- watch notifications reach a client in order (a client's notifications never
  overtake one another), after a latency, more when watches are slow (a fault);
  consecutive changes may be coalesced, the final state is always delivered; a
  disconnected client gets what it missed once it reconnects;
- the service can be killed and restarted (an outage: operations wait, bounded),
  and a session can be expired on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from waltz_api.contracts.coordination import (
    ChildrenCallback,
    DataCallback,
    SessionState,
    Versioned,
    Watch,
    join_path,
)
from waltz_api.coordination_support import (
    DeliveryWatch,
    InProcessServiceClient,
    LoopDelivery,
    SessionStateTracker,
)
from waltz_api.errors import (
    BadVersionError,
    ConfigError,
    CoordinationError,
    CoordinationUnavailableError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    SessionLostError,
)
from waltz_sim.loop import WORLD_CONTEXT, SimLoop, current_incarnation
from waltz_sim.net import COORDINATION, SimNetwork

log = logging.getLogger(__name__)

T = TypeVar("T")
DEFAULT_SESSION_TIMEOUT = 4.0
RETRY_INTERVAL = 0.05


@dataclass
class _Node:
    value: bytes = b""
    version: int = 0
    ephemeral_owner: int | None = None
    children: dict[str, None] = field(default_factory=dict)


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


def _name(path: str) -> str:
    return path.rsplit("/", 1)[1]


@dataclass(eq=False)
class _Session:
    id: int
    client: SimCoordination
    timeout: float
    disconnected_since: float | None = None
    expiry: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Watcher:
    id: int
    client: SimCoordination
    path: str
    children: bool
    delivery: LoopDelivery[Any]
    pending: tuple[Any] | None = None
    scheduled: bool = False
    cancelled: bool = False
    armed: bool = False
    """The client has its initial value: changes are delivered from then on (a change
    notified while that answer travels waits for it, as ZooKeeper sends a watch's event
    only after the read that set it)."""


class _SessionSettings(Protocol):
    @property
    def session_timeout(self) -> float: ...


class CoordWorld(Protocol):
    """What the coordination service needs of its world (``waltz_sim.world.World``)."""

    @property
    def name(self) -> str: ...

    @property
    def loop(self) -> SimLoop: ...

    @property
    def network(self) -> SimNetwork: ...

    @property
    def coordination(self) -> SimCoordinationService: ...

    @property
    def config(self) -> _SessionSettings: ...


class SimCoordinationService:
    """The tree, the sessions and the watchers (the world's single coordination service)."""

    def __init__(self, world: CoordWorld, rng: random.Random) -> None:
        self.world = world
        self.rng = rng
        self.available = True
        self._nodes: dict[str, _Node] = {"/": _Node()}
        self._session_ids = itertools.count(1)
        self._watcher_ids = itertools.count(1)
        self.sessions: dict[int, _Session] = {}
        self._data_watchers: dict[str, dict[int, _Watcher]] = {}
        self._child_watchers: dict[str, dict[int, _Watcher]] = {}
        self._watch_delays: list[float] = []
        self._watch_delays_of: dict[str, list[float]] = {}
        self.operations = 0
        self.unheard: dict[SimCoordination, None] = {}
        """Clients whose session expired while they could not hear it."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.world.loop

    def latency(self) -> float:
        return self.world.network.latency(COORDINATION, COORDINATION)

    def watch_delay(self, process: str) -> float:
        delays = self._watch_delays + self._watch_delays_of.get(process, [])
        extra = max(delays) * self.rng.uniform(0.5, 1.0) if delays else 0
        return self.latency() + extra

    # -- connectivity -----------------------------------------------------------------

    def link_up(self, client: SimCoordination) -> bool:
        """The client and the service hear each other (a closed or LOST client sends no
        heartbeats: its session, if the service still has it, expires)."""
        return (
            self.available
            and not client._closed
            and not client.lost
            and client.incarnation.running
            and self.world.network.connected(client.incarnation.process.name, COORDINATION)
        )

    def reevaluate(self) -> None:
        """Something changed (a cut, an outage, a pause...): re-examine every session."""
        now = self.loop.time()
        for client in list(self.unheard):
            if not client.incarnation.alive or client._closed:
                del self.unheard[client]
            elif self.link_up(client):
                del self.unheard[client]
                client._tell_lost()
        for session in list(self.sessions.values()):
            client = session.client
            up = self.link_up(client)
            if up and session.disconnected_since is not None:
                session.disconnected_since = None
                if session.expiry is not None:
                    session.expiry.cancel()
                    session.expiry = None
                client._reconnected()
            elif not up and session.disconnected_since is None:
                session.disconnected_since = now
                client._disconnected()
            if not up and self.available and session.expiry is None:
                # not heard from: expires one session timeout after the later of the
                # disconnection and the end of the last outage
                start = max(session.disconnected_since or now, self._restarted_at)
                session.expiry = self.loop.call_at(
                    start + session.timeout, self._expire_unheard, session, context=WORLD_CONTEXT
                )
            elif not self.available and session.expiry is not None:
                session.expiry.cancel()
                session.expiry = None

    _restarted_at = 0.0

    def _expire_unheard(self, session: _Session) -> None:
        session.expiry = None
        if session.id in self.sessions and not self.link_up(session.client):
            log.info("coordination: session %d expired (not heard from)", session.id)
            self.expire(session.id)

    # -- sessions ---------------------------------------------------------------------

    def open_session(self, client: SimCoordination, timeout: float) -> int:
        session_id = next(self._session_ids)
        self.sessions[session_id] = _Session(session_id, client, timeout)
        return session_id

    def end_session(self, session_id: int) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None and session.expiry is not None:
            session.expiry.cancel()
        self._delete_ephemerals(session_id)

    def expire(self, session_id: int) -> None:
        """Expire a session: its ephemeral entries go; the client learns LOST when it hears."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        if session.expiry is not None:
            session.expiry.cancel()
        self._delete_ephemerals(session_id)
        session.client._expired()

    def session_of(self, process: str) -> list[int]:
        return [
            s.id for s in self.sessions.values() if s.client.incarnation.process.name == process
        ]

    def _delete_ephemerals(self, session_id: int) -> None:
        owned = [p for p, n in self._nodes.items() if n.ephemeral_owner == session_id]
        for path in owned:
            self._remove(path)

    # -- outages ----------------------------------------------------------------------

    def kill(self) -> None:
        self.available = False
        self.reevaluate()

    def restart(self) -> None:
        self.available = True
        self._restarted_at = self.loop.time()
        for session in list(self.sessions.values()):
            if session.client.lost:
                self.expire(session.id)  # the client gave up meanwhile
        self.reevaluate()

    def slow_watches(self, extra: float, processes: Iterable[str] | None = None) -> None:
        """Watch notifications take ``extra`` seconds more (to ``processes``, or to all)."""
        if processes is None:
            self._watch_delays.append(extra)
        else:
            for process in processes:
                self._watch_delays_of.setdefault(process, []).append(extra)

    def unslow_watches(self, extra: float, processes: Iterable[str] | None = None) -> None:
        lists = (
            [self._watch_delays]
            if processes is None
            else [self._watch_delays_of.get(p, []) for p in processes]
        )
        for delays in lists:
            if extra in delays:
                delays.remove(extra)

    # -- the tree (full paths), called when a request reaches the service ---------------------

    def check_session(self, session_id: int) -> None:
        self.operations += 1
        if not self.available:
            raise CoordinationUnavailableError("the coordination service is down")
        if session_id not in self.sessions:
            raise SessionLostError(f"coordination session {session_id} expired; start a new client")

    def get(self, session_id: int, path: str) -> Versioned | None:
        self.check_session(session_id)
        node = self._nodes.get(path)
        return None if node is None else Versioned(node.value, node.version)

    def create(
        self, session_id: int, path: str, value: bytes, ephemeral: bool, make_parents: bool
    ) -> int:
        self.check_session(session_id)
        if path in self._nodes:
            raise NodeExistsError(f"{path} already exists")
        parent = _parent(path)
        if parent not in self._nodes:
            if not make_parents:
                raise NoNodeError(f"cannot create {path}: its parent {parent} does not exist")
            self._make_parents(parent)
        parent_node = self._nodes[parent]
        if parent_node.ephemeral_owner is not None:
            raise CoordinationError(f"cannot create {path}: its parent {parent} is ephemeral")
        self._nodes[path] = _Node(value, 0, session_id if ephemeral else None)
        parent_node.children[_name(path)] = None
        self._fire(path, parent)
        return 0

    def _make_parents(self, path: str) -> None:
        missing: list[str] = []
        while path not in self._nodes:
            missing.append(path)
            path = _parent(path)
        if self._nodes[path].ephemeral_owner is not None:
            raise CoordinationError(f"{path} is ephemeral and can have no children")
        for each in reversed(missing):
            self._nodes[each] = _Node()
            self._nodes[_parent(each)].children[_name(each)] = None
            self._fire(each, _parent(each))

    def set(self, session_id: int, path: str, value: bytes, expected_version: int | None) -> int:
        self.check_session(session_id)
        node = self._nodes.get(path)
        if node is None:
            raise NoNodeError(f"cannot set {path}: it does not exist")
        if expected_version is not None and node.version != expected_version:
            raise BadVersionError(
                f"{path} is at version {node.version}, not {expected_version}: "
                "someone else changed it; re-read and decide again"
            )
        node.value = value
        node.version += 1
        self._fire(path, None)
        return node.version

    def delete(
        self, session_id: int, path: str, expected_version: int | None, recursive: bool
    ) -> None:
        self.check_session(session_id)
        if path == "/":
            raise CoordinationError("the root cannot be deleted")
        node = self._nodes.get(path)
        if node is None:
            if expected_version is not None:
                raise NoNodeError(f"cannot delete {path}: it does not exist")
            return
        if expected_version is not None and node.version != expected_version:
            raise BadVersionError(f"{path} is at version {node.version}, not {expected_version}")
        if node.children and not recursive:
            raise NotEmptyError(f"{path} has children; delete them or use recursive")
        self._remove(path)

    def _remove(self, path: str) -> None:
        node = self._nodes.get(path)
        if node is None:
            return
        for child in sorted(node.children):
            self._remove(join_path(path, child))
        del self._nodes[path]
        parent = _parent(path)
        self._nodes[parent].children.pop(_name(path), None)
        self._fire(path, parent, children_of_path=True)

    def children(self, session_id: int, path: str) -> list[str]:
        self.check_session(session_id)
        return self._children(path)

    def _children(self, path: str) -> list[str]:
        node = self._nodes.get(path)
        return [] if node is None else sorted(node.children)

    def increment(self, session_id: int, path: str) -> int:
        self.check_session(session_id)
        node = self._nodes.get(path)
        if node is None:
            self.create(session_id, path, b"0", False, True)
            node = self._nodes[path]
        value = int(node.value or b"0") + 1
        node.value = str(value).encode()
        node.version += 1
        self._fire(path, None)
        return value

    def value_of(self, path: str) -> Versioned | None:
        node = self._nodes.get(path)
        return None if node is None else Versioned(node.value, node.version)

    # -- watches ----------------------------------------------------------------------------

    def add_watcher(self, watcher: _Watcher) -> Any:
        table = self._child_watchers if watcher.children else self._data_watchers
        table.setdefault(watcher.path, {})[watcher.id] = watcher
        return self._children(watcher.path) if watcher.children else self.value_of(watcher.path)

    def remove_watcher(self, watcher: _Watcher) -> None:
        table = self._child_watchers if watcher.children else self._data_watchers
        watchers = table.get(watcher.path)
        if watchers is not None:
            watchers.pop(watcher.id, None)
            if not watchers:
                del table[watcher.path]

    def next_watcher_id(self) -> int:
        return next(self._watcher_ids)

    def _fire(self, path: str, parent: str | None, *, children_of_path: bool = False) -> None:
        for watcher in list(self._data_watchers.get(path, {}).values()):
            watcher.client._notify(watcher, self.value_of(path))
        if children_of_path:
            for watcher in list(self._child_watchers.get(path, {}).values()):
                watcher.client._notify(watcher, self._children(path))
        if parent is not None:
            for watcher in list(self._child_watchers.get(parent, {}).values()):
                watcher.client._notify(watcher, self._children(parent))


class SimCoordination(InProcessServiceClient):
    """One process's client (one session) of the world's coordination service."""

    def __init__(self, service: SimCoordinationService, root: str, session_timeout: float) -> None:
        self.incarnation = current_incarnation()
        self._service: SimCoordinationService = service
        self._root = join_path(root)
        self.session_timeout = session_timeout
        self._session_id = 0
        self._tracker: SessionStateTracker | None = None
        self._watchers: dict[int, _Watcher] = {}
        self._closed = False
        self.lost = False
        self._suspend_timer: asyncio.TimerHandle | None = None
        self._lost_timer: asyncio.TimerHandle | None = None
        self._last_delivery = 0.0
        self.incarnation.resources.append(self)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._service.loop

    def _check(self) -> int:
        if self._closed:
            raise CoordinationError("this coordination client is closed; start a new one")
        if self._tracker is None:
            raise CoordinationError("this coordination client is not started; await start()")
        if self.lost:
            raise SessionLostError(
                f"coordination session {self._session_id} was lost; start a new client"
            )
        return self._session_id

    # -- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._tracker is not None:
            return
        await asyncio.sleep(self._service.latency())
        if not self._service.link_up(self):
            # a real client keeps trying to connect for a while, then gives up
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.session_timeout
            while not self._service.link_up(self):
                if loop.time() >= deadline:
                    raise CoordinationUnavailableError(
                        "cannot reach the coordination service (down or cut off)"
                    )
                await asyncio.sleep(RETRY_INTERVAL * 4)
        self._tracker = SessionStateTracker(inline=True)
        self._session_id = self._service.open_session(self, self.session_timeout)
        await asyncio.sleep(self._service.latency())
        if self._root != "/":
            with contextlib.suppress(NodeExistsError):
                await self._op(self._service.create, self._root, b"", False, True)

    async def close(self) -> None:
        if self._closed:
            return
        self._disarm()
        for watcher in list(self._watchers.values()):
            self._cancel_watcher(watcher)
        reachable = self._service.link_up(self)
        self._closed = True
        if self._tracker is not None:
            self._tracker.close()
            if reachable:
                self._service.end_session(self._session_id)
            else:
                self._service.reevaluate()  # unreachable: the session expires in time

    def _set_state(self, state: SessionState) -> None:
        if self._tracker is not None and not self._closed:
            self._tracker.set_state(state)

    def _in_process(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback`` in this client's process (after what is queued there)."""
        if self.incarnation.alive:
            self.loop.call_soon(callback, *args, context=self.incarnation.context)

    def _disarm(self) -> None:
        for timer in (self._suspend_timer, self._lost_timer):
            if timer is not None:
                timer.cancel()
        self._suspend_timer = self._lost_timer = None

    # -- what the service tells the client (world side) ---------------------------------------

    def _disconnected(self) -> None:
        """The link dropped: the client notices within a third of the session timeout."""
        if self._closed or self.lost or not self.incarnation.alive:
            return
        self._disarm()
        delay = self.session_timeout / 3 * self._service.rng.uniform(0.5, 1.0)
        self._suspend_timer = self.loop.call_at(
            self.loop.time() + delay, self._notice_disconnection, context=self.incarnation.context
        )

    def _notice_disconnection(self) -> None:
        self._suspend_timer = None
        if self._closed or self.lost or self._service.link_up(self):
            return
        self._set_state(SessionState.SUSPENDED)
        self._lost_timer = self.loop.call_at(
            self.loop.time() + self.session_timeout,
            self._give_up,
            context=self.incarnation.context,
        )

    def _give_up(self) -> None:
        self._lost_timer = None
        if self._closed or self.lost:
            return
        if self._tracker is not None and self._tracker.state is SessionState.SUSPENDED:
            log.warning(
                "coordination session %d suspended for longer than %.1fs: lost",
                self._session_id,
                self.session_timeout,
            )
            self._become_lost()

    def _reconnected(self) -> None:
        if self._closed or self.lost or not self.incarnation.alive:
            return
        self._disarm()
        self._in_process(self._set_state, SessionState.CONNECTED)
        for watcher in list(self._watchers.values()):
            if watcher.pending is not None and not watcher.scheduled:
                self._schedule(watcher)

    def _expired(self) -> None:
        """The service expired the session: the client learns it when it hears from it."""
        if self._closed or self.lost:
            return
        if self._service.link_up(self):
            self._tell_lost()
        else:
            self._service.unheard[self] = None  # told once it can hear

    def _tell_lost(self) -> None:
        self.loop.call_at(
            self.loop.time() + self._service.latency(),
            self._in_process,
            self._become_lost,
            context=WORLD_CONTEXT,
        )

    def _become_lost(self) -> None:
        if self.lost or self._closed:
            return
        self.lost = True
        self._disarm()
        for watcher in list(self._watchers.values()):
            self._cancel_watcher(watcher)
        self._set_state(SessionState.LOST)
        self._service.reevaluate()

    # -- the process's fate -------------------------------------------------------------

    def on_crash(self, power_loss: bool) -> None:
        self._disarm()
        self._service.reevaluate()

    def on_pause(self) -> None:
        self._service.reevaluate()

    def on_resume(self) -> None:
        self._service.reevaluate()

    # -- operations ---------------------------------------------------------------------

    async def _op(self, operation: Callable[..., T], *args: Any) -> T:
        """A request to the service and its answer, each crossing the network. A request
        that cannot be sent waits for the link (up to the session timeout + 1 s); an
        answer lost on the way back leaves the outcome unknown."""
        service = self._service
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.session_timeout + 1.0
        while True:
            session_id = self._check()
            if service.link_up(self):
                await asyncio.sleep(service.latency())
                if service.link_up(self):
                    try:
                        result = operation(session_id, *args)
                    except SessionLostError:
                        await asyncio.sleep(service.latency())
                        self._become_lost()
                        raise
                    except CoordinationError as exc:
                        await asyncio.sleep(service.latency())
                        if not service.link_up(self):
                            raise CoordinationUnavailableError(
                                f"the answer from the coordination service was lost: {exc}"
                            ) from None
                        raise
                    await asyncio.sleep(service.latency())
                    if not service.link_up(self):
                        raise CoordinationUnavailableError(
                            "the connection to the coordination service dropped before its "
                            "answer arrived: the outcome is unknown"
                        )
                    return result
            if loop.time() >= deadline:
                raise CoordinationUnavailableError(
                    "the coordination service stayed unreachable for "
                    f"{self.session_timeout + 1.0:.1f}s"
                )
            await asyncio.sleep(RETRY_INTERVAL)

    async def watch(self, path: str, callback: DataCallback) -> Watch:
        return await self._watch(path, callback, children=False)

    async def watch_children(self, path: str, callback: ChildrenCallback) -> Watch:
        return await self._watch(path, callback, children=True)

    async def _watch(self, path: str, callback: Callable[[Any], Any], *, children: bool) -> Watch:
        self._check()
        service = self._service
        kind = "children watch" if children else "watch"
        delivery: LoopDelivery[Any] = LoopDelivery(
            asyncio.get_running_loop(), callback, name=f"{kind} {path}"
        )
        watcher = _Watcher(service.next_watcher_id(), self, self._full(path), children, delivery)

        def register(session_id: int) -> Any:
            service.check_session(session_id)
            return service.add_watcher(watcher)

        try:
            initial = await self._op(register)
        except BaseException:
            service.remove_watcher(watcher)  # the answer was lost: no half-registered watch
            raise
        self._watchers[watcher.id] = watcher
        delivery.push(initial)
        watcher.armed = True
        if watcher.pending is not None and not watcher.scheduled and self._service.link_up(self):
            self._schedule(watcher)  # a change made while the answer travelled
        return DeliveryWatch(delivery, lambda: self._cancel_watcher(watcher))

    def _cancel_watcher(self, watcher: _Watcher) -> None:
        watcher.cancelled = True
        watcher.delivery.stop()
        self._watchers.pop(watcher.id, None)
        self._service.remove_watcher(watcher)

    def _notify(self, watcher: _Watcher, value: Any) -> None:
        """A change the watcher must hear of (world side): coalesced, delivered in order."""
        if watcher.cancelled:
            return
        watcher.pending = (value,)
        if watcher.armed and not watcher.scheduled and self._service.link_up(self):
            self._schedule(watcher)

    def _schedule(self, watcher: _Watcher) -> None:
        watcher.scheduled = True
        loop = self.loop
        delay = self._service.watch_delay(self.incarnation.process.name)
        when = max(loop.time() + delay, self._last_delivery)
        self._last_delivery = when
        loop.call_at(when, self._deliver, watcher, context=WORLD_CONTEXT)

    def _deliver(self, watcher: _Watcher) -> None:
        watcher.scheduled = False
        if watcher.cancelled or self._closed or self.lost or not self.incarnation.alive:
            return
        if not self._service.link_up(self):
            return  # delivered after the reconnection
        pending, watcher.pending = watcher.pending, None
        if pending is not None:
            self._in_process(watcher.delivery.push, pending[0])


def sim_coordination_factory(
    connect: str, options: Mapping[str, Any] | None = None
) -> SimCoordination:
    """``sim://<world>/<root>``: a client of the world's service (inside a simulated process)."""
    parts = urlsplit(connect)
    if parts.scheme != "sim":
        raise ConfigError(
            f"the sim coordination plugin takes sim://<world>/<root>, got {connect!r}",
            key="coordination",
        )
    incarnation = current_incarnation()
    world: CoordWorld = incarnation.process.world
    if parts.netloc != world.name:
        raise ConfigError(
            f"{connect!r} names world {parts.netloc!r}, but this process lives in {world.name!r}",
            key="coordination",
        )
    raw = dict(options or {}).get("session_timeout", world.config.session_timeout)
    try:
        session_timeout = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(
            f"session_timeout must be a number of seconds, got {raw!r}", key="session_timeout"
        ) from None
    return SimCoordination(world.coordination, parts.path or "/", session_timeout)
