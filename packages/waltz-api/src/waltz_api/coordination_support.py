"""Helpers for Coordination implementations: delivering callbacks on the event loop,
and what every plugin checks the same way (paths, options).

A coordination client library calls back from its own threads; the contract
wants callbacks on the caller's event loop, one at a time, in order. These
helpers do that hand-over (``loop.call_soon_threadsafe``) once, for every plugin.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import math
import threading
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from waltz_api.contracts.coordination import (
    Coordination,
    SessionListener,
    SessionState,
    Versioned,
    Watch,
    join_path,
)
from waltz_api.errors import ArgumentTypeError, ConfigError, CoordinationError

log = logging.getLogger(__name__)

T = TypeVar("T")


class LoopDelivery(Generic[T]):
    """Delivers values to one callback on an event loop, serially and in order.

    :meth:`push` may be called from any thread. With ``coalesce`` only the
    latest undelivered value is kept (a watch's consecutive changes collapse
    into the last one, which is always delivered); without it every value is
    delivered. A callback may be a plain function or a coroutine function; an
    exception it raises is logged and delivery continues.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        callback: Callable[[T], Any],
        *,
        coalesce: bool = True,
        name: str = "watch",
    ) -> None:
        self._loop = loop
        self._callback = callback
        self._coalesce = coalesce
        self._name = name
        self._queue: collections.deque[T] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, value: T) -> None:
        """Queue ``value`` for delivery (thread-safe; ignored once stopped)."""
        if self._stopped:
            return
        try:
            self._loop.call_soon_threadsafe(self._enqueue, value)
        except RuntimeError:  # the loop is closed: nobody is left to deliver to
            self._stopped = True

    def _enqueue(self, value: T) -> None:
        if self._stopped:
            return
        if self._coalesce:
            self._queue.clear()
        self._queue.append(value)
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._drain(), name=f"waltz-{self._name}")

    async def _drain(self) -> None:
        while self._queue and not self._stopped:
            value = self._queue.popleft()
            try:
                result = self._callback(value)
                if inspect.isawaitable(result):
                    await result
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception(
                    "%s callback %r failed; delivery continues", self._name, self._callback
                )

    def stop(self) -> None:
        """Deliver nothing more (idempotent); a callback already running finishes."""
        self._stopped = True
        self._queue.clear()

    async def wait_idle(self) -> None:
        """Wait until everything queued so far was delivered (tests, close)."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.shield(task)


class DeliveryWatch(Watch):
    """A :class:`Watch` backed by a :class:`LoopDelivery`, with an optional cancel hook."""

    def __init__(
        self, delivery: LoopDelivery[Any], on_cancel: Callable[[], None] | None = None
    ) -> None:
        self.delivery = delivery
        self._on_cancel = on_cancel
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        self.delivery.stop()
        if self._on_cancel is not None:
            self._on_cancel()


class SessionStateTracker:
    """The session state of one client and its listeners.

    Two ways to deliver, chosen once:

    - from a client library's threads (the default): :meth:`set_state` may be
      called from any thread; listeners are called on ``loop``, in order, once
      per actual change, soon after (``call_soon_threadsafe``);
    - ``inline=True``, for asyncio-native plugins whose state changes happen on
      the event loop: :meth:`set_state` (called on the loop) calls the listeners
      before it returns, so whatever a listener does (a server dropping its
      partitions on LOST) happens before anything else runs on the loop.

    LOST is final once the session has begun: later states are ignored. A
    tracker created LOST (a client not started yet) leaves LOST once, when its
    session begins. After :meth:`close` nothing is delivered. With ``describe``
    (a name, or a function returning one, such as ``"etcd session 1f"``) every
    change is logged at INFO. A listener that raises is logged; the others still
    run.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        initial: SessionState = SessionState.CONNECTED,
        *,
        inline: bool = False,
        describe: str | Callable[[], str] | None = None,
    ) -> None:
        self._state = initial
        self._begun = initial is not SessionState.LOST
        self._listeners: list[SessionListener] = []
        self._inline = inline
        self._describe = describe
        self._delivery: LoopDelivery[SessionState] | None = None
        if not inline:
            if loop is None:
                raise ArgumentTypeError("a SessionStateTracker delivering on a loop needs the loop")
            self._delivery = LoopDelivery(
                loop, self._notify, coalesce=False, name="session-listener"
            )
        self._closed = False
        self._lock = threading.Lock()

    @property
    def state(self) -> SessionState:
        return self._state

    @property
    def lost(self) -> bool:
        return self._state is SessionState.LOST

    def add_listener(self, listener: SessionListener) -> None:
        self._listeners.append(listener)

    def set_state(self, state: SessionState) -> bool:
        """Record a new state; returns False when ignored (unchanged, after LOST, closed)."""
        with self._lock:
            if self._closed or state is self._state:
                return False
            if self._state is SessionState.LOST and self._begun:
                return False
            previous, self._state, self._begun = self._state, state, True
            if self._delivery is not None:
                self._delivery.push(state)
        if self._describe is not None:
            name = self._describe if isinstance(self._describe, str) else self._describe()
            log.info("%s: %s -> %s", name, previous.value, state.value)
        if self._inline:
            self._notify(state)
        return True

    def _notify(self, state: SessionState) -> None:
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:
                log.exception("session listener %r failed on %s", listener, state.value)

    def close(self, *, final: SessionState | None = None) -> None:
        """Deliver nothing more (idempotent). With ``final`` the state becomes that,
        silently (a client closed on purpose reports LOST without notifying)."""
        with self._lock:
            self._closed = True
            if final is not None:
                self._state = final
            if self._delivery is not None:
                self._delivery.stop()

    async def wait_idle(self) -> None:
        """Wait until every change so far reached the listeners (at once when inline)."""
        if self._delivery is not None:
            await self._delivery.wait_idle()


# -- ordered, coalescing delivery of watch states (for plugins that poll or stream) --
class Notifier(Generic[T]):
    """Delivers the newest state offered to ``callback``, in revision order.

    A watch source offers states tagged with the revision at which they were
    observed; older or repeated states are dropped, the newest pending state
    replaces any undelivered one (coalescing), and the final state is always
    delivered. The callback runs in its own task, so a slow callback never holds
    up the source or the other watches.
    """

    def __init__(self, callback: Callable[[T], Awaitable[None] | None], what: str) -> None:
        self._callback = callback
        self._what = what
        self._revision = -1
        self._delivered: tuple[T] | None = None
        self._pending: tuple[T] | None = None
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def revision(self) -> int:
        """The revision of the newest state offered so far."""
        return self._revision

    async def deliver_initial(self, state: T, revision: int) -> None:
        """Deliver the state at registration time, before the watch is returned.

        States offered before this call (a source may start before the initial
        read) are kept only when newer than ``revision``."""
        if revision >= self._revision:
            self._revision = revision
            self._pending = None
        self._delivered = (state,)
        await self._call(state)
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"waltz-watch-{self._what}"
        )

    def offer(self, state: T, revision: int) -> None:
        """Offer ``state`` observed at ``revision``; dropped when not newer."""
        if self._closed or revision <= self._revision:
            return
        self._revision = revision
        if self._delivered is not None and self._delivered[0] == state:
            self._pending = None
            return
        self._pending = (state,)
        self._wakeup.set()

    async def _run(self) -> None:
        while not self._closed:
            await self._wakeup.wait()
            self._wakeup.clear()
            pending, self._pending = self._pending, None
            if self._closed:
                return
            if pending is None or (self._delivered is not None and self._delivered == pending):
                continue
            self._delivered = pending
            await self._call(pending[0])

    async def _call(self, state: T) -> None:
        try:
            result = self._callback(state)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("watch callback for %s raised; the watch stays registered", self._what)

    def close(self) -> None:
        """Stop delivering (idempotent)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()

    async def wait_closed(self) -> None:
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


def rooted_path(root: str, path: str) -> str:
    """The contract's ``path`` under a client's ``root``, normalised by
    :func:`~waltz_api.contracts.coordination.join_path`: ``rooted_path("/waltz", "/a/b")``
    is ``"/waltz/a/b"``. The contract's paths are absolute: a relative one is refused."""
    if not path.startswith("/"):
        raise CoordinationError(f"coordination paths are absolute ('/a/b'), got {path!r}")
    return join_path(root, path)


def check_path(path: str) -> str:
    """Validate an absolute, normalised path (``/`` or ``/a/b``)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise CoordinationError(f"path {path!r} must be a string starting with '/'")
    if path != "/" and (path.endswith("/") or "//" in path):
        raise CoordinationError(
            f"path {path!r} is not normalised (no empty segment, no trailing '/'); "
            "build paths with waltz_api.contracts.coordination.join_path"
        )
    return path


def seconds_option(options: Mapping[str, Any], name: str, default: float) -> float:
    """The coordination option ``name`` (a positive, finite number of seconds), or
    ``default``; a ConfigError naming the key otherwise."""
    value = options.get(name, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(
            f"coordination option {name} must be a positive number of seconds, got {value!r}",
            key=f"coordination.{name}",
        )
    return number


class InProcessService(Protocol):
    """The data operations of an in-process coordination service, each on behalf of a
    session (what :class:`InProcessServiceClient` forwards to)."""

    def get(self, session_id: int, path: str) -> Versioned | None: ...

    def create(
        self, session_id: int, path: str, value: bytes, ephemeral: bool, make_parents: bool
    ) -> int: ...

    def set(
        self, session_id: int, path: str, value: bytes, expected_version: int | None
    ) -> int: ...

    def delete(
        self, session_id: int, path: str, expected_version: int | None, recursive: bool
    ) -> None: ...

    def children(self, session_id: int, path: str) -> list[str]: ...

    def increment(self, session_id: int, path: str) -> int: ...


class TrackedSessionCoordination(Coordination):
    """A Coordination whose session state a :class:`SessionStateTracker` keeps (none
    before ``start``: CONNECTED is reported until then); its ``__init__`` sets the
    fields below."""

    _session_id: int
    _tracker: SessionStateTracker | None

    @property
    def session_state(self) -> SessionState:
        return SessionState.CONNECTED if self._tracker is None else self._tracker.state

    def add_session_listener(self, listener: SessionListener) -> None:
        if self._tracker is None:
            raise CoordinationError("start the client before adding session listeners")
        self._tracker.add_listener(listener)

    @property
    def session_id(self) -> int:
        return self._session_id


class InProcessServiceClient(TrackedSessionCoordination):
    """A client (one session) of a coordination service in this process: the
    conformance suite's memory plugin, the simulation's. The contract's data operations
    go to the service's methods of the same name, under the client's root, each through
    :meth:`_op`: how a request reaches the service, and how long it may wait, is the
    subclass's. Its ``__init__`` sets the fields below."""

    _service: InProcessService
    _root: str

    @abstractmethod
    async def _op(self, operation: Callable[..., T], *args: Any) -> T:
        """``operation(session_id, *args)`` on the service, as this client reaches it."""

    def _full(self, path: str) -> str:
        return rooted_path(self._root, path)

    async def get(self, path: str) -> Versioned | None:
        return await self._op(self._service.get, self._full(path))

    async def create(
        self, path: str, value: bytes = b"", *, ephemeral: bool = False, make_parents: bool = True
    ) -> int:
        return await self._op(
            self._service.create, self._full(path), bytes(value), ephemeral, make_parents
        )

    async def set(self, path: str, value: bytes, *, expected_version: int | None = None) -> int:
        return await self._op(self._service.set, self._full(path), bytes(value), expected_version)

    async def delete(
        self, path: str, *, expected_version: int | None = None, recursive: bool = False
    ) -> None:
        await self._op(self._service.delete, self._full(path), expected_version, recursive)

    async def children(self, path: str) -> list[str]:
        return await self._op(self._service.children, self._full(path))

    async def increment(self, path: str) -> int:
        return await self._op(self._service.increment, self._full(path))
