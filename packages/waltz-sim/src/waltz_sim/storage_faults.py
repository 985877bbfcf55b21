"""Storage faults: what a disk does to records it acknowledged (the ``storage`` profile).

The fault model follows "Protocol-Aware Recovery for Consensus-Based Distributed
Storage" (Alagappan et al., FAST '18: CTRL) and TigerBeetle's storage fault injection:
per replica, a disk may lose an acknowledged write, change a stored record, fail a
read, put a record at the wrong place, tear the last write on a power loss (the
``power_loss`` fault), come back empty, or come back from an older snapshot of itself.

Each fault damages one storage node's :class:`~waltz_sim.disk.SimDisk` the way the
``fs`` engine would meet the damage (:mod:`waltz_sim.disk`: reads raise
CorruptionError naming a corrupt record or StorageError for an EIO; a start-up
recovery turns damaged records into a missing range, a LOST_SESSION tail, or a silent
cut where zeros look like a torn write). What is found on read lasts until the node
restarts (the fault's heal: an operator's restart, which scrubs the log).

The nemesis' rule holds: a damaged disk counts as impaired from the fault until the
cluster repaired it (:attr:`~waltz_sim.disk.SimDisk.must_reach`), so at most a
minority of the storage nodes is impaired at once, and the guarantee applies: no
acknowledged transaction is lost while a majority runs and every committed record has
an intact copy among them.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Any

from waltz_api.types import SessionInfo
from waltz_sim.damage import CHECKSUM, HOLDS, STALE, ZEROS
from waltz_sim.disk import PartitionImage, SimDisk
from waltz_sim.fault_kit import ActiveFault, restart
from waltz_sim.loop import WORLD_CONTEXT
from waltz_sim.profiles import STORAGE_WEIGHTS

if TYPE_CHECKING:
    from waltz_sim.world import SimProcess, World

BACKUP_AGE = 1.0
"""A stale restore uses a snapshot at least this many seconds old."""
MAX_LAG = 3.0
"""A damaged rejoin's lagging replica stalls until the owner's crash, or this many seconds
after the damaged replica is back."""
SLOW_INTACT_FOR = 8.0
"""Seconds the intact replicas stay slow after a damaged rejoin's owner crash (the next
owner's recovery starts within a session timeout or two)."""


# -- damage to a disk -------------------------------------------------------------------------


def _acknowledged(image: PartitionImage) -> int:
    """How many records of ``image`` are durable and were shown (acknowledged)."""
    return min(image.common, image.visible)


def _partition_with(
    disk: SimDisk, rng: random.Random, records: int
) -> tuple[int, PartitionImage] | None:
    candidates = [
        (p, image)
        for p, image in sorted(disk.partitions.items())
        if _acknowledged(image) >= records
    ]
    return rng.choice(candidates) if candidates else None


def _mark(image: PartitionImage, first: int, last: int, how: str) -> None:
    for i in range(first, last + 1):
        image.corrupt[i] = how


def lose_writes(disk: SimDisk, rng: random.Random) -> str | None:
    """Acknowledged writes that never reached the disk (it lied about the fdatasync): the
    last ones (zeros: the log silently shorter after a restart), or some in the middle
    (zeros: cut silently from there, as a torn write; or older bytes of something else:
    a missing range). Returns what, or None when no partition has records enough."""
    choice = _partition_with(disk, rng, 4)
    if choice is None:
        return None
    partition, image = choice
    end = _acknowledged(image)
    disk.damaged(partition)
    roll = rng.random()
    if roll < 0.4:
        first, last, how = end - rng.randint(1, min(4, end - 1)), end - 1, ZEROS
    else:
        first = rng.randrange(0, end - 2)
        last = min(first + rng.randint(0, 2), end - 2)
        how = ZEROS if roll < 0.7 else STALE
    _mark(image, first, last, how)
    where = "zeros" if how == ZEROS else "older bytes of something else"
    return f"partition {partition}: acknowledged transactions {first}..{last} lost ({where})"


def corrupt_at_rest(disk: SimDisk, rng: random.Random) -> str | None:
    """Stored records change (their checksums fail): the newest ones, or some in the middle."""
    choice = _partition_with(disk, rng, 3)
    if choice is None:
        return None
    partition, image = choice
    end = _acknowledged(image)
    disk.damaged(partition)
    if rng.random() < 0.5:
        first, last = end - rng.randint(1, min(3, end - 1)), end - 1
    else:
        first = rng.randrange(0, end - 1)
        last = min(first + rng.randint(0, 2), end - 1)
    _mark(image, first, last, CHECKSUM)
    return f"partition {partition}: transactions {first}..{last} corrupt"


def misdirect(disk: SimDisk, rng: random.Random) -> str | None:
    """The newest write landed on an older record: that one now holds it, and its own
    place reads back as zeros."""
    choice = _partition_with(disk, rng, 3)
    if choice is None:
        return None
    partition, image = choice
    newest = _acknowledged(image) - 1
    victim = rng.randrange(0, newest)
    disk.damaged(partition)
    image.corrupt[victim] = f"{HOLDS}{newest}"
    image.corrupt[newest] = ZEROS
    return f"partition {partition}: transaction {newest} written over transaction {victim}"


def lose_tail(disk: SimDisk, rng: random.Random, how: str) -> str | None:
    """The newest acknowledged records of a partition are damaged (``CHECKSUM``: a
    damaged tail, LOST_SESSION at the restart) or were never written (``ZEROS``: the
    log silently shorter)."""
    choice = _partition_with(disk, rng, 4)
    if choice is None:
        return None
    partition, image = choice
    end = _acknowledged(image)
    disk.damaged(partition)
    first = end - rng.randint(1, min(4, end - 1))
    _mark(image, first, end - 1, how)
    what = "damaged" if how == CHECKSUM else "never written (zeros)"
    return f"partition {partition}: its last acknowledged transactions {first}..{end - 1} {what}"


def unreadable_range(disk: SimDisk, rng: random.Random) -> str | None:
    """Reads of a range of records fail with EIO (a latent sector error)."""
    choice = _partition_with(disk, rng, 2)
    if choice is None:
        return None
    partition, image = choice
    end = image.visible
    first = rng.randrange(0, end)
    last = min(first + rng.randint(0, 4), end - 1)
    image.unreadable.append((first, last))
    return f"partition {partition}: reads of transactions {first}..{last} fail (EIO)"


# -- the nemesis' faults ----------------------------------------------------------------------


class StorageFaults:
    """The storage faults of :class:`~waltz_sim.faults.Nemesis` (mixed into it)."""

    world: World
    rng: random.Random
    active: dict[ActiveFault, None]

    if TYPE_CHECKING:

        def _pick(self, kinds: tuple[str, ...], *, running: bool = True) -> SimProcess | None: ...

        def _allowed(self, impairs: set[str]) -> bool: ...

        def _restartable(self, process: SimProcess, description: str, kind: str) -> ActiveFault: ...

        def _record(self, fault: ActiveFault, duration: float) -> None: ...

    def _sim_disk(self, process: SimProcess | None) -> SimDisk | None:
        """The disk model of ``process`` (storage faults act on the ``sim`` engine's disks;
        a node on the real fs engine's simulated files has none)."""
        return None if process is None else _sim_disk_of(self.world, process)

    def _lost_records(self) -> list[str]:
        """The storage nodes whose disk lost records to a storage fault, not repaired yet,
        or is about to (a damaged rejoin's damage to come)."""
        coming = {
            script.damaged.name
            for fault in self.active
            if isinstance(script := fault.script, _DamagedRejoin) and script.pending
        }
        return [
            p.name
            for p in self.world.of_kind("storage")
            if p.name in coming or ((disk := self._sim_disk(p)) is not None and disk.lost_records)
        ]

    def _keep_backups(self) -> None:
        """Each storage disk's snapshot, for a later stale restore."""
        now = self.world.loop.time()
        for process in self.world.of_kind("storage"):
            disk = self._sim_disk(process)
            if disk is not None and process.alive:
                disk.backup(now)

    def _storage_target(self, records: int) -> tuple[SimProcess, SimDisk] | None:
        """A running storage node the rules allow to impair, whose disk has a partition
        with ``records`` acknowledged records."""
        process = self._pick(("storage",))
        if process is None:
            return None
        disk = self._sim_disk(process)
        if disk is None or not any(
            _acknowledged(image) >= records for image in disk.partitions.values()
        ):
            return None
        return process, disk

    def _down_for(
        self, kind: str, process: SimProcess, description: str, restart_after: float
    ) -> ActiveFault:
        """The node is down; it starts again after ``restart_after``."""
        return ActiveFault(
            kind,
            f"{description}; restarted in {restart_after:.1f}s",
            lambda: None if process.alive else restart([process]),
            frozenset({process.name}),
            duration=restart_after,
        )

    def _restarted_after(
        self, kind: str, process: SimProcess, description: str, after: float
    ) -> ActiveFault:
        """The node runs on with the damage (found on read) until it is restarted after
        ``after`` (an operator's restart: its start-up recovery scrubs the log)."""

        def heal() -> None:
            if process.alive:  # running or paused (a dead one finds the damage at its start)
                process.crash()
                process.start()

        return ActiveFault(
            kind,
            f"{description}; found on read until a restart in {after:.1f}s",
            heal,
            frozenset({process.name}),
            duration=after,
        )

    def _inject_lost_write(self, duration: float) -> ActiveFault | None:
        target = self._storage_target(4)
        if target is None:
            return None
        process, disk = target
        process.crash(power_loss=True)
        found = lose_writes(disk, self.rng) or "nothing left to lose"
        return self._down_for(
            "lost_write",
            process,
            f"power loss of {process.name}, its disk lost writes it had acknowledged: {found}",
            min(duration, 3.0),
        )

    def _inject_corruption(self, duration: float) -> ActiveFault | None:
        target = self._storage_target(3)
        if target is None:
            return None
        process, disk = target
        if self.rng.random() < 0.5:
            found = corrupt_at_rest(disk, self.rng)
            return self._restarted_after(
                "corruption", process, f"corruption on {process.name}: {found}", min(duration, 4.0)
            )
        process.crash()
        found = corrupt_at_rest(disk, self.rng)
        return self._down_for(
            "corruption",
            process,
            f"crash {process.name}, corruption on its disk found at its restart: {found}",
            min(duration, 3.0),
        )

    def _inject_misdirected_write(self, duration: float) -> ActiveFault | None:
        target = self._storage_target(3)
        if target is None:
            return None
        process, disk = target
        found = misdirect(disk, self.rng)
        return self._restarted_after(
            "misdirected_write",
            process,
            f"misdirected write on {process.name}: {found}",
            min(duration, 4.0),
        )

    def _inject_read_error(self, duration: float) -> ActiveFault | None:
        target = self._storage_target(2)
        if target is None:
            return None
        process, disk = target
        found = unreadable_range(disk, self.rng)

        def heal() -> None:
            closed = False
            for image in disk.partitions.values():
                image.unreadable = []
                closed = closed or image.closed is not None
            if closed and process.alive:  # a restart meanwhile left the partition closed
                process.crash()
                process.start()

        return ActiveFault(
            "read_error",
            f"read errors on {process.name}: {found} for {duration:.1f}s",
            heal,
            frozenset({process.name}),
        )

    def _inject_wiped_disk(self, duration: float) -> ActiveFault | None:
        target = self._storage_target(1)
        if target is None:
            return None
        process, disk = target
        process.crash()
        disk.wipe()
        description = f"{process.name} comes back with an empty disk"
        return self._down_for("wiped_disk", process, description, min(duration, 3.0))

    def _inject_stale_restore(self, duration: float) -> ActiveFault | None:
        target = self._storage_target(1)
        if target is None:
            return None
        process, disk = target
        now = self.world.loop.time()
        old = [(taken, snapshot) for taken, snapshot in disk.backups if taken <= now - BACKUP_AGE]
        if not old:
            return None
        taken, snapshot = self.rng.choice(old)
        process.crash()
        disk.restore(snapshot)
        return self._down_for(
            "stale_restore",
            process,
            f"{process.name}'s disk restored from its snapshot of {now - taken:.1f}s ago",
            min(duration, 3.0),
        )

    def _inject_damaged_rejoin(self, duration: float) -> ActiveFault | None:
        """The narrow window of a lagging replica, a damaged one and an owner crash: one
        replica lags (its fsyncs stall) while the others acknowledge; one of those comes back
        having lost records it acknowledged (a damaged tail, a silently shorter log, a
        wiped disk, an older snapshot); its store session takes it back, and the
        partition's owner is killed just then, before it caught up."""
        if any(fault.kind == "damaged_rejoin" for fault in self.active):
            return None  # one at a time: two would stall two replicas
        target = self._storage_target(4)
        if target is None:
            return None
        process, disk = target
        others = [p for p in self.world.of_kind("storage") if p is not process and p.alive]
        lagging = self.rng.choice(others) if others else None
        lag_disk = self._sim_disk(lagging) if lagging else None
        if lagging is None or lag_disk is None or lag_disk.stall is not None:
            return None
        script = _DamagedRejoin(self, process, disk, lag_disk)
        build_up = self.rng.uniform(1.5, 4.0)
        script.later(build_up, script.damage)
        script.later(build_up + script.down + MAX_LAG, script.end_lag)
        fault = ActiveFault(
            "damaged_rejoin",
            f"{lagging.name} lags (its fsyncs stall); in {build_up:.1f}s "
            f"{process.name} loses acknowledged records ({script.mode}), is back "
            f"{script.down:.1f}s later, and its partition's owner dies "
            f"{script.delay * 1000:.0f} ms after it rejoins"
            + (
                f" (then the intact replicas' fsyncs +{script.slow_intact * 1000:.0f} ms)"
                if script.slow_intact
                else ""
            ),
            script.heal,
            frozenset({process.name}),
            duration=build_up + script.down + 4.0 + SLOW_INTACT_FOR,
        )
        fault.script = script
        return fault

    def _inject_owner_crash(self, duration: float) -> ActiveFault | None:
        """Crash a server that owns partitions (their store sessions end: the next
        owner's recovery runs, maybe while a replica is damaged or behind)."""
        owners = [
            p
            for p in self.world.of_kind("server")
            if p.running and _owns_partitions(p.handle) and self._allowed({p.name})
        ]
        if not owners:
            return None
        process = self.rng.choice(owners)
        process.crash()
        return self._restartable(
            process, f"crash {process.name}, an owner, for {duration:.1f}s", "owner_crash"
        )


class _DamagedRejoin:
    """The script of :meth:`StorageFaults._inject_damaged_rejoin`."""

    def __init__(
        self,
        nemesis: StorageFaults,
        damaged: SimProcess,
        disk: SimDisk,
        lag_disk: SimDisk,
    ) -> None:
        self.nemesis = nemesis
        self.world = nemesis.world
        self.rng = nemesis.rng
        self.damaged = damaged
        self.disk = disk
        self.lag_disk = lag_disk
        self.stall = lag_disk.stall = asyncio.Event()
        self.handles: list[asyncio.TimerHandle] = []
        self.mode = self.rng.choice(("lost_tail", "silently_shorter", "wiped", "stale"))
        self.down = self.rng.uniform(0.02, 0.4)
        self.delay = self.rng.choice((0.0, self.rng.uniform(0.0, 0.05)))
        self.slow_intact = self.rng.uniform(0.3, 1.0) if self.rng.random() < 0.75 else 0.0
        """Three times in four the intact replicas answer the next recovery last (their fsyncs
        slowed by this much), after the damaged and the lagging one."""
        self.slowed: list[SimDisk] = []
        self.pending = True
        """The damage is still to come (the quorum phase waits for none)."""

    def later(self, delay: float, action: Any, *args: Any) -> None:
        loop = self.world.loop
        self.handles.append(loop.call_at(loop.time() + delay, action, *args, context=WORLD_CONTEXT))

    def damage(self) -> None:
        process, disk = self.damaged, self.disk
        self.pending = False
        if not process.running or not self.nemesis._allowed({process.name}):
            # another storage node went down meanwhile (the quorum phase): a damaged copy
            # beside a majority down is beyond the guarantee
            self.world.trace.add("fault", f"damaged rejoin: {process.name} not damaged")
            return
        stale = [
            snapshot
            for taken, snapshot in disk.backups
            if taken <= self.world.loop.time() - BACKUP_AGE
        ]
        if self.mode in ("lost_tail", "silently_shorter"):
            process.crash(power_loss=True)
            how = CHECKSUM if self.mode == "lost_tail" else ZEROS
            found = lose_tail(disk, self.rng, how) or "nothing to lose"
        elif self.mode == "stale" and stale:
            process.crash()
            disk.restore(stale[-1])
            found = "its disk restored from an older snapshot"
        else:
            process.crash()
            disk.wipe()
            found = "its disk wiped"
        self.world.trace.add("fault", f"damaged rejoin: {process.name} down: {found}")
        disk.on_session_info = self.on_marks
        self.later(self.down, restart, [process])

    def on_marks(self, partition: int, before: SessionInfo, info: SessionInfo) -> None:
        """The damaged replica's marks were written by the session that fences it (not a
        fence raised): its store session took it back (a rejoin's SetLowWaterMark, or its
        mark as a suspect replica; a new session's start)."""
        if partition not in self.disk.must_reach or info.session_id != before.session_id:
            return
        self.disk.on_session_info = None
        self.later(self.delay, self.crash_owner, partition)

    def crash_owner(self, partition: int) -> None:
        nemesis = self.nemesis
        owners = [
            p
            for p in self.world.of_kind("server")
            if p.running
            and partition in getattr(getattr(p.handle, "server", None), "partitions", {})
        ]
        if not owners or not nemesis._allowed({owners[0].name}):
            self.world.trace.add(
                "fault", f"damaged rejoin: no owner of partition {partition} to crash"
            )
            return
        owner = owners[0]
        ends = ", ".join(
            f"{p.name} {len(d.partitions[partition].written) - 1}"
            for p in self.world.of_kind("storage")
            if (d := _sim_disk_of(self.world, p)) is not None and partition in d.partitions
        )
        self.world.trace.add("fault", f"damaged rejoin: partition {partition}'s logs end at {ends}")
        owner.crash()
        self.end_lag()
        self.slow_the_intact()
        description = (
            f"crash {owner.name}, the owner of partition {partition}, "
            f"{self.delay * 1000:.0f} ms after {self.damaged.name} rejoined it damaged"
        )
        held = self.rng.uniform(1.0, 6.0)
        nemesis._record(nemesis._restartable(owner, description, "owner_crash"), held)

    def end_lag(self) -> None:
        """The lagging replica's fsyncs complete (at once: it answers the next recovery in
        time, holding only what the owner had sent it)."""
        self.stall.set()
        if self.lag_disk.stall is self.stall:
            self.lag_disk.stall = None

    def slow_the_intact(self) -> None:
        if not self.slow_intact:
            return
        for process in self.world.of_kind("storage"):
            disk = _sim_disk_of(self.world, process)
            if disk is not None and disk is not self.disk and disk is not self.lag_disk:
                disk.extra_fsync.append(self.slow_intact)
                self.slowed.append(disk)
        self.later(SLOW_INTACT_FOR, self.end_slow)

    def end_slow(self) -> None:
        for disk in self.slowed:
            if self.slow_intact in disk.extra_fsync:
                disk.extra_fsync.remove(self.slow_intact)
        self.slowed = []

    def heal(self) -> None:
        for handle in self.handles:
            handle.cancel()
        self.end_lag()
        self.end_slow()
        if self.disk.on_session_info == self.on_marks:
            self.disk.on_session_info = None
        restart([self.damaged])


def _sim_disk_of(world: World, process: SimProcess) -> SimDisk | None:
    disk = world.disks.get(world.data_dir(process.name))
    return disk if isinstance(disk, SimDisk) else None


def _owned(handle: Any) -> list[int]:
    """The partitions a running server (its ``RunningServer`` handle) owns."""
    return list(getattr(getattr(handle, "server", None), "partitions", None) or ())


def _owns_partitions(handle: Any) -> bool:
    return bool(_owned(handle))


__all__ = [
    "STORAGE_WEIGHTS",
    "StorageFaults",
    "corrupt_at_rest",
    "lose_writes",
    "misdirect",
    "unreadable_range",
]
