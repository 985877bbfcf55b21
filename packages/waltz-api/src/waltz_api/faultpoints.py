"""Named protocol points where a simulation may strike (FoundationDB's BUGGIFY idea).

Random fault schedules almost never land in the narrow windows where a protocol is
fragile: between a replica's rejoin and the end of its catch-up, between a recovery's
vote and its decision. The code marks those places with :func:`point`; outside a
simulation nothing is installed and a point costs one global read and a comparison.
The deterministic simulation (``waltz_sim.points``) installs a handler that counts
every point hit (a coverage table: docs/simulation.md) and, in the ``points`` fault
profile, crashes, pauses or cuts off the process that hit it, exactly there or a few
milliseconds later.

A handler runs synchronously inside the code that hit the point, in that code's
context: it must not block and must not raise (a simulated crash only marks the
process dead; the code stops at its next await, and nothing it sends is delivered).

Every point is registered in :data:`POINTS` with what it marks; calling an
unregistered name is a bug that the project's tests catch
(``packages/waltz-api/tests/test_faultpoints.py``, and the simulation raises).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

POINTS: Mapping[str, str] = {
    "store.session_opened": "a store session wrote its replica states: it may write",
    "store.session_closing": "a store session ends (fenced, quorum lost, checkpoint, close)",
    "replica.rejoined": "a replica that left its store session joins the writers again",
    "replica.marked_suspect": "a rejoining replica's storage was marked suspect (lost acks)",
    "replica.marked_clean": "a suspect replica holds the committed prefix: marked clean",
    "replica.repaired": "records a replica lost to damage were copied from a peer",
    "recovery.voted": "a replica's log end was counted in a recovery's vote",
    "recovery.decided": "a recovery decided the last session's closing high-water mark",
    "recovery.marks_written": "a recovering replica's storage holds the session's marks "
    "(a suspect's only once caught up): the replica states may record it clean",
    "recovery.late_recorded": "a replica that recovered after the session opened is "
    "recorded clean in the replica states, before it writes",
    "leader.record_written": "a server wrote the leader record (claimed, took over or "
    "renewed the leadership)",
    "client.flush_mark_taken": "a client took a flush round's mark: the appends it sent "
    "before are decided by the answer",
    "archive.object_uploaded": "an archive range object is uploaded (or an orphan adopted), "
    "its manifest not yet written",
    "archive.mark_advanced": "the archive mark moved over a verified range; the replicas "
    "are not pruned yet",
    "storage.journal_round": "an fs storage node's round is durable in its node journal "
    "alone (format 4): its segments are not flushed",
    "storage.journal_checkpoint": "an fs storage node's checkpoint flushed the segments and "
    "wrote the ends and the journal's position: the ring behind it is free",
    "storage.journal_replayed": "an fs storage node's open wrote back what its journal "
    "holds past the segments, not yet flushed by the checkpoint after it",
    "storage.journal_direct_written": "an fs storage node wrote an append larger than a "
    "round straight to its segments, not yet flushed by the checkpoint after it",
}
"""Every point's name and what it marks."""

Handler = Callable[[str, Mapping[str, object]], None]


class _Installed:
    handler: Handler | None = None


def point(name: str, **detail: object) -> None:
    """The code reached the protocol point ``name`` (``detail``: what a handler may log)."""
    handler = _Installed.handler
    if handler is not None:
        handler(name, detail)


@contextmanager
def installed(handler: Handler) -> Iterator[None]:
    """Install ``handler`` for every point while the block runs (one at a time)."""
    if _Installed.handler is not None:
        from waltz_api.errors import WaltzError

        raise WaltzError("a fault-point handler is already installed (one run at a time)")
    _Installed.handler = handler
    try:
        yield
    finally:
        _Installed.handler = None
