"""The nemesis: plays a :class:`~waltz_chaos.schedule.Schedule` on the real cluster.

Each fault is injected at its time (seconds after the workload started) and healed
after its duration, concurrently with the others; what was done, and when, is
recorded in a :class:`FaultRecord` (the report's timeline). How each kind acts:

- ``kill`` (and the quorum faults ``storage_majority_down``, ``servers_down``):
  SIGKILL, then a restart (a new incarnation) when it heals;
- ``pause`` (``storage_majority_paused``): SIGSTOP, then SIGCONT;
- ``coordination_restart`` (``long_coordination_outage``): the coordination
  service killed -9, then started again on its data;
- ``session_expiry``: the target cut off from the coordination service, both ways,
  longer than the session timeout (the service expires the session); without
  namespaces, the target is paused that long instead;
- ``disk_full``: a filler file takes every free byte of the node's file system;
  healing deletes it and, when the engine closed a partition after a failed write
  (it says so in its log), restarts the node, as an operator would;
- link faults (``partition``, ``one_way``, ``isolate``, ``slow_link``,
  ``lossy_link``, ``storage_cut_off``): queues on the links' sending ends
  (:meth:`~waltz_chaos.netns.NetworkLab.shape`), removed when it heals;
- storage faults (:data:`~waltz_chaos.schedule.STORAGE_FAULTS`, :mod:`waltz_chaos.damage`):
  the node killed -9 and its files damaged (``corrupt_segment``,
  ``truncate_segment``), its data directory replaced by the oldest copy kept
  (``rollback_data``) or removed (``wipe_data``), then restarted at the fault's
  ``hold`` (its start-up check, ``verify_on_open``, finds the damage); or, while it
  runs, bytes of a sealed segment flipped (``flip_sealed``) and, at the ``hold``, a
  scrub pass run on the node (as ``waltz storage scrub --endpoint`` does; a graceful
  restart if it cannot). The heal ends when the cluster has repaired the node
  (:func:`~waltz_chaos.damage.repaired`).

Copies of a storage node's data directory (for ``rollback_data``) are taken each time
a fault stops the node. A damaged node is impaired until it is repaired, however long
that takes: a fault that would impair another storage node (more than a minority, with
the damaged one) waits until then (it is skipped when it could not heal before the
quiet end), and a quorum fault waits for every repair.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from waltz_api.errors import WaltzError
from waltz_chaos import damage
from waltz_chaos.cluster import BROKEN_MARKER, Cluster, Member
from waltz_chaos.errors import ChaosError
from waltz_chaos.netns import LinkShape, NetworkLab
from waltz_chaos.schedule import STORAGE_FAULTS, Fault, Schedule, impaired_by
from waltz_client import AsyncWaltzClient, ClientConfig, Transaction, WaltzClientCallbacks
from waltz_storage_node.snapshot import mark_restored

log = logging.getLogger(__name__)

CUT = LinkShape("cut")


@dataclass
class FaultRecord:
    """A fault as it was played."""

    fault: Fault
    injected_at: float | None = None
    healed_at: float | None = None
    description: str = ""
    notes: list[str] = field(default_factory=list)
    _undo: list[Callable[[], object]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.description = self.description or self.fault.describe()

    @property
    def kind(self) -> str:
        return self.fault.kind

    @property
    def active(self) -> bool:
        return self.injected_at is not None and self.healed_at is None


class Nemesis:
    """See the module docstring."""

    def __init__(
        self,
        cluster: Cluster,
        lab: NetworkLab | None,
        schedule: Schedule,
        start: float,
        *,
        report: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.cluster = cluster
        self.lab = lab
        self.schedule = schedule
        self.start = start
        self.report = report
        self.records = [FaultRecord(f) for f in schedule.faults]
        self._lock = asyncio.Lock()
        self._damaged: dict[str, FaultRecord] = {}
        """Storage nodes damaged and not repaired yet."""
        self._entering: list[FaultRecord] = []
        """Faults let through by :meth:`_hold_back`, being injected."""
        self._copies = (
            damage.Copies(cluster.run_dir / "copies")
            if any(f.kind == "rollback_data" for f in schedule.faults)
            else None
        )
        self._client: AsyncWaltzClient | None = None
        self._cut_short = False

    def _now(self) -> float:
        return time.monotonic() - self.start

    async def run(self) -> None:
        """Play every fault; returns when the last one healed."""
        await asyncio.gather(*(self._play(record) for record in self.records))

    async def _play(self, record: FaultRecord) -> None:
        fault = record.fault
        await asyncio.sleep(max(0.0, self.start + fault.at - time.monotonic()))
        held = await self._hold_back(record)
        if held is None:
            return
        try:
            try:
                await self._inject(record)
            finally:
                self._entering = [r for r in self._entering if r is not record]
            record.injected_at = time.monotonic()
            self.report(f"{self._now():7.1f}s  inject  {record.description}")
        except Exception as exc:
            # what it did so far is undone when it heals; the run goes on
            log.exception("injecting %s failed", record.description)
            record.notes.append(f"not injected: {type(exc).__name__}: {exc}")
            self.report(f"{self._now():7.1f}s  skip    {record.description}: {exc}")
            if record._undo:
                record.injected_at = time.monotonic()
                await self._heal(record)
            return
        await asyncio.sleep(max(0.0, self.start + fault.heal_at + held - time.monotonic()))
        await self._heal(record)

    # -- the damaged nodes' repair ------------------------------------------------------------

    async def _hold_back(self, record: FaultRecord) -> float | None:
        """Wait while ``record``'s fault would impair more storage nodes than a minority
        with a damaged one still being repaired; the seconds waited, or None when it
        could no longer heal before the quiet end (skipped). A fault held back is let
        through only while it and the faults in play impair a minority (those held back
        meanwhile are not all let through at once)."""
        began = time.monotonic()
        deadline = self.start + self.schedule.heal_deadline
        strict = False
        while self._blocked(record, strict=strict):
            strict = True
            if time.monotonic() - began + self.start + record.fault.end > deadline:
                waiting = ", ".join(sorted(self._damaged)) or "a storage node"
                record.notes.append(f"not injected: {waiting} still being repaired")
                self.report(
                    f"{self._now():7.1f}s  skip    {record.description}: {waiting} still "
                    "being repaired"
                )
                return None
            await asyncio.sleep(0.1)
        self._entering.append(record)
        held = time.monotonic() - began
        if held > 0.1:
            record.notes.append(f"held back {held:.1f} s while a damaged node was repaired")
        return held

    def _blocked(self, record: FaultRecord, *, strict: bool = False) -> bool:
        """Whether injecting ``record`` now would impair more than a minority of the
        storage nodes, counting the damaged ones and the faults in play. Unless
        ``strict`` (a storage fault, or one held back), only while a node is damaged:
        the schedule's rules keep the others apart."""
        fault = record.fault
        if not (strict or fault.kind in STORAGE_FAULTS or self._damaged):
            return False
        if fault.quorum:
            return bool(self._damaged)
        roles = self.schedule.roles
        mine = impaired_by(fault, roles)[0]
        if not mine:
            return False
        busy = set(self._damaged)
        entering = {id(r) for r in self._entering}
        for other in self.records:
            if other is not record and (other.active or id(other) in entering):
                busy |= impaired_by(other.fault, roles)[0]
        return len(busy | mine) > (len(roles.storage) - 1) // 2

    async def _restart_and_repair(
        self, record: FaultRecord, member: Member, *, running: bool = False
    ) -> None:
        """Start the stopped damaged node (a running one: scrub it, or restart it
        gracefully when it cannot be scrubbed), then wait until the cluster repaired it
        (bounded by the quiet end); its heal ends then."""
        cluster = self.cluster
        try:
            if running:
                assert cluster.transport is not None
                endpoint = cluster.storage_endpoints[member.name]
                try:
                    record.notes.append(await damage.scrub(cluster.transport, endpoint))
                except (WaltzError, TimeoutError, OSError) as exc:
                    record.notes.append(f"no scrub ({type(exc).__name__}: {exc}): restarted")
                    await cluster.restart(member)
            else:
                await cluster.start_member(member, wait=False)
            if self._cut_short:
                return
            restarted = time.monotonic()
            missing = await self._wait_repaired(member)
            if missing is None:
                since = "the scrub" if running else "its start"
                record.notes.append(f"repaired {time.monotonic() - restarted:.1f} s after {since}")
            else:
                record.notes.append(f"not repaired before the quiet end: {missing}")
            record.healed_at = time.monotonic()
        finally:
            self._damaged.pop(member.name, None)

    async def _wait_repaired(self, member: Member) -> str | None:
        """None once ``member`` is repaired, else (at the quiet end) what it lacks."""
        cluster = self.cluster
        assert cluster.transport is not None
        deadline = self.start + self.schedule.heal_deadline
        highs = await self._high_water_marks(deadline)
        if highs is None:
            return "no high-water mark could be read"
        endpoint = cluster.storage_endpoints[member.name]
        while True:
            missing = await damage.repaired(cluster.transport, endpoint, highs)
            if missing is None or time.monotonic() >= deadline or self._cut_short:
                return missing
            await asyncio.sleep(0.25)

    async def _high_water_marks(self, deadline: float) -> dict[int, int] | None:
        """Every partition's high-water mark (through a client of the cluster)."""
        if self._client is None:
            cluster = self.cluster
            client = AsyncWaltzClient(
                _Follow(),
                ClientConfig(
                    coordination=cluster.coordination_uri,
                    coordination_options=cluster.coordination_options,
                    transport="zmq",
                    transport_options=cluster.transport_options,
                ),
            )
            await client.start()
            self._client = client
        highs: dict[int, int] = {}
        for partition in range(self.cluster.settings.num_partitions):
            while partition not in highs:
                try:
                    highs[partition] = await self._client.high_water_mark(partition, timeout=5.0)
                except (WaltzError, TimeoutError) as exc:
                    if time.monotonic() >= deadline or self._cut_short:
                        log.warning("no high-water mark of partition %d: %s", partition, exc)
                        return None
                    await asyncio.sleep(0.5)
        return highs

    def _data(self, member: Member) -> Path:
        if member.kind != "storage" or member.data_dir is None:
            raise ChaosError(f"{member.name} has no data directory this run can reach")
        return member.data_dir / "data"

    async def _copy(self, member: Member) -> None:
        """A copy of a stopped storage node's data directory (for a later rollback)."""
        if self._copies is not None and member.kind == "storage" and member.data_dir:
            await asyncio.to_thread(self._copies.take, member.name, self._data(member), self._now())

    async def _damage(self, record: FaultRecord) -> None:
        fault, cluster = record.fault, self.cluster
        member = self._member(fault.targets[0])
        data = self._data(member)
        rng = random.Random(f"waltz-chaos:{self.schedule.seed}:{fault.at}:{fault.kind}")
        if fault.kind == "flip_sealed":
            what = await asyncio.to_thread(damage.flip_sealed, data, rng)
            self._damaged[member.name] = record
            record._undo.append(
                functools.partial(self._restart_and_repair, record, member, running=True)
            )
            record.description += f" ({what}; scrubbed at the heal)"
            return
        copy = None
        if fault.kind == "rollback_data":
            copy = self._copies.oldest(member.name) if self._copies is not None else None
            if copy is None:
                raise ChaosError(f"no copy of {member.name}'s data directory to roll back to")
        cluster.kill(member)
        self._damaged[member.name] = record
        record._undo.append(functools.partial(self._restart_and_repair, record, member))
        if copy is not None:
            await asyncio.to_thread(damage.restore, data, copy[0])
            # put back as `waltz storage restore` does: every partition marked restored
            await mark_restored("fs", data, cluster.cluster_key, cluster.settings.num_partitions)
            what = f"its data directory as copied at {copy[1]:.1f} s, marked restored"
        else:
            await self._copy(member)
            if fault.kind == "wipe_data":
                what = await asyncio.to_thread(damage.wipe, data)
            elif fault.kind == "corrupt_segment":
                what = await asyncio.to_thread(damage.corrupt_segment, data, rng)
            else:
                what = await asyncio.to_thread(damage.truncate_segment, data, rng)
        record.description += f" ({what})"

    async def close(self) -> None:
        """Stop the nemesis's own client."""
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(Exception):
                await client.close()

    async def _heal(self, record: FaultRecord) -> None:
        if not record.active:
            return
        record.healed_at = time.monotonic()
        for undo in reversed(record._undo):
            try:
                result = undo()
                if asyncio.iscoroutine(result):
                    await result
            except Exception as exc:
                log.exception("healing %s failed", record.description)
                record.notes.append(f"heal: {type(exc).__name__}: {exc}")
        record._undo.clear()
        self.report(f"{self._now():7.1f}s  heal    {record.description}")

    async def heal_all(self) -> None:
        """Heal whatever is still active (a run cut short: no wait for repairs); then
        every member runs."""
        self._cut_short = True
        await asyncio.gather(*(self._heal(r) for r in self.records if r.active))
        cluster = self.cluster
        for member in cluster.members.values():
            cluster.resume(member)
            if member.down:
                with contextlib.suppress(WaltzError, OSError):
                    await cluster.start_member(member, wait=False)
        if cluster.coordination_down:
            await cluster.start_coordination()
        if self.lab is not None:
            await asyncio.to_thread(self.lab.heal_all)

    # -- injecting ------------------------------------------------------------------------

    def _member(self, name: str) -> Member:
        try:
            return self.cluster.members[name]
        except KeyError:
            raise ChaosError(f"no member {name!r} in this cluster") from None

    async def _inject(self, record: FaultRecord) -> None:
        fault, cluster = record.fault, self.cluster
        kind = fault.kind
        if kind in ("kill", "storage_majority_down", "servers_down"):
            for name in fault.targets:
                member = self._member(name)
                cluster.kill(member)
                record._undo.append(functools.partial(cluster.start_member, member, wait=False))
                await self._copy(member)
        elif kind in ("pause", "storage_majority_paused"):
            for name in fault.targets:
                member = self._member(name)
                cluster.pause(member)
                record._undo.append(functools.partial(cluster.resume, member))
        elif kind in ("coordination_restart", "long_coordination_outage"):
            await cluster.kill_coordination()
            record._undo.append(cluster.start_coordination)
        elif kind == "session_expiry":
            member = self._member(fault.targets[0])
            if self.lab is None:
                cluster.pause(member)
                record._undo.append(lambda: cluster.resume(member))
                record.description += " (paused longer than the session timeout)"
            else:
                coordination = "coordination"
                links = [(member.name, coordination), (coordination, member.name)]
                await self._shape(record, links, CUT)
                record.description += " (cut off from coordination longer than the session timeout)"
        elif kind == "disk_full":
            member = self._member(fault.targets[0])
            if not member.mounted:
                raise ChaosError(f"{member.name} has no file system of its own to fill")
            offset = len(member.output())
            filled = await asyncio.to_thread(cluster.fill_disk, member)
            record.description += f" ({filled // 1024} KiB filled)"
            record._undo.append(lambda: self._after_disk_full(record, member, offset))
        elif kind == "isolate":
            target = fault.targets[0]
            assert self.lab is not None
            peers = [p for p in self.lab.peers(target) if p != "admin"]
            await self._shape(
                record, [(a, b) for p in peers for a, b in ((target, p), (p, target))], CUT
            )
        elif kind in ("partition", "one_way", "storage_cut_off"):
            await self._shape(record, list(fault.links), CUT)
        elif kind == "slow_link":
            shape = LinkShape("slow", delay_ms=fault.delay_ms, rate_kbit=fault.rate_kbit)
            await self._shape(record, list(fault.links), shape)
        elif kind == "lossy_link":
            await self._shape(record, list(fault.links), LinkShape("lossy", loss=fault.loss))
        elif kind in STORAGE_FAULTS:
            await self._damage(record)
        else:
            raise ChaosError(f"the nemesis does not know the fault {kind!r}")

    async def _shape(
        self, record: FaultRecord, links: list[tuple[str, str]], shape: LinkShape
    ) -> None:
        lab = self.lab
        if lab is None:
            raise ChaosError("network faults need the run's network namespaces")
        for source, target in links:
            await asyncio.to_thread(lab.shape, source, target, shape)
            heal = functools.partial(asyncio.to_thread, lab.shape, source, target, None)
            record._undo.append(heal)
        if shape.kind != "cut":
            record.description = (
                f"{record.fault.kind}: {record.fault.links_text()} {shape.describe(lab.netem)}"
            )

    async def _after_disk_full(self, record: FaultRecord, member: Member, offset: int) -> None:
        cluster = self.cluster
        await asyncio.to_thread(cluster.free_disk, member)
        if BROKEN_MARKER in member.output()[offset:] and not member.down:
            record.notes.append(
                f"{member.name}'s engine closed a partition after a failed write: restarted"
            )
            await cluster.restart(member)


class _Follow(WaltzClientCallbacks):
    """The nemesis's client: follows the feed (applying nothing), for high-water marks."""

    def __init__(self) -> None:
        self.applied: dict[int, int] = {}

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.applied.get(partition_id, -1)

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.applied[transaction.partition_id] = transaction.transaction_id


__all__ = ["FaultRecord", "Nemesis"]
