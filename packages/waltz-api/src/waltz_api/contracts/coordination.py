"""The Coordination contract: a small, consistent, versioned key-value tree.

ZooKeeper is the model (kazoo's client states in particular); etcd v3 and the
embedded ``local`` service implement the same semantics.

Errors (all from :mod:`waltz_api.errors`):

- NodeExistsError / NoNodeError / BadVersionError / NotEmptyError: the
  operation was refused and changed nothing.
- SessionLostError: the session expired (state LOST). A LOST client stays
  lost: every later operation raises SessionLostError. Close it and start a
  new client (with a new session) to carry on; re-create the ephemeral
  entries and re-register from scratch.
- CoordinationUnavailableError: the service could not be reached in time
  (for example while SUSPENDED for too long). For a write (create, set,
  delete, increment) the outcome is then UNKNOWN: the write may or may not
  have been applied. Re-read before deciding anything; never assume a CAS
  that raised this lost (or won).
- CoordinationError: any other failure, including use of a closed client.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any


class SessionState(enum.Enum):
    """The client's session with the coordination service (kazoo's states).

    Safety rules, which every user of this contract follows:

    - CONNECTED: reads, writes and ephemeral entries work.
    - SUSPENDED: the connection dropped; the session may still be alive and
      its ephemeral entries with it. Do not start anything that relies on
      holding an ephemeral entry or on a fresh read (for example: do not
      start a new store session). Work already fenced by a CAS (a store
      session id held by storage nodes) may continue: the storage nodes fence
      it if someone else took over. Operations issued while SUSPENDED wait
      for the connection to come back, for a bounded time (then
      CoordinationUnavailableError).
    - LOST: the session expired and every ephemeral entry it created is gone.
      Treat every ownership derived from them (partition assignment, server
      registration) as lost: stop serving, then re-register with a new
      client. LOST is final for a client object (see the module docstring).

    Transitions: CONNECTED -> SUSPENDED -> CONNECTED (same session, nothing
    lost) or SUSPENDED -> LOST; CONNECTED -> LOST directly when the service
    tells the client its session expired. A client that stays SUSPENDED for
    longer than its session timeout moves to LOST by itself: it cannot tell
    whether the service expired the session meanwhile, so it assumes so.
    :meth:`Coordination.close` does not notify LOST: the owner closed it on purpose.
    """

    CONNECTED = "connected"
    SUSPENDED = "suspended"
    LOST = "lost"


SessionListener = Callable[[SessionState], None]


@dataclass(frozen=True, slots=True)
class Versioned:
    """A value and its version.

    Versions of one path strictly increase with every change while the path
    exists. A path that is deleted and created again may restart its
    versions (ZooKeeper restarts at 0; etcd's revisions and ``local`` do
    not), so a CAS could confuse the new incarnation with an older one. CAS
    users therefore never delete a path whose version a fencing decision
    rests on: they keep such paths for the cluster's lifetime and change them
    only with :meth:`Coordination.set` and ``expected_version``. Where a path
    must be re-created, put an epoch (a value from :meth:`Coordination.increment`)
    in the value and compare that too.
    """

    value: bytes
    version: int


class Watch(ABC):
    """A registered watch; cancel it when no longer needed."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop delivering notifications (idempotent). No callback starts after
        this returns (one already running on the loop finishes)."""


DataCallback = Callable[[Versioned | None], Awaitable[None] | None]
ChildrenCallback = Callable[[list[str]], Awaitable[None] | None]


class Coordination(ABC):
    """A client of a coordination service, rooted at a path prefix.

    Paths are absolute within the root, '/'-separated, e.g. ``/servers/7``.
    Every method is a coroutine on the caller's event loop; implementations
    run blocking client libraries in their own threads and hand results back
    to the loop. Callbacks (watches, session listeners) run on that loop, one
    at a time and in order; an exception raised by a callback is logged and
    does not stop the watch.

    Fencing rule: whatever a fencing decision rests on (a store session id, a
    generation) is changed with :meth:`set` and ``expected_version`` (a CAS),
    never a read followed by a blind write.
    """

    @abstractmethod
    async def start(self) -> None:
        """Connect and open a session; raises CoordinationUnavailableError in time."""

    @abstractmethod
    async def close(self) -> None:
        """End the session; its ephemeral entries are deleted promptly.

        Idempotent. Watches stop; later operations raise CoordinationError."""

    @property
    @abstractmethod
    def session_state(self) -> SessionState:
        """The current session state."""

    @abstractmethod
    def add_session_listener(self, listener: SessionListener) -> None:
        """Call ``listener`` (on the event loop) at every session state change."""

    @property
    @abstractmethod
    def session_id(self) -> int:
        """The id of this client's session (fixed for the client's lifetime: a
        LOST session is replaced by starting a new client, which has another id)."""

    @abstractmethod
    async def get(self, path: str) -> Versioned | None:
        """The value at ``path`` and its version, or None when absent."""

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists."""
        return await self.get(path) is not None

    @abstractmethod
    async def create(
        self, path: str, value: bytes = b"", *, ephemeral: bool = False, make_parents: bool = True
    ) -> int:
        """Create ``path``; returns its version. Raises NodeExistsError when it exists.

        Missing parents are created (empty, persistent) with ``make_parents``,
        else NoNodeError. An ephemeral entry is deleted when this client's
        session ends (close, expiry or lease loss) and can have no children."""

    @abstractmethod
    async def set(self, path: str, value: bytes, *, expected_version: int | None = None) -> int:
        """Write ``value``; returns the new version.

        With ``expected_version`` this is a compare-and-set: it succeeds only
        when the current version equals it, else raises BadVersionError. Of
        several clients racing a CAS on the same version, exactly one wins.
        Raises NoNodeError when the path does not exist."""

    @abstractmethod
    async def delete(
        self, path: str, *, expected_version: int | None = None, recursive: bool = False
    ) -> None:
        """Delete ``path`` (and its subtree with ``recursive``). Deleting an absent path
        is a no-op unless ``expected_version`` is given (then NoNodeError).

        A path with children raises NotEmptyError unless ``recursive``. With
        ``expected_version`` a mismatch raises BadVersionError."""

    @abstractmethod
    async def children(self, path: str) -> list[str]:
        """The names (not paths) of ``path``'s children, sorted; [] when absent."""

    @abstractmethod
    async def watch(self, path: str, callback: DataCallback) -> Watch:
        """Call ``callback`` with the current value now, and again after changes.

        The first call happens before this returns or soon after; it carries
        the value at (or after) registration. ``None`` means absent (the
        watch keeps going and reports a later creation). Notifications are
        delivered in order of version; consecutive changes may be coalesced
        into one notification carrying the later value, but the final state
        is always delivered (a watcher is never left with a stale value)."""

    @abstractmethod
    async def watch_children(self, path: str, callback: ChildrenCallback) -> Watch:
        """Like :meth:`watch`, for the sorted list of ``path``'s children ([] when
        ``path`` is absent; the watch keeps going and reports children added later)."""

    @abstractmethod
    async def increment(self, path: str) -> int:
        """Atomically increment the counter at ``path`` and return the new value.

        The counter is created on first use; the first value returned is 1.
        Values strictly increase under any concurrency (across every client of
        the service) and are never handed out twice, so they serve as unique
        ids. The path holds the counter only: read it through this method, never
        with :meth:`get` or :meth:`set` (its representation is the plugin's)."""


def join_path(*parts: Any) -> str:
    """Join path parts into a normalised absolute path: join_path("a", 1) == "/a/1"."""
    segments: list[str] = []
    for part in parts:
        segments.extend(s for s in str(part).split("/") if s)
    return "/" + "/".join(segments)
