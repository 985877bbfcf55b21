"""The cluster manager: server membership, leadership and the partition assignment.

(Above 800 lines on purpose: one class driving one coordination session, whose
registration, watches, leadership and events share its epoch and are read together; the
pure parts are modules of their own: the assignment rule, leadership decisions, the
events, the preferred partitions.)

Every server runs one :class:`ClusterManager`. It

- registers the server (an ephemeral ``/servers/<id>`` entry carrying its
  endpoint and preferred partitions; a fresh id at every registration, so a
  server that comes back is a new member and its old partitions have moved);
- watches the operators' preferred partition overrides
  (:mod:`waltz_server.server.preferred`, per endpoint, persistent): an override
  replaces the preferences a server registered, and a change makes the leader
  recompute the assignment;
- watches the other servers (optional ``peers``, a
  :class:`~waltz_server.server.peers.PeerMonitor`: pings over the transport): a
  server silent for ``peer_suspect_after`` is suspected, gets no partition and
  loses what it holds, long before its coordination session would expire;
- watches the live servers and the leader record (``/assignment/leader``, changed
  only by CAS; :func:`~waltz_server.server.liveness.decide_leadership` says when to
  claim it or take it over from a holder that is gone, or suspected and silent);
  the leader computes the assignment (:func:`compute_assignment`: preferred
  partitions to the live server preferring them, the rest balanced, as few
  moves as possible) and writes every change with a compare-and-set on the
  partition's assignment (:meth:`ClusterAdmin.assign_partition`), which
  bumps the partition's generation; a partition is written only when it moves;
- watches every partition's assignment and tells its owner what it gained
  (:class:`PartitionGained`, with the generation) and lost
  (:class:`PartitionLost`), in order, through a bounded, coalescing
  :class:`PartitionEvents` (:attr:`ClusterManager.events`: at most two pending
  events per partition, however fast the assignment churns) or an async
  callback (``on_event``). The events are in :mod:`.partition_events`, the
  assignment rule (pure) in :mod:`.assignment`.

Session-state rules (:class:`waltz_api.contracts.coordination.SessionState`):

- SUSPENDED: the leader makes no assignment, and no partition is gained
  (a gain is deferred until the session is CONNECTED again and the
  assignment re-read). Losses are always delivered.
- LOST: every held partition is lost at once (the events are queued in the
  session listener itself, before anything else runs), the watches stop, the
  client is closed, and the manager registers again with a new client
  (retried with back-off until it succeeds or the manager stops).

Two servers may briefly both believe they hold a partition (the old owner
has not yet seen the move, or was wrongly suspected); the generation settles it:
the new owner's store session carries the newer generation and storage nodes fence
the old one. Two servers may briefly both believe they lead; every assignment write
is a CAS, so neither overwrites the other unseen. Suspicion is never a safety
decision (docs/cluster-manager.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
from collections.abc import Callable, Sequence

from waltz_api.backoff import Backoff
from waltz_api.cluster import NO_SERVER, LeaderRecord, PartitionAssignment, Stored
from waltz_api.contracts.coordination import Coordination, SessionState, Watch
from waltz_api.errors import (
    BadVersionError,
    ConfigError,
    CoordinationUnavailableError,
    SessionLostError,
    WaltzError,
)
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.observability import ServerMetrics
from waltz_server.server.assignment import compute_assignment
from waltz_server.server.liveness import Leadership, decide_leadership
from waltz_server.server.partition_events import (
    EventHandler,
    LossReason,
    PartitionEvent,
    PartitionEvents,
    PartitionGained,
    PartitionLost,
)
from waltz_server.server.peers import PeerMonitor
from waltz_server.server.preferred import Overrides, PreferredPartitionStore, apply_overrides

log = logging.getLogger(__name__)


CoordinationFactory = Callable[[], Coordination]

LEADER_RENEWALS = "leader-record"
"""The peer monitor's key for the leader record's changes (renewals, takeovers)."""

__all__ = [
    "LEADER_RENEWALS",
    "ClusterManager",
    "CoordinationFactory",
    "EventHandler",
    "LossReason",
    "PartitionEvent",
    "PartitionEvents",
    "PartitionGained",
    "PartitionLost",
    "compute_assignment",
]


# -- the manager ----------------------------------------------------------------------------------


LIVE_RETRY_MAX = 1.0
"""Seconds at most between the leader's attempts to rebalance (and between reads of the
servers' endpoints) while they fail: a partition's move waits on them, so they stay
short whatever ``max_retry_delay`` says."""


class ClusterManager:
    """One server's membership and partition ownership (see the module docstring).

    ``coordination_factory`` makes a new, not yet started, coordination client
    (one per registration: a LOST client is final). ``endpoint`` is where
    clients reach this server; it is written into the partitions it owns.

    Use::

        manager = ClusterManager(lambda: coordination_from_uri(uri), "tcp://10.0.0.5:5600")
        await manager.start()
        event = await manager.events.get()   # or ClusterManager(..., on_event=handler)
        ...
        await manager.stop()                 # loses (and reports) everything it holds
    """

    def __init__(
        self,
        coordination_factory: CoordinationFactory,
        endpoint: str,
        *,
        preferred_partitions: Sequence[int] = (),
        on_event: EventHandler | None = None,
        retry_delay: float = 0.2,
        max_retry_delay: float = 5.0,
        settle_delay: float = 0.02,
        on_leader_write: Callable[[PartitionAssignment], None] | None = None,
        metrics: ServerMetrics | None = None,
        peers: PeerMonitor | None = None,
        rng: random.Random | None = None,
        start_timeout: float = 30.0,
    ) -> None:
        if not endpoint.strip():
            raise ConfigError("a server needs an endpoint clients can reach", key="endpoint")
        bad = [p for p in preferred_partitions if isinstance(p, bool) or p < 0]
        if bad:
            raise ConfigError(
                f"preferred partitions must be non-negative partition ids, got {bad}",
                key="preferred_partitions",
            )
        self._factory = coordination_factory
        self.endpoint = endpoint
        self.preferred_partitions = tuple(sorted(set(preferred_partitions)))
        self._on_event = on_event
        self._on_leader_write = on_leader_write
        self._metrics = metrics
        self._peers = peers
        if peers is not None:
            peers.on_change = self._rebalance_soon
        self._retry_delay = retry_delay
        self._max_retry_delay = max_retry_delay
        self._settle_delay = settle_delay
        self._rng = rng or random.Random()
        """The jitter of every retry's back-off (inject a seeded one to replay a run)."""
        self._start_timeout = start_timeout
        """How long ``start`` retries a coordination service that went away mid-way."""
        self.events = PartitionEvents()
        """Gains and losses in order (unless ``on_event`` consumes them), coalesced: at
        most two pending events per partition, however fast the assignment changes."""

        self._client: Coordination | None = None
        self._meta: ClusterAdmin | None = None
        self._num_partitions = 0
        self._server_id = NO_SERVER
        self._epoch = 0
        self._registered = False
        self._leader = False
        self._owned: dict[int, int] = {}
        self._seen: dict[int, PartitionAssignment] = {}
        self._live_ids: list[int] = []
        self._endpoints: dict[int, str] = {}
        self._leader_record: Stored[LeaderRecord] | None = None
        self._last_renewal = 0.0
        self._watches: list[Watch] = []
        self._rebalance = asyncio.Event()
        self._leader_task: asyncio.Task[None] | None = None
        self._dispatch_task: asyncio.Task[None] | None = None
        self._reregister_task: asyncio.Task[None] | None = None
        self._resync_task: asyncio.Task[None] | None = None
        self._peers_task: asyncio.Task[None] | None = None
        self._renew_task: asyncio.Task[None] | None = None
        self._peers_changed = asyncio.Event()
        self._started = False
        self._stopped = False
        self.registrations = 0
        """How many times this manager registered (1 + the sessions it lost and replaced)."""

    # -- state --------------------------

    @property
    def server_id(self) -> int:
        """This server's current id (:data:`NO_SERVER` while not registered)."""
        return self._server_id

    @property
    def coordination(self) -> Coordination | None:
        """The current coordination client (replaced after a LOST session)."""
        return self._client

    @property
    def metadata(self) -> ClusterAdmin | None:
        return self._meta

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    @property
    def owned(self) -> dict[int, int]:
        """The partitions this server holds now: partition id -> generation."""
        return dict(self._owned)

    @property
    def is_leader(self) -> bool:
        """Whether this server leads: it last confirmed so by a fresh read of the leader
        record, and its session is connected (a suspended leader makes no assignment)."""
        return self._leader and self._registered and self._connected()

    @property
    def leader_id(self) -> int:
        """The server the leader record names, as last seen (:data:`NO_SERVER` if none)."""
        record = self._leader_record
        return NO_SERVER if record is None else record.value.server_id

    @property
    def suspects(self) -> frozenset[int]:
        """The registered servers this one suspects now (no assignment goes to them)."""
        if self._peers is None:
            return frozenset()
        return self._peers.suspects & frozenset(self._live_ids)

    @property
    def registered(self) -> bool:
        return self._registered

    def _connected(self) -> bool:
        return self._client is not None and self._client.session_state is SessionState.CONNECTED

    # -- lifecycle --------------------------

    async def start(self) -> None:
        """Connect, register and start following the assignment.

        Raises ClusterNotFoundError when there is no cluster, ConfigError when a
        preferred partition does not exist, CoordinationUnavailableError when the
        service cannot be reached. A service that is lost while registering (it
        restarts: ConnectionLoss, a lost session) is retried with back-off for up to
        ``start_timeout`` seconds first."""
        if self._started:
            return
        self._started = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._start_timeout
        backoff = self._backoff()
        try:
            while True:
                try:
                    await self._register()
                    break
                except (CoordinationUnavailableError, SessionLostError) as exc:
                    delay = backoff.next_delay()
                    if loop.time() + delay > deadline:
                        raise
                    log.warning("registering failed (%s); retrying in %.1fs", exc, delay)
                    await asyncio.sleep(delay)
        except BaseException:
            self._started = False
            raise
        if self._on_event is not None:
            self._dispatch_task = asyncio.create_task(self._dispatch(), name="cluster-events")
        self._leader_task = asyncio.create_task(self._lead(), name="cluster-leader")
        if self._peers is not None:
            await self._peers.start()
            self._peers_task = asyncio.create_task(self._follow_peers(), name="cluster-peers")
            self._renew_task = asyncio.create_task(self._renew(), name="cluster-renew")

    async def stop(self, *, drain_timeout: float = 10.0) -> None:
        """Unregister and stop. Every held partition is reported lost (STOPPED);
        with ``on_event`` the handler gets those events before this returns
        (within ``drain_timeout`` seconds)."""
        if self._stopped:
            return
        self._stopped = True
        self._registered = False
        self._leader = False
        self._cancel_watches()
        self._drop_all(LossReason.STOPPED)
        tasks = [
            t
            for t in (
                self._leader_task,
                self._reregister_task,
                self._resync_task,
                self._peers_task,
                self._renew_task,
            )
            if t is not None
        ]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._peers is not None:
            await self._peers.close()
        if self._dispatch_task is not None:
            self.events.close()
            try:
                await asyncio.wait_for(asyncio.shield(self._dispatch_task), drain_timeout)
            except (TimeoutError, asyncio.CancelledError):
                self._dispatch_task.cancel()
                with contextlib.suppress(BaseException):
                    await self._dispatch_task
        await self._close_client()
        self._server_id = NO_SERVER

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except WaltzError as exc:
                log.debug("closing the coordination client: %s", exc)

    # -- registration --------------------------

    async def _register(self) -> None:
        client = self._factory()
        await client.start()
        try:
            meta = ClusterAdmin(client)
            config = await meta.config()
            missing = [p for p in self.preferred_partitions if p >= config.num_partitions]
            if missing:
                raise ConfigError(
                    f"preferred partitions {missing} do not exist: the cluster has "
                    f"{config.num_partitions} partitions (0..{config.num_partitions - 1})",
                    key="preferred_partitions",
                )
            server_id = await meta.allocate_server_id()
            self._epoch += 1
            epoch = self._epoch
            self._client, self._meta = client, meta
            self._num_partitions = config.num_partitions
            self._server_id = server_id
            self._owned.clear()
            self._seen.clear()
            self._live_ids = []
            self._endpoints = {}
            self._leader_record = None
            client.add_session_listener(lambda state: self._on_session_state(epoch, state))
            await meta.register_server(
                server_id, self.endpoint, preferred_partitions=self.preferred_partitions
            )
            if self._peers is not None:
                self._peers.set_identity(server_id)
                self._peers.track(LEADER_RENEWALS)
            self._watches.append(
                await meta.watch_leader(lambda record: self._on_leader_record(epoch, record))
            )
            self._watches.append(
                await meta.watch_server_ids(lambda ids: self._on_server_ids(epoch, ids))
            )
            self._watches.append(
                await PreferredPartitionStore(client).watch(
                    lambda overrides: self._on_overrides(epoch, overrides)
                )
            )
            for partition in range(config.num_partitions):
                self._watches.append(
                    await meta.watch_partition_assignment(
                        partition, functools.partial(self._on_assignment, epoch, partition)
                    )
                )
            if client.session_state is SessionState.LOST:
                raise SessionLostError("the coordination session was lost while registering")
        except BaseException:
            self._cancel_watches()
            if self._client is client:
                self._client = self._meta = None
                self._server_id = NO_SERVER
            self._epoch += 1  # callbacks of this attempt are void
            with contextlib.suppress(WaltzError):
                await client.close()
            raise
        self._registered = True
        self.registrations += 1
        log.info(
            "server %d registered at %s (%d partitions, preferred %s)",
            server_id,
            self.endpoint,
            config.num_partitions,
            list(self.preferred_partitions) or "none",
        )
        for partition in range(config.num_partitions):
            self._reconcile(partition)
        self._peers_changed.set()  # the ids arrived before the registration completed
        self._rebalance.set()

    def _backoff(self, maximum: float | None = None) -> Backoff:
        """The back-off of one retry loop: from ``retry_delay`` doubling to ``maximum``
        (default ``max_retry_delay``), with jitter."""
        top = self._max_retry_delay if maximum is None else maximum
        return Backoff(self._retry_delay, max(top, self._retry_delay), self._rng)

    async def _reregister(self) -> None:
        await self._close_client()
        backoff = self._backoff()
        while not self._stopped:
            try:
                await self._register()
                return
            except asyncio.CancelledError:
                raise
            except WaltzError as exc:
                delay = backoff.next_delay()
                log.warning("re-registering failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)

    def _cancel_watches(self) -> None:
        watches, self._watches = self._watches, []
        for watch in watches:
            watch.cancel()

    # -- notifications (on the event loop) ------------------------------------------------------

    def _on_session_state(self, epoch: int, state: SessionState) -> None:
        if epoch != self._epoch or self._stopped:
            return
        if state is SessionState.SUSPENDED:
            log.warning(
                "server %d: coordination suspended; no assignment and no new partition until "
                "it reconnects",
                self._server_id,
            )
            self._leader = False
        elif state is SessionState.CONNECTED:
            log.info(
                "server %d: coordination reconnected; re-reading the assignment", self._server_id
            )
            # One re-read at a time: a flapping connection restarts it, never piles them up.
            if self._resync_task is not None:
                self._resync_task.cancel()
            self._resync_task = asyncio.create_task(self._resync(epoch), name="cluster-resync")
        elif state is SessionState.LOST:
            self._on_lost()

    def _on_lost(self) -> None:
        registered = self._registered
        log.warning(
            "server %d: coordination session lost; dropping %d partitions and registering again",
            self._server_id,
            len(self._owned),
        )
        self._epoch += 1
        self._registered = False
        self._leader = False
        self._cancel_watches()
        self._drop_all(LossReason.SESSION_LOST)
        self._server_id = NO_SERVER
        self._leader_record = None
        if self._peers is not None:
            self._peers.set_peers({})
            self._peers.set_identity(NO_SERVER)
        running = self._reregister_task is not None and not self._reregister_task.done()
        if registered and not running and not self._stopped:
            self._reregister_task = asyncio.create_task(
                self._reregister(), name="cluster-reregister"
            )

    def _on_server_ids(self, epoch: int, ids: list[int]) -> None:
        if epoch != self._epoch:
            return
        self._live_ids = ids
        if self._server_id != NO_SERVER and self._server_id not in ids and self._registered:
            # The registration went before the client learned its session ended (an etcd
            # lease revoked, an entry deleted by hand): whatever rested on it is gone.
            log.warning("server %d: its registration is gone", self._server_id)
            self._on_lost()
            return
        self._peers_changed.set()
        self._rebalance.set()

    def _on_leader_record(self, epoch: int, record: Stored[LeaderRecord] | None) -> None:
        if epoch != self._epoch or record is None:
            return
        if self._note_leader_record(record):
            self._rebalance.set()

    def _note_leader_record(self, record: Stored[LeaderRecord]) -> bool:
        """Keep the newest leader record seen (versions only grow: the record is never
        deleted); a change is a sign of life of its holder. True when it changed."""
        seen = self._leader_record
        if seen is not None and record.version <= seen.version:
            return False
        self._leader_record = record
        if self._peers is not None:
            self._peers.heard(LEADER_RENEWALS)
        if seen is None or seen.value.server_id != record.value.server_id:
            log.info(
                "server %d: server %d leads (term %d)",
                self._server_id,
                record.value.server_id,
                record.value.term,
            )
        return True

    def _rebalance_soon(self) -> None:
        """A peer's suspicion changed (or the leader record went silent): decide again."""
        if not self._stopped:
            self._rebalance.set()

    async def _follow_peers(self) -> None:
        """Keep the peer monitor on the registered servers (their endpoints read once)."""
        assert self._peers is not None
        backoff = self._backoff(LIVE_RETRY_MAX)
        while not self._stopped:
            await self._peers_changed.wait()
            self._peers_changed.clear()
            meta, epoch = self._meta, self._epoch
            if meta is None or not self._registered:
                continue
            live = set(self._live_ids)
            missing = live - set(self._endpoints) - {self._server_id}
            if missing:
                try:
                    servers = await meta.servers()
                except asyncio.CancelledError:
                    raise
                except WaltzError as exc:
                    log.info("reading the servers' endpoints failed (%s); retrying", exc)
                    await backoff.sleep()
                    self._peers_changed.set()
                    continue
                backoff.reset()
                if epoch != self._epoch:
                    continue
                for server in servers:
                    self._endpoints[server.server_id] = server.endpoint
            live = set(self._live_ids)
            self._endpoints = {i: e for i, e in self._endpoints.items() if i in live}
            self._peers.set_peers(
                {i: e for i, e in self._endpoints.items() if i != self._server_id}
            )

    async def _renew(self) -> None:
        """While this server leads and suspects a registered server, renew the leader
        record (a CAS) every ``renew_interval``: its renewals tell the suspected server
        (cut off from this one, but not from the coordination service) that the leader
        is alive, so it does not take the leadership over."""
        assert self._peers is not None
        interval = self._peers.config.renew_interval
        loop = asyncio.get_running_loop()
        while not self._stopped:
            await asyncio.sleep(interval / 2)
            record, meta = self._leader_record, self._meta
            if (
                not self.is_leader
                or not self.suspects
                or record is None
                or meta is None
                or record.value.server_id != self._server_id
                or loop.time() - self._last_renewal < interval
            ):
                continue
            renewed = LeaderRecord(self._server_id, record.value.term, record.value.renewals + 1)
            try:
                stored = await meta.set_leader(renewed, expected_version=record.version)
            except asyncio.CancelledError:
                raise
            except BadVersionError:
                log.info("server %d: the leader record changed; deciding again", self._server_id)
                self._leader = False
                self._rebalance.set()
                continue
            except WaltzError as exc:
                log.info("server %d: renewing the leader record failed: %s", self._server_id, exc)
                continue
            self._last_renewal = loop.time()
            self._note_leader_record(stored)

    def _on_overrides(self, epoch: int, overrides: Overrides) -> None:
        if epoch != self._epoch:
            return
        log.info(
            "server %d: preferred partition overrides now %s",
            self._server_id,
            dict(overrides) or "none",
        )
        self._rebalance.set()  # the leader re-reads them

    def _on_assignment(self, epoch: int, partition: int, value: PartitionAssignment | None) -> None:
        if epoch != self._epoch or value is None:
            return
        self._observe(partition, value)
        self._reconcile(partition)
        self._rebalance.set()

    def _observe(self, partition: int, value: PartitionAssignment) -> None:
        seen = self._seen.get(partition)
        # Generations only grow (each write bumps it): a lower one is an older read.
        if seen is None or value.generation >= seen.generation:
            self._seen[partition] = value

    def _reconcile(self, partition: int) -> None:
        """Bring what this server holds of ``partition`` in line with the last seen assignment."""
        if not self._registered or self._stopped:
            return
        seen = self._seen.get(partition)
        if seen is None:
            return
        mine = seen.server_id == self._server_id
        held = self._owned.get(partition)
        if held is not None and (not mine or seen.generation != held):
            del self._owned[partition]
            self._emit(PartitionLost(partition, held, self._server_id, LossReason.MOVED))
        if mine and partition not in self._owned and self._connected():
            self._owned[partition] = seen.generation
            self._emit(PartitionGained(partition, seen.generation, self._server_id))

    async def _resync(self, epoch: int) -> None:
        """After a reconnection: re-read every assignment (a fresh read), then reconcile.

        A read that fails (the connection may drop again) is retried with back-off while
        this registration lives and the session is connected; the leader is asked to
        decide again in any case (it reads everything afresh itself)."""
        meta = self._meta
        if meta is None:
            return
        backoff = self._backoff()
        try:
            partition = 0
            while partition < self._num_partitions:
                if epoch != self._epoch or self._stopped or not self._connected():
                    return
                try:
                    found = await meta.partition_assignment(partition)
                except WaltzError as exc:
                    log.info("re-reading the assignment failed (%s); retrying", exc)
                    await backoff.sleep()
                    continue
                if epoch != self._epoch:
                    return
                self._observe(partition, found.value)
                self._reconcile(partition)
                partition += 1
        finally:
            if epoch == self._epoch:
                self._rebalance.set()

    def _drop_all(self, reason: LossReason) -> None:
        owned, self._owned = self._owned, {}
        for partition, generation in sorted(owned.items()):
            self._emit(PartitionLost(partition, generation, self._server_id, reason))
        self._seen.clear()
        self._live_ids = []

    def _emit(self, event: PartitionEvent) -> None:
        log.info("server %d: %s", event.server_id, event)
        if self._metrics is not None:
            self._metrics.partitions_owned.set(len(self._owned))
        self.events.put(event)

    async def _dispatch(self) -> None:
        handler = self._on_event
        if handler is None:
            return
        while True:
            event = await self.events.next_or_none()
            if event is None:
                return
            try:
                await handler(event)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the partition event handler failed on %s", event)

    # -- leadership --------------------------

    async def _lead_or_follow(self, meta: ClusterAdmin, my_id: int) -> bool:
        """Whether this server leads now (claiming or taking the leader record over when
        :func:`~waltz_server.server.liveness.decide_leadership` says so). A lost CAS
        raises BadVersionError after re-reading the record: the caller decides again."""
        record = self._leader_record
        silent = self._peers is None or self._peers.is_suspected(LEADER_RENEWALS)
        action = decide_leadership(
            my_id,
            self._live_ids,
            self.suspects,
            None if record is None else record.value.server_id,
            silent,
        )
        if action is Leadership.FOLLOW:
            return False
        try:
            if action is Leadership.CLAIM:
                self._note_leader_record(await meta.claim_leadership(my_id))
                return True
            if action is Leadership.TAKE_OVER:
                assert record is not None
                holder = record.value.server_id
                taken = await meta.set_leader(
                    LeaderRecord(my_id, record.value.term + 1), expected_version=record.version
                )
                log.warning(
                    "server %d takes the leadership over from server %d (%s), term %d",
                    my_id,
                    holder,
                    "suspected" if holder in self._live_ids else "gone",
                    taken.value.term,
                )
                self._note_leader_record(taken)
                return True
        except BadVersionError:
            fresh = await meta.leader()
            if fresh is not None:
                self._note_leader_record(fresh)
            raise
        fresh = await meta.leader()  # LEAD: confirm with a fresh read (the watch may lag)
        if fresh is not None:
            self._note_leader_record(fresh)
        return fresh is not None and fresh.value.server_id == my_id

    async def _lead(self) -> None:
        backoff = self._backoff(LIVE_RETRY_MAX)
        while not self._stopped:
            await self._rebalance.wait()
            self._rebalance.clear()
            await asyncio.sleep(self._settle_delay)  # let a burst of changes arrive
            try:
                await self._rebalance_once()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except BadVersionError as exc:
                log.info("assignment changed under the leader (%s); deciding again", exc)
                self._rebalance.set()
            except SessionLostError:
                self._leader = False
            except WaltzError as exc:
                delay = backoff.next_delay()
                log.warning("rebalancing failed (%s); retrying in %.1fs", exc, delay)
                self._leader = False
                await asyncio.sleep(delay)
                self._rebalance.set()

    async def _rebalance_once(self) -> None:
        meta, my_id, epoch = self._meta, self._server_id, self._epoch
        if meta is None or not self._registered or not self._connected():
            self._leader = False
            return
        if not await self._lead_or_follow(meta, my_id):
            self._leader = False
            return
        suspects = self.suspects
        servers = await meta.servers()  # a fresh read: the watch may lag
        if my_id not in {s.server_id for s in servers}:
            self._leader = False
            return
        if not self._leader:
            log.info("server %d leads the cluster (%d live servers)", my_id, len(servers))
        self._leader = True
        # A suspected server gets nothing (and loses what it holds); it is live again as
        # soon as it answers (the peer monitor then asks for a new decision).
        if suspects:
            log.info(
                "server %d: assigning without the suspected servers %s", my_id, sorted(suspects)
            )
        servers = [s for s in servers if s.server_id not in suspects]
        # The operators' overrides replace the registered (config) preferences per endpoint.
        overrides = await PreferredPartitionStore(meta.coordination).read()
        servers = apply_overrides(servers, overrides.endpoints)
        current: dict[int, Stored[PartitionAssignment]] = {}
        for partition in range(self._num_partitions):
            current[partition] = await meta.partition_assignment(partition)
        target = compute_assignment(
            self._num_partitions, servers, {p: s.value.server_id for p, s in current.items()}
        )
        endpoints = {s.server_id: s.endpoint for s in servers}
        moves = [p for p in sorted(target) if target[p] != current[p].value.server_id]
        for partition in moves:
            if epoch != self._epoch or not self._connected() or self._stopped:
                self._leader = False
                log.info("server %d: session not connected; assignment paused", my_id)
                return
            owner = target[partition]
            stored = await meta.assign_partition(
                partition, owner, endpoints[owner], expected_version=current[partition].version
            )
            log.info(
                "partition %d: server %d -> %d, generation %d",
                partition,
                current[partition].value.server_id,
                owner,
                stored.value.generation,
            )
            if self._metrics is not None:
                self._metrics.assignment_changes.inc()
            if self._on_leader_write is not None:
                self._on_leader_write(stored.value)
