"""The disks' model: a partition's image (what was written, what is durable, what was
damaged) and what every simulated disk has (:class:`Disk`: the faults' hooks), for the
``sim`` engine's disks (:mod:`waltz_sim.disk`) and the ``fs`` engine's
(:mod:`waltz_sim.fsdisk`)."""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from waltz_api.types import LOST_SESSION, Record, SessionInfo
from waltz_sim.damage import INDEX_CHECKPOINT, ZEROS, merged
from waltz_sim.loop import SimLoop

if TYPE_CHECKING:
    from waltz_sim.trace import Trace

log = logging.getLogger(__name__)


@dataclass
class DiskConfig:
    """Latencies in seconds (uniform between the bounds)."""

    write: tuple[float, float] = (0.00002, 0.0002)
    fsync: tuple[float, float] = (0.0003, 0.003)


@dataclass
class PartitionImage:
    """One partition's log on one disk (see the module docstring)."""

    written: list[Record] = field(default_factory=list)
    durable: list[Record] = field(default_factory=list)
    common: int = 0
    """``written[:common]`` and ``durable[:common]`` are the same records."""
    visible: int = 0
    """``written[:visible]`` is what the engine shows."""
    written_info: SessionInfo = field(default_factory=SessionInfo)
    durable_info: SessionInfo = field(default_factory=SessionInfo)
    broken: str | None = None
    missing: list[tuple[int, int]] = field(default_factory=list)
    """Ranges (first, last) lost to damage below intact records, until repaired."""
    corrupt: dict[int, str] = field(default_factory=dict)
    """Records whose stored bytes are not what was written (``ZEROS``, ``CHECKSUM``,
    ``STALE``, ``holds <id>``), not yet found by a start-up recovery: a read of one
    raises CorruptionError naming it."""
    unreadable: list[tuple[int, int]] = field(default_factory=list)
    """Ranges whose reads fail with EIO (a latent sector error), while the fault lasts."""
    closed: str | None = None
    """Why the last start-up recovery left the partition closed (a read failed)."""
    acked_end: int = 0
    """The acknowledged end, kept apart from the records (the ``fs`` engine keeps it in
    its control file): the log end the last completed flush made durable, lowered by a
    truncation before it is done. A lost write of the records leaves it as it was, so a
    start-up recovery that finds the log ending below it knows the records there were
    acknowledged, not a torn unsynced write (:meth:`recover`)."""

    def sync(self) -> None:
        """An fdatasync completed: the durable state is the written one (the records, then
        the acknowledged end: :attr:`acked_end`)."""
        del self.durable[self.common :]
        self.durable.extend(self.written[self.common :])
        self.common = len(self.written)
        self.durable_info = self.written_info
        self.acked_end = len(self.written)

    def truncate_written(self, transaction_id: int) -> None:
        del self.written[transaction_id + 1 :]
        self.common = min(self.common, len(self.written))
        self.acked_end = min(self.acked_end, len(self.written))
        self._clip(len(self.written))

    def _clip(self, end: int) -> None:
        """Forget the damage of records at or above ``end`` (cut from the log)."""
        self.missing = [(a, min(b, end - 1)) for a, b in self.missing if a < end]
        self.unreadable = [(a, min(b, end - 1)) for a, b in self.unreadable if a < end]
        self.corrupt = {i: how for i, how in self.corrupt.items() if i < end}

    def cut(self, end: int) -> None:
        """Start-up recovery cut the log at ``end`` (flushed: durable too)."""
        del self.written[end:]
        del self.durable[end:]
        self.common = min(self.common, len(self.written))
        self.visible = min(self.visible, len(self.written))
        self._clip(len(self.written))

    def mark_lost(self) -> None:
        info = dataclasses.replace(self.written_info, low_water_mark_session_id=LOST_SESSION)
        self.written_info = self.durable_info = info

    def recover(self) -> list[str]:
        """The start-up recovery of the ``fs`` engine over this damage (after a restart);
        returns what it found. It reads the records after the index's last checkpoint
        (:data:`INDEX_CHECKPOINT`); in them, a run of damaged records:

        - with zeros: the shape of a torn write: the log is cut there (the records after
          it too: recovery cannot tell them from a torn write's pages), silently only
          above the acknowledged end (:attr:`acked_end`; below it, LOST_SESSION);
        - at the end of the log: a damaged tail: cut, and the session info says
          LOST_SESSION (the records may have been acknowledged);
        - with intact records after it: moved aside, a missing range until repaired.

        An EIO while reading leaves the partition closed until a later start."""
        self.closed = None
        self.visible = len(self.written)
        end = len(self.written)
        scan_from = (end // INDEX_CHECKPOINT) * INDEX_CHECKPOINT
        while scan_from and scan_from - 1 in self.corrupt:  # the checkpoint's record is bad
            scan_from -= INDEX_CHECKPOINT
        for first, last in self.unreadable:
            if first < end and last >= max(scan_from - 1, 0):
                self.closed = (
                    f"reading transactions {first}..{last} at start-up failed: [Errno 5] "
                    "Input/output error"
                )
                return [f"could not be recovered and stays closed: {self.closed}"]
        damaged = sorted(i for i in self.corrupt if scan_from <= i < end)
        runs: list[tuple[int, int]] = []
        for i in damaged:
            if runs and runs[-1][1] == i - 1:
                runs[-1] = (runs[-1][0], i)
            else:
                runs.append((i, i))
        found: list[str] = []
        for first, last in runs:
            zeros = any(self.corrupt[i] == ZEROS for i in range(first, last + 1))
            if zeros or last == len(self.written) - 1:
                cut = len(self.written) - first
                self.cut(first)
                if zeros:
                    found.append(
                        f"zeros at transaction {first}: the shape of a torn write; the log is "
                        f"cut there ({cut} records)"
                    )
                else:
                    self.mark_lost()
                    found.append(f"a damaged tail, transactions {first}..{last}: cut, LOST_SESSION")
                break
            self.missing = merged([*self.missing, (first, last)])
            found.append(f"transactions {first}..{last} damaged: missing until repaired")
        for i in damaged:
            self.corrupt.pop(i, None)
        if len(self.written) < self.acked_end:
            if self.written_info.low_water_mark_session_id != LOST_SESSION:
                self.mark_lost()
                found.append(
                    f"the log ends at {len(self.written)}, below its acknowledged end "
                    f"{self.acked_end}: acknowledged records lost, LOST_SESSION"
                )
            self.acked_end = len(self.written)
        return found

    def damage(self, rng: random.Random) -> str | None:
        """Damage found at start-up: records lost below intact ones (a missing range),
        or a lost tail of acknowledged records (LOST_SESSION). Returns what, or None."""
        length = len(self.written)
        if length < 4:
            return None
        if rng.random() < 0.5:
            first = rng.randrange(0, length - 2)
            last = min(first + rng.randint(0, 4), length - 2)
            self.missing = sorted([*self.missing, (first, last)])
            return f"transactions {first}..{last} lost to damage (intact ones after them)"
        lost = self.lose_tail(rng.randint(1, min(5, length - 1)))
        return f"its last {lost} transactions lost to damage (a lost tail)"

    def lose_tail(self, count: int) -> int:
        """Damage found at start-up: the last ``count`` records (acknowledged) are gone, and
        the engine says so (``low_water_mark_session_id == LOST_SESSION``, as the ``fs``
        engine reports a damaged tail it moved aside). Returns how many went."""
        lost = max(0, min(count, len(self.written)))
        del self.written[len(self.written) - lost :]
        del self.durable[len(self.written) :]
        self.common = min(self.common, len(self.written))
        self.visible = len(self.written)
        self.missing = [
            (f, min(last, self.visible - 1)) for f, last in self.missing if f < self.visible
        ]
        info = dataclasses.replace(self.written_info, low_water_mark_session_id=LOST_SESSION)
        self.written_info = self.durable_info = info
        self.acked_end = len(self.written)
        return lost

    def copy(self) -> PartitionImage:
        """The image as a snapshot of the disk takes it now (what was written, synced or
        not: a crash-consistent copy), to restore later (:meth:`SimDisk.restore`)."""
        return PartitionImage(
            written=list(self.written),
            durable=list(self.written),
            common=len(self.written),
            visible=len(self.written),
            written_info=self.written_info,
            durable_info=self.written_info,
            missing=list(self.missing),
            corrupt=dict(self.corrupt),
            acked_end=len(self.written),
        )

    @property
    def unrepaired(self) -> bool:
        return (
            bool(self.missing or self.corrupt or self.unreadable)
            or self.closed is not None
            or self.written_info.low_water_mark_session_id == LOST_SESSION
        )

    def intact(self) -> list[Record]:
        """What a reader gets: the records up to the first missing or corrupt one."""
        end = min([len(self.written), *(first for first, _ in self.missing), *self.corrupt])
        return self.written[:end]

    def lose_unsynced(self, rng: random.Random) -> int:
        """A power loss: keep the durable state, or the unsynced writes cut short (the
        last one torn). Returns how many written records did not survive."""
        before = len(self.written)
        if rng.random() < 0.5:
            # the unsynced writes are lost (a truncation not synced is undone too)
            self.written = list(self.durable)
        else:
            # the truncation (if any) reached the disk, and a prefix of the appends
            kept = rng.randint(self.common, len(self.written))
            del self.written[kept:]
        if rng.random() < 0.5:
            self.written_info = self.durable_info
        self.durable = list(self.written)
        self.common = len(self.written)
        self.durable_info = self.written_info
        self.visible = len(self.written)
        self._clip(len(self.written))
        return max(0, before - len(self.written))


class _DiskSettings(Protocol):
    @property
    def disk(self) -> DiskConfig: ...


class DiskWorld(Protocol):
    """What a disk needs of its world (``waltz_sim.world.World``)."""

    @property
    def loop(self) -> SimLoop: ...

    @property
    def trace(self) -> Trace: ...

    @property
    def config(self) -> _DiskSettings: ...

    @property
    def disk_rng(self) -> random.Random: ...

    @property
    def disks(self) -> dict[str, Disk]: ...


class Disk(abc.ABC):
    """The disk of one storage node, in the world (it survives the node's crashes): the
    faults every kind of simulated disk has (the hooks of the nemesis and the scripts).
    :class:`SimDisk` is the ``sim`` engine's model; ``waltz_sim.fsdisk.FsDisk`` the file
    system under the real ``fs`` engine."""

    def __init__(self, world: DiskWorld, location: str) -> None:
        self.world = world
        self.location = location
        self.extra_fsync: list[float] = []
        """Slow-fsync faults in force (seconds added to each fsync)."""
        self.failing_fsyncs = 0
        """The next this-many fsyncs fail (a fault)."""
        self.fsyncs = 0
        self.fsync_errors = 0
        self.pending_damage = False
        """Damage the next start-up recovery finds (a fault)."""
        self.must_reach: dict[int, int] = {}
        """Per partition, the log end this disk held when a storage fault damaged it: it
        counts as impaired (the nemesis' rule) until it holds that much again, intact (or
        as much as the longest other replica, when the cluster cut its tail)."""
        self.needs_marks: set[int] = set()
        """Damaged partitions whose log lost its end (cut, wiped, restored): they count as
        impaired until a store session also wrote their marks again (SetLowWaterMark), as
        the cluster took them back as clean replicas."""
        self.fences: dict[int, int] = {}
        """Each partition's fence (the session id of its session info), as the last
        :meth:`read_back` found it."""
        self.backups: list[tuple[float, dict[int, PartitionImage]]] = []
        """Crash-consistent snapshots of the disk (its durable state), oldest first."""
        self.on_session_info: Callable[[int, SessionInfo, SessionInfo], None] | None = None
        """A fault's trigger: called with the partition, its session info before and the
        new one once a ``set_session_info`` is durable."""
        self.stall: asyncio.Event | None = None
        """A stalled disk (scripted scenarios): every fsync, once its time is up, waits until
        the event is set (the stall ends: the fsyncs waiting for it complete then)."""

    @property
    def rng(self) -> random.Random:
        return self.world.disk_rng

    def write_delay(self) -> float:
        return self.rng.uniform(*self.world.config.disk.write)

    def fsync_delay(self) -> float:
        delay = self.rng.uniform(*self.world.config.disk.fsync)
        if self.extra_fsync:
            delay += max(self.extra_fsync) * self.rng.uniform(0.5, 1.0)
        return delay

    async def flush_wait(self) -> None:
        """The time an fsync takes (slowed by the faults in force; held while stalled)."""
        await asyncio.sleep(self.fsync_delay())
        while self.stall is not None and not self.stall.is_set():
            await self.stall.wait()

    @abc.abstractmethod
    def lose_power(self) -> str | None:
        """A power loss: lose what no flush covered; what was lost (None: nothing)."""

    @abc.abstractmethod
    async def read_back(self) -> dict[int, list[Record]]:
        """Each partition's readable records, as a restarted engine would find them (up to
        a range lost to damage and not repaired): the replicas the checker judges."""

    @property
    @abc.abstractmethod
    def unrepaired(self) -> bool:
        """Damage found and not repaired yet (a missing range, a lost tail)."""


__all__ = ["Disk", "DiskConfig", "DiskWorld", "PartitionImage"]
