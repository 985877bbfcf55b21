"""The server's side of the cluster's ACL (``waltz acl``; the model is ``waltz_api.access``).

:class:`AccessGate` keeps the ACL current with a watch on its own coordination client
(a new client after a lost session, so a change still arrives), and the server asks
it about every client request before the request reaches its partition
(:meth:`AccessGate.refusal`): the key the transport authenticated for the connection
(``Connection.peer_identity``) must hold the permission the request needs there.

Until the first value arrives nothing is served (:meth:`start` waits for it). While
the coordination service is unreachable the last known ACL stays in force; a change
made meanwhile applies when the watch comes back. When a change takes the read
permission away from a key, ``on_change`` lets the server close the connections that
mounted a partition they may no longer read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable, Sequence

from waltz_api.access import AccessControl, Permission, denial, needed_for
from waltz_api.backoff import Backoff
from waltz_api.cluster import ClusterMetadata
from waltz_api.contracts.coordination import Coordination, SessionState, Watch
from waltz_api.errors import CoordinationError, WaltzError
from waltz_api.messages import Message

log = logging.getLogger(__name__)

LOG_EVERY = 60.0
"""Seconds between two log lines about the same key refused on the same partition."""
_LOGGED_LIMIT = 10_000


class AccessGate:
    """The ACL in force on this server."""

    def __init__(
        self,
        coordination: Callable[[], Coordination],
        on_change: Callable[[AccessControl], None] | None = None,
        rng: random.Random | None = None,
        followers: Sequence[Callable[[ClusterMetadata], Awaitable[Watch]]] = (),
    ) -> None:
        """``followers``: more watches of the cluster metadata to keep on the same
        coordination client (each started anew with every client), e.g. the cluster's
        feature level (:class:`waltz_server.server.features.ClusterFeatures`)."""
        self._new_client = coordination
        self._followers = list(followers)
        self._rng = rng or random.Random()
        """The retry back-off's jitter (injected: a simulation replays it)."""
        self.on_change = on_change
        self.acl: AccessControl | None = None
        """The ACL in force (None before the first value: nothing is served)."""
        self._known = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._logged: dict[tuple[str | None, int, Permission], float] = {}

    @property
    def enforced(self) -> bool:
        return self.acl is None or self.acl.enforced

    async def start(self, timeout: float = 30.0) -> None:
        """Watch the ACL; returns once it is known (CoordinationError after ``timeout``)."""
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="waltz-acl")
        try:
            await asyncio.wait_for(self._known.wait(), timeout)
        except TimeoutError:
            await self.close()
            raise CoordinationError(
                f"the cluster's ACL could not be read within {timeout} s; is the coordination "
                "service reachable?"
            ) from None

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def refusal(self, identity: str | None, partition_id: int, request: Message) -> str | None:
        """Why ``request`` from a connection of ``identity`` is refused (None: allowed)."""
        acl = self.acl
        if acl is not None and not acl.enforced:
            return None
        needed = needed_for(request)
        if acl is not None and acl.allows(identity, partition_id, needed):
            return None
        reason = (
            denial(identity, partition_id, needed, acl)
            if acl is not None
            else "access denied: the cluster's ACL is not known yet; try again"
        )
        self._log(identity, partition_id, needed, reason)
        return reason

    def may_read(self, identity: str | None, partition_id: int) -> bool:
        acl = self.acl
        return acl is not None and acl.allows(identity, partition_id, Permission.READ)

    def _log(self, identity: str | None, partition_id: int, needed: Permission, why: str) -> None:
        now = asyncio.get_running_loop().time()
        key = (identity, partition_id, needed)
        last = self._logged.get(key)
        if last is not None and now - last < LOG_EVERY:
            return
        if len(self._logged) >= _LOGGED_LIMIT:
            self._logged.clear()
        self._logged[key] = now
        log.warning("refused a %s request: %s", needed.label, why)

    def _apply(self, acl: AccessControl | None) -> None:
        current = acl if acl is not None else AccessControl()
        first = self.acl is None
        if first or current != self.acl:
            grants = sum(len(g.partitions) for g in current.keys.values())
            log.info(
                "access control %s (%d key(s), %d grant(s))",
                "enforced" if current.enforced else "not enforced",
                len(current.keys),
                grants,
            )
        self.acl = current
        self._known.set()
        if not first and self.on_change is not None:
            self.on_change(current)

    async def _follow(self) -> None:
        """One coordination client after another (a LOST session is final for a client),
        each watching the ACL until its session is lost."""
        backoff = Backoff(0.2, 5.0, self._rng)
        while not self._closed:
            client = self._new_client()
            lost = asyncio.Event()
            try:
                await client.start()
                client.add_session_listener(_on_lost(lost))
                metadata = ClusterMetadata(client)
                watches = [await metadata.watch_access_control(self._apply)]
                try:
                    for follow in self._followers:
                        watches.append(await follow(metadata))
                    backoff.reset()
                    await lost.wait()
                finally:
                    for watch in watches:
                        watch.cancel()
                log.warning("the ACL's coordination session was lost; watching it anew")
            except WaltzError as exc:
                log.warning("cannot watch the cluster's ACL (%s); trying again", exc)
            finally:
                with contextlib.suppress(WaltzError):
                    await client.close()
            await backoff.sleep()


def _on_lost(lost: asyncio.Event) -> Callable[[SessionState], None]:
    def listener(state: SessionState) -> None:
        if state is SessionState.LOST:
            lost.set()

    return listener
