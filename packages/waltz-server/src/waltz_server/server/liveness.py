"""Failure detection and leadership among servers: pure state machines (no I/O, no clock).

The cluster manager moves a partition away from its owner as soon as the owner is
*suspected*, and a follower takes the leadership over from a suspected leader, without
waiting for the coordination session of the dead server to expire (10 s by default).
Suspicion is a guess: it may be wrong (a slow server, a network cut between two
servers). Nothing here is a safety decision. A wrong guess only moves partitions; the
generations (a CAS per move) and the store sessions (fenced by the storage nodes) keep
a server that was wrongly suspected, or that resumes after a pause, from writing
anything (see docs/cluster-manager.md).

:class:`FailureDetector` (one per server, fed by
:class:`waltz_server.server.peers.PeerMonitor`): every peer answers pings; a peer whose
answers stop for ``suspect_after`` seconds is suspected. Silence is counted only over
time this server itself was running: at each tick a peer's silence grows by the time
since the previous tick, but by at most ``max_step`` (two tick intervals). A server
that was paused, or whose event loop was starved, therefore never blames its peers for
its own stall (their answers wait unread in its buffers meanwhile), and a loaded
machine slows the detector down rather than making it jumpy.

:func:`decide_leadership`: leadership is a versioned record (``/assignment/leader``,
:class:`waltz_api.cluster.LeaderRecord`) changed only by compare-and-set. The record's
holder leads while it is registered and not suspected; a follower takes over (a CAS
that raises the term) when the holder is gone from the registrations, or when the
follower suspects it *and* the holder has not renewed the record for ``suspect_after``.
A leader renews (a CAS) while it suspects a registered server: in a cut between two
servers that both still reach the coordination service, the leader keeps its role (its
renewals reach everyone) instead of the two taking it from each other in turn. Among
several followers, only the lowest id they do not suspect acts; if two act at once, the
CAS picks one.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Hashable
from dataclasses import dataclass, field

from waltz_api.errors import ConfigError

DEFAULT_HEARTBEAT_INTERVAL = 0.1
DEFAULT_SUSPECT_AFTER = 1.5


@dataclass(frozen=True, slots=True)
class LivenessConfig:
    """Timings of failure detection (``server.peer_heartbeat_interval`` and
    ``server.peer_suspect_after`` in the server config)."""

    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL
    """Seconds between two pings of a peer, and between two ticks of the detector."""
    suspect_after: float = DEFAULT_SUSPECT_AFTER
    """Seconds without an answer (this server's own stalls not counted) before a peer
    is suspected: its partitions move, and a suspected leader is replaced."""

    def __post_init__(self) -> None:
        if not self.heartbeat_interval > 0:
            raise ConfigError(
                f"the peer heartbeat interval must be positive, got {self.heartbeat_interval}",
                key="server.peer_heartbeat_interval",
            )
        if not self.suspect_after >= 4 * self.heartbeat_interval:
            raise ConfigError(
                f"server.peer_suspect_after ({self.suspect_after} s) must be at least four "
                f"heartbeat intervals ({4 * self.heartbeat_interval:g} s): a peer must miss "
                "several pings before it is suspected",
                key="server.peer_suspect_after",
            )

    @property
    def max_step(self) -> float:
        """The most silence one tick may add (a late tick is this server's own stall)."""
        return 2 * self.heartbeat_interval

    @property
    def renew_interval(self) -> float:
        """How often a leader that suspects a server renews its record (four times per
        ``suspect_after``, so that a live leader's record never looks stale)."""
        return self.suspect_after / 4


@dataclass(frozen=True, slots=True)
class Changes:
    """What one tick or one answer changed."""

    suspected: frozenset[Hashable] = frozenset()
    cleared: frozenset[Hashable] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.suspected or self.cleared)


NO_CHANGES = Changes()


@dataclass
class _Entry:
    silence: float = 0.0
    heard_at: float | None = None
    suspected: bool = False


@dataclass
class FailureDetector:
    """Silence per tracked key (a peer's server id, or any other signal that should
    keep coming, such as the leader record's renewals), suspicion past a threshold.

    - :meth:`track` starts with no silence (a new peer gets ``suspect_after`` to answer);
    - :meth:`heard` ends a key's silence (and its suspicion);
    - :meth:`tick` adds the time since the previous tick (or since the key was last
      heard, if later), at most ``max_step``, to every key's silence and reports the keys
      that just crossed ``suspect_after``. With ticks on time, a key is suspected at the
      first tick at least ``suspect_after`` after it was last heard.
    """

    suspect_after: float
    max_step: float
    _entries: dict[Hashable, _Entry] = field(default_factory=dict)
    _last_tick: float | None = None

    @classmethod
    def from_config(cls, config: LivenessConfig) -> FailureDetector:
        return cls(config.suspect_after, config.max_step)

    def track(self, key: Hashable) -> None:
        """Watch ``key`` from now on (no effect when already tracked)."""
        self._entries.setdefault(key, _Entry())

    def untrack(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    @property
    def tracked(self) -> frozenset[Hashable]:
        return frozenset(self._entries)

    @property
    def suspects(self) -> frozenset[Hashable]:
        return frozenset(k for k, e in self._entries.items() if e.suspected)

    def is_suspected(self, key: Hashable) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.suspected

    def silence(self, key: Hashable) -> float:
        """The key's silence so far (0 for an untracked key)."""
        entry = self._entries.get(key)
        return 0.0 if entry is None else entry.silence

    def heard(self, key: Hashable, now: float) -> Changes:
        """``key`` answered at ``now``: its silence ends (a suspicion is cleared at once)."""
        entry = self._entries.get(key)
        if entry is None:
            return NO_CHANGES
        entry.silence = 0.0
        entry.heard_at = now
        if entry.suspected:
            entry.suspected = False
            return Changes(cleared=frozenset((key,)))
        return NO_CHANGES

    def tick(self, now: float) -> Changes:
        """Time passed (``now`` from the loop's clock): silences grow, by at most
        ``max_step`` however late this tick is."""
        last, self._last_tick = self._last_tick, now
        if last is None:
            return NO_CHANGES
        suspected = []
        for key, entry in self._entries.items():
            since = last if entry.heard_at is None else max(last, entry.heard_at)
            entry.silence += min(max(now - since, 0.0), self.max_step)
            if not entry.suspected and entry.silence >= self.suspect_after:
                entry.suspected = True
                suspected.append(key)
        return Changes(suspected=frozenset(suspected)) if suspected else NO_CHANGES


# -- leadership --------------------------------------------------------------------------------


class Leadership(enum.Enum):
    """What a server does about the leadership, from what it knows now."""

    FOLLOW = "follow"
    """Someone else leads (or should take over first): make no assignment."""
    LEAD = "lead"
    """The record names this server: it leads (after a fresh read confirms it)."""
    CLAIM = "claim"
    """No record exists yet: create it naming this server."""
    TAKE_OVER = "take_over"
    """The holder is gone or suspected and silent: CAS the record to this server."""


def decide_leadership(
    my_id: int,
    registered: Collection[int],
    suspects: Collection[int],
    holder: int | None,
    holder_silent: bool,
) -> Leadership:
    """The leadership action of server ``my_id``.

    ``registered``: the live registrations; ``suspects``: the servers this one suspects;
    ``holder``: the server the leader record names (None when there is no record);
    ``holder_silent``: the record has not changed (no renewal, no takeover) for
    ``suspect_after``, as this server observed it.
    """
    if my_id not in registered:
        return Leadership.FOLLOW
    if holder == my_id:
        return Leadership.LEAD
    holder_fine = holder not in suspects or not holder_silent
    if holder is not None and holder in registered and holder_fine:
        return Leadership.FOLLOW
    # The holder is gone (or there is none): the lowest registered server this one does
    # not suspect acts, which is this one only if no lower one is fine.
    candidates = [i for i in registered if i == my_id or (i not in suspects and i != holder)]
    if min(candidates) != my_id:
        return Leadership.FOLLOW
    return Leadership.CLAIM if holder is None else Leadership.TAKE_OVER
