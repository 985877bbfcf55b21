"""The client's state machines, pure (no I/O, no event loop, no clock).

- :class:`TransactionMonitor`: which appends are pending; the feed, the server's
  answers, a mount or a flush decide them.
- :class:`FeedTracker`: where a partition's feed is, and what to do with a feed item.
- :class:`RetryQueue`: failed contexts waiting to be re-executed (after a lock
  failure: until the client's feed position reaches the failing transaction).
- :class:`ConcurrencyLimit`: at most N transactions in flight per partition, FIFO.
- :class:`RunningSubmissions`: the submissions running, numbered as they start
  (what a flush waits for).
- :class:`MountSequencer`: mount / reconnect sequencing (appends blocked while mounting).
- :class:`TransactionDataCache`: a byte-bounded LRU of transaction data.
- :class:`ApplyFailures`: how often ``apply_transaction`` failed on the next
  transaction, and when to give up on it (a poison transaction).

The asyncio layer (:mod:`waltz_client.partition`) only turns their decisions
into I/O, so every rule here is tested without a network.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from waltz_api.errors import ClientError
from waltz_api.messages import MountStatus
from waltz_api.types import NO_TRANSACTION, ReqId

W = TypeVar("W")
K = TypeVar("K", bound=Hashable)


# -- transaction monitor ------------------------------------------------------------------------


class Outcome(enum.Enum):
    COMMITTED = "committed"
    """The feed carried the append's ReqId: committed at ``transaction_id``."""
    FAILED = "failed"
    """Not committed, and never will be (a later append of this client committed first,
    the server refused it, a mount completed or a flush settled while it was pending):
    re-execute. ``reason`` says which."""
    LOCK_FAILED = "lock-failed"
    """Rejected by the lock check; ``transaction_id`` made it fail."""


@dataclass(frozen=True, slots=True)
class Resolution:
    req_id: ReqId
    outcome: Outcome
    transaction_id: int = NO_TRANSACTION
    reason: str = ""
    """Why it was decided so (for FAILED: what proved it is not in the log)."""


SUPERSEDED = (
    "a later append of this client (transaction {}) committed first: a server handles a "
    "partition's appends in order, so it did not append this one"
)
REMOUNTED = (
    "the partition was mounted again (a new connection or server) and it was not in the "
    "log the mount delivered"
)
FLUSHED = (
    "the server settled every append it received before a flush, and it was not in the log "
    "up to transaction {}"
)


class TransactionMonitor:
    """The registry of pending appends of one partition, in the order they were sent.

    The stream to a server is ordered and a server handles a partition's appends
    in order, so when the feed carries a registered ReqId every append registered
    before it that is still pending has failed. For the same reason a flush decides
    every append sent before it: :meth:`flush_mark` when sending the FlushRequest,
    :meth:`on_flushed` once the feed has reached the high-water mark it answered.
    """

    __slots__ = ("_order", "_pending")

    def __init__(self) -> None:
        self._pending: OrderedDict[ReqId, int] = OrderedDict()
        self._order = 0

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._pending

    @property
    def pending(self) -> tuple[ReqId, ...]:
        return tuple(self._pending)

    def register(self, req_id: ReqId) -> None:
        """Record an append about to be sent."""
        order = self._order + 1
        # one lookup: a registered req_id keeps its own (earlier) order
        if self._pending.setdefault(req_id, order) != order:
            raise ClientError(f"request {req_id} is registered already (req ids must be unique)")
        self._order = order

    def order_of(self, req_id: ReqId) -> int | None:
        """The registration order of a pending append (None: decided)."""
        return self._pending.get(req_id)

    def flush_mark(self) -> int:
        """Taken when a FlushRequest is sent: it covers every append registered so far."""
        return self._order

    def on_feed(self, req_id: ReqId, transaction_id: int) -> list[Resolution]:
        """A committed transaction: resolves it and every older pending append."""
        pending = self._pending
        order = pending.get(req_id)
        if order is None:
            return []
        resolved: list[Resolution] = []
        while pending:
            oldest, oldest_order = pending.popitem(last=False)
            if oldest_order == order:  # orders are unique: it is req_id
                resolved.append(Resolution(oldest, Outcome.COMMITTED, transaction_id))
                break
            resolved.append(
                Resolution(oldest, Outcome.FAILED, reason=SUPERSEDED.format(transaction_id))
            )
        return resolved

    def on_lock_failure(self, req_id: ReqId, transaction_id: int) -> list[Resolution]:
        """The server rejected ``req_id`` by a lock check (others are unaffected)."""
        if self._pending.pop(req_id, None) is not None:
            reason = f"it failed a lock check: transaction {transaction_id} changed a locked entity"
            return [Resolution(req_id, Outcome.LOCK_FAILED, transaction_id, reason)]
        return []

    def on_refused(self, req_id: ReqId, reason: str = "the server refused it") -> list[Resolution]:
        """The server refused ``req_id`` (ErrorResponse, NOT_COMMITTED included): it is
        not in the log and will not be."""
        if self._pending.pop(req_id, None) is not None:
            return [Resolution(req_id, Outcome.FAILED, reason=reason)]
        return []

    def on_flushed(self, mark: int, high_water_mark: int) -> list[Resolution]:
        """The server answered a flush sent at ``mark`` with ``high_water_mark`` and the
        feed has reached it: whatever was registered before the flush and is still
        pending is not in the log, and never will be (the server answers a flush only
        once every append it received before it is decided)."""
        resolved: list[Resolution] = []
        pending = self._pending
        reason = FLUSHED.format(high_water_mark)
        while pending:
            oldest, order = next(iter(pending.items()))
            if order > mark:
                break
            del pending[oldest]
            resolved.append(Resolution(oldest, Outcome.FAILED, reason=reason))
        return resolved

    def fail_all(self) -> list[Resolution]:
        """A mount completed: the server holds nothing of ours, what is pending failed."""
        resolved = [Resolution(r, Outcome.FAILED, reason=REMOUNTED) for r in self._pending]
        self._pending.clear()
        return resolved


# -- feed position ------------------------------------------------------------------------------


class FeedAction(enum.Enum):
    APPLY = "apply"
    """The next transaction: monitor it, hand it to apply_transaction, then :meth:`advance`."""
    SKIP = "skip"
    """The next transaction, already applied by the application (its high-water mark
    is past it, e.g. another instance sharing the database applied it): monitor it
    and :meth:`advance` without applying."""
    DUPLICATE = "duplicate"
    """At or below the position: seen already, ignore."""
    GAP = "gap"
    """Beyond the next id: something was lost; restart the feed from the position."""


class FeedTracker:
    """A partition's feed position: the last transaction id this client processed.

    At each mount the application's high-water mark is read again: the feed
    restarts from ``min(position, application high-water mark)`` so that the
    client sees (and monitors) every transaction after its position and applies
    exactly those above the application's high-water mark, in order, once.
    """

    __slots__ = ("_floor", "_position")

    def __init__(self) -> None:
        self._position: int | None = None
        self._floor = NO_TRANSACTION

    @property
    def position(self) -> int:
        """The last transaction processed (NO_TRANSACTION before the first mount)."""
        return NO_TRANSACTION if self._position is None else self._position

    @property
    def started(self) -> bool:
        return self._position is not None

    def start_mount(self, application_high_water_mark: int) -> int:
        """The high-water mark to mount with, given the application's current one."""
        if application_high_water_mark < NO_TRANSACTION:
            raise ClientError(
                f"client_high_water_mark returned {application_high_water_mark}; "
                "it must be -1 (nothing applied) or a transaction id"
            )
        self._floor = application_high_water_mark
        if self._position is None or application_high_water_mark < self._position:
            self._position = application_high_water_mark
        return self._position

    def classify(self, transaction_id: int) -> FeedAction:
        position = NO_TRANSACTION if self._position is None else self._position
        if transaction_id <= position:
            return FeedAction.DUPLICATE
        if transaction_id > position + 1:
            return FeedAction.GAP
        return FeedAction.APPLY if transaction_id > self._floor else FeedAction.SKIP

    def advance(self, transaction_id: int) -> None:
        position = NO_TRANSACTION if self._position is None else self._position
        if transaction_id != position + 1:
            raise ClientError(
                f"feed position {self.position} cannot advance to {transaction_id}: "
                "transactions are processed in order"
            )
        self._position = transaction_id
        if transaction_id > self._floor:
            self._floor = transaction_id


# -- retry queue ------------------------------------------------------------------------------


class RetryQueue(Generic[W]):
    """Failed contexts waiting to be re-executed, released in failure order.

    A plain failure waits for appends to be allowed (the partition mounted); a
    lock failure also waits until the feed position reaches the failing
    transaction id, so the re-execution reads the state that made it fail.
    """

    __slots__ = ("_counter", "_heap", "_immediate")

    def __init__(self) -> None:
        self._immediate: deque[W] = deque()
        self._heap: list[tuple[int, int, W]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._immediate) + len(self._heap)

    def add(self, waiter: W, wait_for: int | None = None) -> None:
        if wait_for is None:
            self._immediate.append(waiter)
        else:
            heapq.heappush(self._heap, (wait_for, next(self._counter), waiter))

    def release(self, position: int, *, appends_allowed: bool) -> list[W]:
        """The waiters that may retry now, oldest first."""
        if not appends_allowed:
            return []
        ready: list[tuple[int, W]] = []
        heap = self._heap
        while heap and heap[0][0] <= position:
            _, order, waiter = heapq.heappop(heap)
            ready.append((order, waiter))
        released = list(self._immediate)
        self._immediate.clear()
        ready.sort(key=lambda item: item[0])
        released.extend(w for _, w in ready)
        return released

    def drain(self) -> list[W]:
        """Everything (the client is closing)."""
        everything = list(self._immediate) + [w for _, _, w in sorted(self._heap)]
        self._immediate.clear()
        self._heap.clear()
        return everything


# -- back pressure -----------------------------------------------------------------------------


class ConcurrencyLimit(Generic[W]):
    """At most ``limit`` transactions in flight; waiters are served first come, first served."""

    __slots__ = ("_waiters", "in_use", "limit")

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ClientError(
                f"max_concurrent_transactions must be an int of at least 1, got {limit!r}"
            )
        self.limit = limit
        self.in_use = 0
        self._waiters: deque[W] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_acquire_free(self) -> bool:
        """Take a free slot if there is one and nobody waits (no waiter needed)."""
        if self.in_use < self.limit and not self._waiters:
            self.in_use += 1
            return True
        return False

    def try_acquire(self, waiter: W) -> bool:
        """True: a slot is taken. False: ``waiter`` is queued; :meth:`release` hands it one."""
        if self.in_use < self.limit and not self._waiters:
            self.in_use += 1
            return True
        self._waiters.append(waiter)
        return False

    def release(self) -> W | None:
        """Give a slot back; returns the waiter that now holds it, if any."""
        if self.in_use <= 0:
            raise ClientError("ConcurrencyLimit.release() without a slot held")
        if self._waiters:
            return self._waiters.popleft()
        self.in_use -= 1
        return None

    def drain(self) -> list[W]:
        """Every queued waiter, withdrawn (the client is closing)."""
        waiters = list(self._waiters)
        self._waiters.clear()
        return waiters

    def cancel(self, waiter: W) -> bool:
        """Withdraw a queued waiter (True if it was queued)."""
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return False
        return True


class RunningSubmissions:
    """The submissions running on a partition, numbered as they start: a flush waits
    until none of those started before it (numbers up to its :attr:`mark`) runs."""

    __slots__ = ("_heap", "_running", "mark")

    def __init__(self) -> None:
        self.mark = 0
        """The number of the latest submission started."""
        self._running: set[int] = set()
        self._heap: list[int] = []

    def __len__(self) -> int:
        return len(self._running)

    def start(self) -> int:
        self.mark += 1
        self._running.add(self.mark)
        heapq.heappush(self._heap, self.mark)
        return self.mark

    def finish(self, number: int) -> None:
        self._running.discard(number)
        heap, running = self._heap, self._running
        while heap and heap[0] not in running:
            heapq.heappop(heap)

    def running_up_to(self, mark: int) -> int:
        """How many submissions numbered up to ``mark`` still run."""
        if not self._heap or self._heap[0] > mark:
            return 0
        return sum(1 for n in self._running if n <= mark)


# -- mount sequencing ----------------------------------------------------------------------------


class MountState(enum.Enum):
    UNASSIGNED = "unassigned"
    """No server serves the partition (as far as the client knows)."""
    UNMOUNTED = "unmounted"
    """A server is known; a mount must be sent (appends blocked)."""
    MOUNTING = "mounting"
    """A MountRequest is out (appends blocked; the feed is monitored)."""
    MOUNTED = "mounted"
    """Appends flow."""
    FAILED = "failed"
    """CLIENT_AHEAD: a configuration error; no more mounts."""


class MountDecision(enum.Enum):
    IGNORE = "ignore"
    """A response to an older mount: drop it."""
    READY = "ready"
    """Fail every pending append, then unblock appends."""
    RETRY = "retry"
    """NOT_READY (or refused): re-read the assignment and mount again later."""
    CLIENT_AHEAD = "client-ahead"
    """Report the configuration error; stop."""


class MountSequencer:
    """The mount / reconnect procedure of one partition (spec: waltz-internals,
    "Detection of Failed Append Requests"): block appends, mount with a new network
    client sequence number, fail what is pending on the mount response, unblock."""

    __slots__ = ("endpoint", "generation", "mount_req_id", "network_seq_num", "state")

    def __init__(self) -> None:
        self.state = MountState.UNASSIGNED
        self.endpoint = ""
        self.generation = -1
        self.mount_req_id: ReqId | None = None
        self.network_seq_num = -1

    @property
    def appends_allowed(self) -> bool:
        return self.state is MountState.MOUNTED

    def on_assignment(self, endpoint: str, generation: int) -> bool:
        """A (re)assignment was read; True when the partition must be (re)mounted."""
        if self.state is MountState.FAILED:
            return False
        if generation < self.generation:
            return False  # an older assignment read late
        if generation == self.generation and endpoint == self.endpoint:
            return self.state is MountState.UNMOUNTED
        self.generation = generation
        self.endpoint = endpoint
        self.mount_req_id = None
        self.state = MountState.UNMOUNTED if endpoint else MountState.UNASSIGNED
        return self.state is MountState.UNMOUNTED

    def begin_mount(self, req_id: ReqId, network_seq_num: int) -> None:
        if self.state not in (MountState.UNMOUNTED, MountState.MOUNTING):
            raise ClientError(f"cannot mount a partition in state {self.state.value}")
        if req_id.generation != self.generation:
            raise ClientError(
                f"mount request of generation {req_id.generation} for an assignment of "
                f"generation {self.generation}"
            )
        self.state = MountState.MOUNTING
        self.mount_req_id = req_id
        self.network_seq_num = network_seq_num

    def on_mount_response(self, req_id: ReqId, status: MountStatus) -> MountDecision:
        if self.state is not MountState.MOUNTING or req_id != self.mount_req_id:
            return MountDecision.IGNORE
        self.mount_req_id = None
        if status is MountStatus.READY:
            self.state = MountState.MOUNTED
            return MountDecision.READY
        if status is MountStatus.CLIENT_AHEAD:
            self.state = MountState.FAILED
            return MountDecision.CLIENT_AHEAD
        self.state = MountState.UNMOUNTED
        return MountDecision.RETRY

    def on_mount_refused(self, req_id: ReqId) -> MountDecision:
        """An ErrorResponse to the mount (partition not here, stale generation)."""
        if self.state is not MountState.MOUNTING or req_id != self.mount_req_id:
            return MountDecision.IGNORE
        self.mount_req_id = None
        self.state = MountState.UNMOUNTED
        return MountDecision.RETRY

    def on_disconnect(self) -> bool:
        """The connection broke; True when the partition must be mounted again."""
        if self.state in (MountState.MOUNTING, MountState.MOUNTED):
            self.state = MountState.UNMOUNTED
            self.mount_req_id = None
            return True
        return self.state is MountState.UNMOUNTED

    def unmount(self) -> None:
        """Remount needed on the same server (e.g. the feed has a gap, apply failed)."""
        if self.state in (MountState.MOUNTING, MountState.MOUNTED):
            self.state = MountState.UNMOUNTED
            self.mount_req_id = None

    def fail(self) -> None:
        """The partition stops for good (a poison transaction): no more mounts."""
        self.state = MountState.FAILED
        self.mount_req_id = None


# -- poison transactions -----------------------------------------------------------------------


class ApplyDecision(enum.Enum):
    RETRY = "retry"
    """Offer the transaction again (after a back-off)."""
    GIVE_UP = "give-up"
    """Retries exhausted: the poison policy decides (stop the partition, or skip it)."""


class ApplyFailures:
    """Consecutive failures of ``apply_transaction`` on one partition.

    A transaction that keeps failing is offered again ``retries`` times, then given
    up; a transaction given up once is given up at once if the feed offers it again
    (a restart from an application high-water mark that was not advanced past it).
    """

    __slots__ = ("_given_up", "failures", "retries", "transaction_id")

    def __init__(self, retries: int) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ClientError(f"apply_retries must be an int >= 0, got {retries!r}")
        self.retries = retries
        self.transaction_id = NO_TRANSACTION
        """The transaction failing now (NO_TRANSACTION: none)."""
        self.failures = 0
        """How many times in a row it failed."""
        self._given_up: set[int] = set()

    def on_failure(self, transaction_id: int) -> ApplyDecision:
        if transaction_id in self._given_up:
            return ApplyDecision.GIVE_UP
        if transaction_id != self.transaction_id:
            self.transaction_id = transaction_id
            self.failures = 0
        self.failures += 1
        if self.failures > self.retries:
            self._given_up.add(transaction_id)
            self.transaction_id = NO_TRANSACTION
            return ApplyDecision.GIVE_UP
        return ApplyDecision.RETRY

    def on_applied(self, transaction_id: int) -> bool:
        """Transactions up to ``transaction_id`` were applied; True when that ended a
        run of failures (the retry back-off starts over)."""
        if self._given_up:
            self._given_up = {t for t in self._given_up if t > transaction_id}
        if self.transaction_id != NO_TRANSACTION and transaction_id >= self.transaction_id:
            self.transaction_id = NO_TRANSACTION
            self.failures = 0
            return True
        return False


# -- transaction data cache ----------------------------------------------------------------------


class TransactionDataCache(Generic[K]):
    """An LRU cache of transaction data bounded by the total bytes it holds."""

    __slots__ = ("_entries", "hits", "max_bytes", "misses", "size")

    def __init__(self, max_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ClientError(f"the data cache size must be an int >= 0 bytes, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.size = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[K, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> bytes | None:
        data = self._entries.get(key)
        if data is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return data

    def put(self, key: K, data: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.size -= len(old)
        if len(data) > self.max_bytes:
            return  # larger than the whole cache: never cached
        self._entries[key] = data
        self.size += len(data)
        entries = self._entries
        while self.size > self.max_bytes:
            _, evicted = entries.popitem(last=False)
            self.size -= len(evicted)

    def clear(self) -> None:
        self._entries.clear()
        self.size = 0
