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
  (:meth:`~waltz_chaos.netns.NetworkLab.shape`), removed when it heals.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from waltz_api.errors import WaltzError
from waltz_chaos.cluster import BROKEN_MARKER, Cluster, Member
from waltz_chaos.errors import ChaosError
from waltz_chaos.netns import LinkShape, NetworkLab
from waltz_chaos.schedule import Fault, Schedule

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

    def _now(self) -> float:
        return time.monotonic() - self.start

    async def run(self) -> None:
        """Play every fault; returns when the last one healed."""
        await asyncio.gather(*(self._play(record) for record in self.records))

    async def _play(self, record: FaultRecord) -> None:
        fault = record.fault
        await asyncio.sleep(max(0.0, self.start + fault.at - time.monotonic()))
        try:
            await self._inject(record)
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
        await asyncio.sleep(max(0.0, self.start + fault.end - time.monotonic()))
        await self._heal(record)

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
        """Heal whatever is still active (a run cut short); then every member runs."""
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


__all__ = ["FaultRecord", "Nemesis"]
