"""Ordered, coalescing delivery of watch notifications to one callback.

A watch source offers states tagged with the revision at which they were
observed; older or repeated states are dropped, the newest pending state
replaces any undelivered one (coalescing), and the final state is always
delivered. The callback runs in its own task, so a slow callback never holds
up the source or the other watches.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Notifier(Generic[T]):
    """Delivers the newest state offered to ``callback``, in revision order."""

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
