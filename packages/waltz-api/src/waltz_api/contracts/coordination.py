"""The Coordination contract: a small, consistent, versioned key-value tree.

ZooKeeper is the model (kazoo's client states in particular); etcd v3 and the
embedded ``local`` service implement the same semantics.
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
      it if someone else took over.
    - LOST: the session expired and every ephemeral entry it created is gone.
      Treat every ownership derived from them (partition assignment, server
      registration) as lost: stop serving, then re-register.
    """

    CONNECTED = "connected"
    SUSPENDED = "suspended"
    LOST = "lost"


SessionListener = Callable[[SessionState], None]


@dataclass(frozen=True, slots=True)
class Versioned:
    """A value and its version. Versions of one path strictly increase with every
    change (and a re-created path never reuses a version that a CAS could confuse
    with an older incarnation, as far as the service allows)."""

    value: bytes
    version: int


class Watch(ABC):
    """A registered watch; cancel it when no longer needed."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop delivering notifications (idempotent)."""


DataCallback = Callable[[Versioned | None], Awaitable[None] | None]
ChildrenCallback = Callable[[list[str]], Awaitable[None] | None]


class Coordination(ABC):
    """A client of a coordination service, rooted at a path prefix.

    Paths are absolute within the root, '/'-separated, e.g. ``/servers/7``.
    Every method is a coroutine on the caller's event loop; implementations
    run blocking client libraries in their own threads.

    Fencing rule: whatever a fencing decision rests on (a store session id, a
    generation) is changed with :meth:`set` and ``expected_version`` (a CAS),
    never a read followed by a blind write.
    """

    @abstractmethod
    async def start(self) -> None:
        """Connect and open a session; raises CoordinationUnavailableError in time."""

    @abstractmethod
    async def close(self) -> None:
        """End the session; its ephemeral entries are deleted promptly."""

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
        """An id of the current session (changes when a lost session is replaced)."""

    @abstractmethod
    async def get(self, path: str) -> Versioned | None:
        """The value at ``path`` and its version, or None when absent."""

    @abstractmethod
    async def create(
        self, path: str, value: bytes = b"", *, ephemeral: bool = False, make_parents: bool = True
    ) -> int:
        """Create ``path``; returns its version. Raises NodeExistsError when it exists.

        An ephemeral entry is deleted when this client's session ends (close,
        expiry or lease loss) and can have no children."""

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
        is a no-op unless ``expected_version`` is given (then NoNodeError)."""

    @abstractmethod
    async def children(self, path: str) -> list[str]:
        """The names (not paths) of ``path``'s children, sorted; [] when absent."""

    @abstractmethod
    async def watch(self, path: str, callback: DataCallback) -> Watch:
        """Call ``callback`` with the current value now, and again after changes.

        Notifications are delivered in order of version; consecutive changes
        may be coalesced into one notification carrying the later value, but
        the final state is always delivered (a watcher is never left with a
        stale value)."""

    @abstractmethod
    async def watch_children(self, path: str, callback: ChildrenCallback) -> Watch:
        """Like :meth:`watch`, for the sorted list of ``path``'s children."""

    @abstractmethod
    async def increment(self, path: str) -> int:
        """Atomically increment the counter at ``path`` (created at 0) and return the
        new value. Values strictly increase under any concurrency and are never
        handed out twice, so they serve as unique ids."""


def join_path(*parts: Any) -> str:
    """Join path parts into a normalised absolute path: join_path("a", 1) == "/a/1"."""
    segments: list[str] = []
    for part in parts:
        segments.extend(s for s in str(part).split("/") if s)
    return "/" + "/".join(segments)
