"""The reference coordination service: an in-process, in-memory ZooKeeper model.

:class:`MemoryCoordinationService` holds the tree and the sessions; several
:class:`MemoryCoordination` clients (each with its own session) share one
service, so the conformance suite can race them. The service can expire a
session, as a real service does when a client stops heartbeating.

The service can also be "killed" and "restarted" (:meth:`MemoryCoordinationService.kill`,
:meth:`MemoryCoordinationService.restart`) to simulate an outage: clients turn
SUSPENDED, their operations wait (bounded) for the service, a client suspended
for longer than its session timeout turns LOST, and the service expires that
session when it comes back; the data survives, as a real service's does.
Timers use the client's event loop, so this runs on simulated time too.

Select it by URI ``memory://<service name>/<root>``: clients naming the same
service in the same process share its state. Nothing crosses processes; this
is for the conformance suite and simulations, never a stand-in for a real
service in a system test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from waltz_api.contracts.coordination import (
    ChildrenCallback,
    Coordination,
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
from waltz_conformance.suites.coordination import SERVER_RESTART, CoordinationHarness

log = logging.getLogger(__name__)

Notify = Callable[[], None]
T = TypeVar("T")
DEFAULT_SESSION_TIMEOUT = 10.0
WatcherTable = dict[str, set[Notify]]


@dataclass
class _Node:
    value: bytes = b""
    version: int = 0
    ephemeral_owner: int | None = None
    children: set[str] = field(default_factory=set)


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


def _name(path: str) -> str:
    return path.rsplit("/", 1)[1]


class MemoryCoordinationService:
    """The shared tree, sessions and watchers (thread-safe; one lock)."""

    _named: dict[str, MemoryCoordinationService] = {}
    _named_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._nodes: dict[str, _Node] = {"/": _Node()}
        self._session_ids = itertools.count(1)
        self._sessions: dict[int, MemoryCoordination] = {}
        self._data_watchers: WatcherTable = {}
        self._child_watchers: WatcherTable = {}
        self._available = True

    @classmethod
    def named(cls, name: str) -> MemoryCoordinationService:
        """The process-wide service called ``name`` (created on first use)."""
        with cls._named_lock:
            service = cls._named.get(name)
            if service is None:
                service = cls._named[name] = cls()
            return service

    # -- sessions ---------------------------------------------------------------

    def open_session(self, client: MemoryCoordination) -> int:
        with self._lock:
            session_id = next(self._session_ids)
            self._sessions[session_id] = client
            return session_id

    def end_session(self, session_id: int) -> None:
        """End a session on purpose (close): delete its ephemeral entries."""
        with self._lock:
            self._sessions.pop(session_id, None)
            self._delete_ephemerals(session_id)

    def expire_session(self, session_id: int) -> None:
        """Expire a session as a real service would: ephemerals go, the client learns LOST."""
        with self._lock:
            client = self._sessions.pop(session_id, None)
            self._delete_ephemerals(session_id)
        if client is not None:
            client._on_session_expired()

    def _delete_ephemerals(self, session_id: int) -> None:
        owned = [p for p, n in self._nodes.items() if n.ephemeral_owner == session_id]
        for path in owned:
            self._remove(path)

    # -- simulated outages ------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._available

    def kill(self) -> None:
        """Simulate the service going down: every client turns SUSPENDED and its
        operations wait for :meth:`restart`. Data and sessions are kept."""
        with self._lock:
            self._available = False
            clients = list(self._sessions.values())
        for client in clients:
            client._on_service_down()

    def restart(self) -> None:
        """Bring the service back: sessions whose clients gave up (LOST) expire now,
        the others resume (CONNECTED, same session, ephemeral entries kept)."""
        with self._lock:
            self._available = True
            sessions = list(self._sessions.items())
        for session_id, client in sessions:
            if client.session_state is SessionState.LOST:
                self.expire_session(session_id)
            else:
                client._on_service_up()

    def check_session(self, session_id: int) -> None:
        if not self._available:
            raise CoordinationUnavailableError("the memory coordination service is down")
        if session_id not in self._sessions:
            raise SessionLostError(f"coordination session {session_id} expired; start a new client")

    # -- tree operations (full paths) --------------------------------------------------

    def get(self, session_id: int, path: str) -> Versioned | None:
        with self._lock:
            self.check_session(session_id)
            node = self._nodes.get(path)
            return None if node is None else Versioned(node.value, node.version)

    def create(
        self, session_id: int, path: str, value: bytes, ephemeral: bool, make_parents: bool
    ) -> int:
        with self._lock:
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
                raise CoordinationError(
                    f"cannot create {path}: its parent {parent} is ephemeral and "
                    "ephemeral entries can have no children"
                )
            self._nodes[path] = _Node(value, 0, session_id if ephemeral else None)
            parent_node.children.add(_name(path))
            self._fire(self._data_watchers, path)
            self._fire(self._child_watchers, parent)
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
            self._nodes[_parent(each)].children.add(_name(each))
            self._fire(self._data_watchers, each)
            self._fire(self._child_watchers, _parent(each))

    def set(self, session_id: int, path: str, value: bytes, expected_version: int | None) -> int:
        with self._lock:
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
            self._fire(self._data_watchers, path)
            return node.version

    def delete(
        self, session_id: int, path: str, expected_version: int | None, recursive: bool
    ) -> None:
        with self._lock:
            self.check_session(session_id)
            if path == "/":
                raise CoordinationError("the root cannot be deleted")
            node = self._nodes.get(path)
            if node is None:
                if expected_version is not None:
                    raise NoNodeError(f"cannot delete {path}: it does not exist")
                return
            if expected_version is not None and node.version != expected_version:
                raise BadVersionError(
                    f"{path} is at version {node.version}, not {expected_version}"
                )
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
        self._nodes[parent].children.discard(_name(path))
        self._fire(self._data_watchers, path)
        self._fire(self._child_watchers, path)
        self._fire(self._child_watchers, parent)

    def children(self, session_id: int, path: str) -> list[str]:
        with self._lock:
            self.check_session(session_id)
            return self._children(path)

    def _children(self, path: str) -> list[str]:
        node = self._nodes.get(path)
        return [] if node is None else sorted(node.children)

    def increment(self, session_id: int, path: str) -> int:
        with self._lock:
            self.check_session(session_id)
            node = self._nodes.get(path)
            if node is None:
                self.create(session_id, path, b"0", False, True)
                node = self._nodes[path]
            value = int(node.value or b"0") + 1
            node.value = str(value).encode()
            node.version += 1
            self._fire(self._data_watchers, path)
            return value

    # -- watches ------------------------------------------------------------------------

    def add_data_watcher(self, path: str, push: Callable[[Versioned | None], None]) -> Notify:
        def notify() -> None:
            node = self._nodes.get(path)
            push(None if node is None else Versioned(node.value, node.version))

        with self._lock:
            self._data_watchers.setdefault(path, set()).add(notify)
            notify()
        return lambda: self._remove_watcher(self._data_watchers, path, notify)

    def add_child_watcher(self, path: str, push: Callable[[list[str]], None]) -> Notify:
        def notify() -> None:
            push(self._children(path))

        with self._lock:
            self._child_watchers.setdefault(path, set()).add(notify)
            notify()
        return lambda: self._remove_watcher(self._child_watchers, path, notify)

    def _remove_watcher(self, table: WatcherTable, path: str, notify: Notify) -> None:
        with self._lock:
            watchers = table.get(path)
            if watchers is not None:
                watchers.discard(notify)
                if not watchers:
                    del table[path]

    def _fire(self, table: WatcherTable, path: str) -> None:
        for notify in list(table.get(path, ())):
            notify()


class MemoryCoordination(InProcessServiceClient):
    """One client (one session) of a :class:`MemoryCoordinationService`, under ``root``."""

    def __init__(
        self,
        service: MemoryCoordinationService,
        root: str = "/",
        *,
        session_timeout: float = DEFAULT_SESSION_TIMEOUT,
    ) -> None:
        self._service: MemoryCoordinationService = service
        self._root = join_path(root)
        self.session_timeout = session_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._suspension_timer: asyncio.TimerHandle | None = None
        self._session_id = 0
        self._tracker: SessionStateTracker | None = None
        self._watches: set[DeliveryWatch] = set()
        self._closed = False

    @property
    def service(self) -> MemoryCoordinationService:
        return self._service

    def _check(self) -> int:
        if self._closed:
            raise CoordinationError("this coordination client is closed; start a new one")
        if self._tracker is None:
            raise CoordinationError("this coordination client is not started; await start()")
        if self._tracker.lost:
            raise SessionLostError(
                f"coordination session {self._session_id} was lost; start a new client"
            )
        return self._session_id

    async def start(self) -> None:
        if self._tracker is not None:
            return
        if not self._service.available:
            raise CoordinationUnavailableError(
                "the memory coordination service is down; restart it first"
            )
        self._loop = asyncio.get_running_loop()
        self._tracker = SessionStateTracker(self._loop)
        self._session_id = self._service.open_session(self)
        if self._root != "/":
            with contextlib.suppress(NodeExistsError):
                await self._op(self._service.create, self._root, b"", False, True)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._disarm_suspension_timer()
        for watch in list(self._watches):
            watch.cancel()
        if self._tracker is not None:
            self._tracker.close()
            self._service.end_session(self._session_id)

    def _on_session_expired(self) -> None:
        if self._tracker is not None:
            self._tracker.set_state(SessionState.LOST)
        for watch in list(self._watches):
            watch.cancel()

    def _on_service_down(self) -> None:
        loop = self._loop
        if self._tracker is None or loop is None or self._closed:
            return
        if self._tracker.set_state(SessionState.SUSPENDED):
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._arm_suspension_timer)

    def _on_service_up(self) -> None:
        loop = self._loop
        if self._tracker is None or loop is None or self._closed:
            return
        if self._tracker.set_state(SessionState.CONNECTED):
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._disarm_suspension_timer)

    def _arm_suspension_timer(self) -> None:
        if self._suspension_timer is None and self._loop is not None:
            self._suspension_timer = self._loop.call_later(
                self.session_timeout, self._suspension_expired
            )

    def _disarm_suspension_timer(self) -> None:
        if self._suspension_timer is not None:
            self._suspension_timer.cancel()
            self._suspension_timer = None

    def _suspension_expired(self) -> None:
        self._suspension_timer = None
        if self._tracker is not None and self._tracker.state is SessionState.SUSPENDED:
            log.warning(
                "memory coordination session %d suspended for longer than %.1fs: lost",
                self._session_id,
                self.session_timeout,
            )
            self._on_session_expired()

    async def _op(self, operation: Callable[..., T], *args: Any) -> T:
        """Run a service operation, waiting (up to the session timeout) while the
        service is down. An operation refused as unavailable changed nothing, so
        retrying it is safe."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.session_timeout + 1.0
        while True:
            session_id = self._check()
            try:
                return operation(session_id, *args)
            except CoordinationUnavailableError:
                if loop.time() >= deadline:
                    raise CoordinationUnavailableError(
                        f"the memory coordination service stayed down for "
                        f"{self.session_timeout + 1.0:.1f}s"
                    ) from None
                await asyncio.sleep(0.01)

    async def watch(self, path: str, callback: DataCallback) -> Watch:
        self._check()
        delivery: LoopDelivery[Versioned | None] = LoopDelivery(
            asyncio.get_running_loop(), callback, name=f"watch {path}"
        )
        remove = self._service.add_data_watcher(self._full(path), delivery.push)
        return self._track(DeliveryWatch(delivery, remove))

    async def watch_children(self, path: str, callback: ChildrenCallback) -> Watch:
        self._check()
        delivery: LoopDelivery[list[str]] = LoopDelivery(
            asyncio.get_running_loop(), callback, name=f"children watch {path}"
        )
        remove = self._service.add_child_watcher(self._full(path), delivery.push)
        return self._track(DeliveryWatch(delivery, remove))

    def _track(self, watch: DeliveryWatch) -> DeliveryWatch:
        self._watches.add(watch)
        return watch


def memory_coordination_factory(
    connect: str, options: Mapping[str, Any] | None = None
) -> MemoryCoordination:
    """``memory://<service>/<root>``: a client of the named in-process service."""
    parts = urlsplit(connect if "://" in connect else f"memory://{connect}")
    if parts.scheme != "memory":
        raise ConfigError(
            f"the memory coordination plugin takes memory://<service>/<root>, got {connect!r}",
            key="coordination",
        )
    service = MemoryCoordinationService.named(parts.netloc or "default")
    raw_timeout = dict(options or {}).get("session_timeout", DEFAULT_SESSION_TIMEOUT)
    try:
        session_timeout = float(raw_timeout)
    except (TypeError, ValueError):
        raise ConfigError(
            f"session_timeout must be a number of seconds, got {raw_timeout!r}",
            key="session_timeout",
        ) from None
    return MemoryCoordination(service, parts.path or "/", session_timeout=session_timeout)


@dataclass
class MemoryCoordinationHarness(CoordinationHarness):
    """The conformance harness of the reference: a fresh service per harness, whose
    outages are simulated (capability ``server_restart``)."""

    capabilities: frozenset[str] = field(default_factory=lambda: frozenset({SERVER_RESTART}))
    service: MemoryCoordinationService = field(default_factory=MemoryCoordinationService)

    async def connect(self, root: str) -> Coordination:
        return MemoryCoordination(self.service, root, session_timeout=self.session_timeout)

    async def expire_session(self, client: Coordination) -> None:
        self.service.expire_session(client.session_id)

    async def kill_server(self) -> None:
        self.service.kill()

    async def restart_server(self) -> None:
        self.service.restart()
