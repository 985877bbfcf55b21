"""The nemesis holds back what would impair another storage node while a damaged one is
being repaired (a damaged node counts as impaired until the cluster repaired it)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from waltz_chaos.cluster import Cluster
from waltz_chaos.nemesis import FaultRecord, Nemesis
from waltz_chaos.schedule import Fault, Roles, Schedule

ROLES = Roles.of(3, 2, 4)
WIPE = Fault(5.0, "wipe_data", 7.0, ("storage-0",), hold=2.0)


def nemesis(tmp_path: Path, *faults: Fault, heal_deadline: float = 92.0) -> Nemesis:
    schedule = Schedule(0, heal_deadline + 28.0, 28.0, "storage", ROLES, list(faults))
    cluster = cast(Cluster, SimpleNamespace(run_dir=tmp_path))
    return Nemesis(cluster, None, schedule, time.monotonic())


def cut(a: str, b: str) -> Fault:
    return Fault(8.0, "partition", 2.0, links=((a, b), (b, a)))


def test_a_damaged_node_holds_back_faults_on_the_other_storage_nodes(tmp_path: Path) -> None:
    n = nemesis(tmp_path, WIPE)
    n._damaged["storage-0"] = n.records[0]

    def blocked(fault: Fault) -> bool:
        return n._blocked(FaultRecord(fault))

    assert blocked(Fault(8.0, "kill", 2.0, ("storage-1",)))
    assert blocked(Fault(8.0, "pause", 2.0, ("storage-2",)))
    assert blocked(cut("server-0", "storage-1"))
    assert blocked(Fault(8.0, "corrupt_segment", 7.0, ("storage-2",), hold=2.0))
    assert blocked(Fault(8.0, "storage_majority_down", 4.0, ("storage-0", "storage-1")))
    assert blocked(Fault(8.0, "servers_down", 4.0, ("server-0", "server-1")))  # quorum: alone
    assert not blocked(Fault(8.0, "kill", 2.0, ("storage-0",)))  # the same node
    assert not blocked(Fault(8.0, "kill", 2.0, ("server-0",)))
    assert not blocked(Fault(8.0, "pause", 2.0, ("client-1",)))
    assert not blocked(cut("server-0", "coordination"))
    n._damaged.clear()
    assert not blocked(Fault(8.0, "kill", 2.0, ("storage-1",)))
    assert not blocked(Fault(8.0, "servers_down", 4.0, ("server-0", "server-1")))


def test_a_storage_fault_waits_for_another_storage_node_impaired(tmp_path: Path) -> None:
    kill = Fault(4.0, "kill", 6.0, ("storage-2",))
    server = Fault(4.0, "kill", 6.0, ("server-1",))
    n = nemesis(tmp_path, kill, server)
    n.records[0].injected_at = n.records[1].injected_at = time.monotonic()
    assert n._blocked(FaultRecord(WIPE))
    assert not n._blocked(FaultRecord(Fault(5.0, "kill", 2.0, ("storage-1",))))  # as scheduled
    n.records[0].healed_at = time.monotonic()
    assert not n._blocked(FaultRecord(WIPE))


async def test_held_back_until_repaired_or_skipped_before_the_quiet_end(tmp_path: Path) -> None:
    n = nemesis(tmp_path, WIPE)
    n._damaged["storage-0"] = n.records[0]
    waiting = FaultRecord(Fault(8.0, "kill", 2.0, ("storage-1",)))

    async def repair() -> None:
        await asyncio.sleep(0.5)
        del n._damaged["storage-0"]

    repairing = asyncio.create_task(repair())
    held = await n._hold_back(waiting)
    await repairing
    assert held is not None and held >= 0.4 and "held back" in waiting.notes[0]

    said: list[str] = []
    late = nemesis(tmp_path, WIPE, heal_deadline=10.5)
    late.report = said.append
    late._damaged["storage-0"] = late.records[0]
    skipped = FaultRecord(Fault(8.0, "kill", 2.0, ("storage-1",)))
    assert await late._hold_back(skipped) is None
    assert skipped.notes == ["not injected: storage-0 still being repaired"]
    assert "skip" in said[0] and skipped.injected_at is None


async def test_faults_held_back_are_let_through_one_at_a_time(tmp_path: Path) -> None:
    """Two kills of other storage nodes held back by a repair: when it is done, one goes
    (two would impair a majority); the other once the first healed."""
    kills = Fault(8.0, "kill", 2.0, ("storage-1",)), Fault(8.5, "kill", 2.0, ("storage-2",))
    n = nemesis(tmp_path, WIPE, *kills)
    wipe, *held = n.records
    n._damaged["storage-0"] = wipe
    tasks = [asyncio.create_task(n._hold_back(r)) for r in held]
    await asyncio.sleep(0.3)
    assert not any(t.done() for t in tasks)
    del n._damaged["storage-0"]
    done, pending = await asyncio.wait(tasks, timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1, (done, pending)
    first = held[tasks.index(done.pop())]
    first.injected_at = time.monotonic()  # injected: in play from now on
    n._entering.clear()
    await asyncio.sleep(0.3)
    assert not pending.copy().pop().done()
    first.healed_at = time.monotonic()
    assert await asyncio.wait_for(pending.pop(), 2.0) is not None
