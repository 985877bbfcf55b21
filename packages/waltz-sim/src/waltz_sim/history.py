"""The history of a run as it happens: the ops the clients start and end, what they
apply, their lock failures, and the store sessions the servers open (seen at the
protocol points). It lives on the world's side, so it survives the clients' crashes;
the world turns it into the checker's :class:`~waltz_sim.checker.History` at the end."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, replace

from waltz_sim.checker import (
    INVOKE,
    OK,
    UNKNOWN,
    FeedEvent,
    LockFailure,
    OpEvent,
    SessionSpan,
)
from waltz_sim.loop import CURRENT
from waltz_sim.trace import Trace


@dataclass
class _Pending:
    event: OpEvent
    process: str


class HistoryRecorder:
    """The history the clients write (world side: it survives their crashes), and the
    store sessions the servers open (seen at the protocol points)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, trace: Trace) -> None:
        self.loop = loop
        self.trace = trace
        self.ops: list[OpEvent] = []
        self.feed: list[FeedEvent] = []
        self.pending: dict[str, _Pending] = {}
        self.lock_failures: list[LockFailure] = []
        self.sessions: dict[tuple[int, int], SessionSpan] = {}
        self._all_decided: asyncio.Event | None = None

    def _add(self, event: OpEvent) -> None:
        self.ops.append(event)
        text = f"{event.kind} {event.op_id} p{event.partition}"
        if event.kind == OK:
            text += f" -> {event.transaction_id}"
        if event.detail:
            text += f" ({event.detail})"
        self.trace.add("op", text)

    def invoke(self, op_id: str, client: str, partition: int, detail: str) -> None:
        event = OpEvent(INVOKE, op_id, client, self.loop.time(), partition, detail=detail)
        self.pending[op_id] = _Pending(event, client)
        self._add(event)

    def end(self, kind: str, op_id: str, transaction_id: int = -1, detail: str = "") -> None:
        pending = self.pending.pop(op_id, None)
        if pending is None:
            return  # ended already (the client crashed meanwhile)
        if not self.pending and self._all_decided is not None:
            self._all_decided.set()
        invoke = pending.event
        self._add(
            OpEvent(
                kind,
                op_id,
                invoke.client,
                self.loop.time(),
                invoke.partition,
                transaction_id,
                detail,
            )
        )

    def crashed(self, process: str) -> None:
        for op_id, pending in list(self.pending.items()):
            if pending.process == process:
                self.end(UNKNOWN, op_id, detail="crashed with the op in flight")
        now = self.loop.time()
        for key, span in self.sessions.items():
            if span.server == process and span.closed_at is None:
                self.sessions[key] = replace(span, closed_at=now)

    def applied(self, event: FeedEvent) -> None:
        self.feed.append(event)

    def lock_failed(self, failure: LockFailure) -> None:
        self.lock_failures.append(failure)
        self.trace.add(
            "op",
            f"lock failure {failure.op_id} p{failure.partition}: built on "
            f"{failure.client_high_water_mark}, conflict {failure.conflict}",
        )

    def point(self, name: str, detail: Mapping[str, object]) -> None:
        """A protocol point was hit: note the store sessions' openings and ends."""
        if name not in ("store.session_opened", "store.session_closing"):
            return
        partition, session = detail.get("partition"), detail.get("session")
        mark = detail.get("mark")
        if not isinstance(partition, int) or not isinstance(session, int):
            return
        now = self.loop.time()
        key = (partition, session)
        span = self.sessions.get(key)
        if name == "store.session_opened" and isinstance(mark, int) and span is None:
            incarnation = CURRENT.get()
            server = incarnation.process.name if incarnation is not None else ""
            self.sessions[key] = SessionSpan(partition, session, now, mark, server=server)
        elif name == "store.session_closing" and span is not None and span.closed_at is None:
            self.sessions[key] = replace(span, closed_at=now)

    async def drain(self, until: float) -> bool:
        """Wait until no op is open, or until ``until`` (virtual time); True: none is."""
        self._all_decided = asyncio.Event()
        if self.pending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(until):
                    await self._all_decided.wait()
        return not self.pending


__all__ = ["HistoryRecorder"]
