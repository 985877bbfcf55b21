"""Failover: how long appends stop after a fault (figures only, never pass/fail).

A real cluster at the default settings: a standalone ZooKeeper (session timeout 10 s),
three ``waltz storage`` processes (fs engine), two ``waltz server`` processes (zmq,
the default failure detection: peers pinged every 0.1 s, suspected after 1.5 s of
silence), built by the system suite's harness. One :class:`AsyncWaltzClient` in this
process appends to partition 0 steadily (a transaction every ``--interval`` seconds,
at most 50 in flight) and records the time of every commit.

For each fault kind, ``--trials`` times:

- ``storage-kill``: one storage node (a replica of partition 0) killed -9, restarted
  after 3 s;
- ``owner-kill``: the server owning partition 0 killed -9, restarted after 4 s (it
  registers under a new id and takes its share back);
- ``owner-stop``: the owner paused (SIGSTOP) for 4 s, then resumed (SIGCONT);
- ``coordination-restart``: ZooKeeper killed -9 and started again at once (same data).

Per trial: the longest gap between two commits from 1 s before the fault to 6 s after
it (the reference, measured in the same run before any fault: the longest gap over a
quiet 5 s window), the time from the fault to the commit of the first submission
started after it, and for the owner faults the time until the partition's assignment
moved (detection plus the leader's compare-and-set, seen through a watch). p50 and max
over the trials. For the coordination restarts, how long ZooKeeper was down (its
start-up, which dominates on a loaded machine) is printed too: an outage longer than
the 10 s session timeout ends every session, and the servers register again.

    .venv/bin/python bench/failover.py [--trials 10] [--kinds owner-kill,owner-stop]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import logging
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from waltz_api.cluster import PartitionAssignment, coordination_from_uri
from waltz_api.contracts.coordination import SessionState, Watch
from waltz_api.errors import WaltzError
from waltz_client import (
    AsyncWaltzClient,
    ClientConfig,
    SubmissionResult,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)
from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_conformance.suites.system import SystemHarness
from waltz_server.cluster_admin import ClusterAdmin

KINDS = ("storage-kill", "owner-kill", "owner-stop", "coordination-restart")
WINDOW_BEFORE = 1.0
WINDOW_AFTER = 6.0
FAULT_LENGTH = 4.0


class Feed(WaltzClientCallbacks):
    def __init__(self) -> None:
        self.hwm: dict[int, int] = {}

    async def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm.get(partition_id, -1)

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.hwm[transaction.partition_id] = transaction.transaction_id


class Append(TransactionContext):
    def partition_id(self, num_partitions: int) -> int:
        return 0

    async def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_data(b"failover-bench")
        return True


class SteadyWriter:
    """Submits a transaction every ``interval`` seconds; records every commit's time."""

    def __init__(self, client: AsyncWaltzClient, interval: float) -> None:
        self.client = client
        self.interval = interval
        self.commits: list[float] = []
        self.submitted: list[tuple[float, float]] = []
        """(started, committed) of every committed submission."""
        self.failures: list[str] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            started = time_now()
            task = await self.client.enqueue(Append())
            task.add_done_callback(functools.partial(self._done, started))
            await asyncio.sleep(self.interval)

    def _done(self, started: float, task: asyncio.Task[SubmissionResult]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            self.failures.append(repr(task.exception())[:200])
            return
        now = time_now()
        self.commits.append(now)
        self.submitted.append((started, now))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def longest_gap(self, start: float, end: float) -> float:
        times = [t for t in self.commits if start <= t <= end]
        before = [t for t in self.commits if t < start]
        if before:
            times.insert(0, before[-1])
        if not times:
            return end - start
        gaps = [b - a for a, b in itertools.pairwise(times)]
        gaps.append(max(0.0, min(end, time_now()) - times[-1]))
        return max(gaps)

    def first_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` to the commit of the first submission started after it
        (a commit already on its way when the fault struck does not count)."""
        found = [committed for started, committed in self.submitted if started > moment]
        return min(found) - moment if found else None


def time_now() -> float:
    return asyncio.get_running_loop().time()


class Moves:
    """When partition 0's assignment changes (a watch)."""

    def __init__(self) -> None:
        self.changes: list[tuple[float, PartitionAssignment]] = []
        self.watch: Watch | None = None

    def __call__(self, value: PartitionAssignment | None) -> None:
        if value is not None:
            self.changes.append((time_now(), value))

    def first_after(self, moment: float) -> float | None:
        for t, _ in self.changes:
            if t > moment:
                return t - moment
        return None


def _signal_server(harness: SystemHarness, index: int, sig: signal.Signals) -> None:
    member = harness.servers[index]
    process = getattr(member, "process", None)
    pid = None if process is None else process.pid
    if pid is None:
        raise RuntimeError(f"server {index} has no process")
    os.kill(pid, sig)


async def owner_index(harness: SystemHarness) -> int:
    server_id, _, _ = await harness.owner(0)
    return harness.server_index(server_id)


async def settle(
    harness: SystemHarness, writer: SteadyWriter, moves: Moves, seconds: float = 2.0
) -> None:
    """Until every server runs, every partition is owned and commits flow again."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 120
    next_report = loop.time() + 10
    while loop.time() < deadline:
        try:
            await ensure_coordination(harness, moves)
            owners = [(await harness.owner(p))[0] for p in range(harness.num_partitions)]
        except WaltzError as exc:  # the harness's own session, after a coordination restart
            logging.getLogger("bench").warning("reading the assignment: %s", exc)
            await asyncio.sleep(0.5)
            continue
        live = {m.server_id() for m in harness.servers}  # type: ignore[attr-defined]
        recent = [t for t in writer.commits if t > loop.time() - 0.5]
        if all(o in live for o in owners) and recent:
            break
        if loop.time() > next_report:
            next_report = loop.time() + 10
            logging.getLogger("bench").warning(
                "settling: owners %s, running servers %s, %d commits in the last 0.5 s",
                owners,
                sorted(i for i in live if i is not None),
                len(recent),
            )
        await asyncio.sleep(0.2)
    await asyncio.sleep(seconds)


async def ensure_coordination(harness: SystemHarness, moves: Moves) -> None:
    """After a long coordination outage the harness's own session may be lost (it was
    suspended longer than its timeout): replace its client (and the bench's watch)."""
    client = harness.coordination
    if client is not None and client.session_state is not SessionState.LOST:
        return
    if client is not None:
        await client.close()
    harness.coordination = coordination_from_uri(
        harness.coordination_uri, {"session_timeout": harness.session_timeout}
    )
    await harness.coordination.start()
    harness.metadata = ClusterAdmin(harness.coordination)
    if moves.watch is not None:
        moves.watch.cancel()
    moves.watch = await harness.metadata.watch_partition_assignment(0, moves)


outages: list[float] = []
"""How long ZooKeeper was down in each coordination-restart trial (its start-up)."""


async def trial(
    kind: str, harness: SystemHarness, zk: ZooKeeperServer, writer: SteadyWriter, moves: Moves
) -> tuple[float, float | None, float | None]:
    loop = asyncio.get_running_loop()
    await settle(harness, writer, moves)
    if kind == "storage-kill":
        victim = (await harness.replica_indexes(0))[0]
        t0 = loop.time()
        await harness.kill_storage_node(victim)
        await asyncio.sleep(3.0)
        await harness.restart_storage_node(victim)
    elif kind == "owner-kill":
        victim = await owner_index(harness)
        t0 = loop.time()
        await harness.kill_server(victim)
        await asyncio.sleep(FAULT_LENGTH)
        await harness.restart_server(victim)
    elif kind == "owner-stop":
        victim = await owner_index(harness)
        t0 = loop.time()
        _signal_server(harness, victim, signal.SIGSTOP)
        try:
            await asyncio.sleep(FAULT_LENGTH)
        finally:
            _signal_server(harness, victim, signal.SIGCONT)
    else:
        t0 = loop.time()
        await asyncio.to_thread(zk.kill)
        await asyncio.to_thread(zk.start)
        outages.append(loop.time() - t0)
    await asyncio.sleep(max(0.0, t0 + WINDOW_AFTER - loop.time()))
    gap = writer.longest_gap(t0 - WINDOW_BEFORE, t0 + WINDOW_AFTER)
    first = writer.first_after(t0)
    moved = moves.first_after(t0) if kind.startswith("owner") else None
    return gap, first, moved


def _fmt(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    missing = len(values) - len(known)
    if not known:
        return "      -         -   "
    text = f"p50 {statistics.median(known):5.2f} s  max {max(known):5.2f} s"
    return text + (f" ({missing} none)" if missing else "")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--interval", type=float, default=0.01)
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="waltz-failover-") as tmp, ZooKeeperServer() as zk:
        harness = SystemHarness(
            name="failover",
            coordination_uri=zk.uri(f"/failover-{os.getpid()}"),
            transport="zmq",
            storage_engine="fs",
            processes=True,
            workdir=Path(tmp),
            session_timeout=10.0,  # the coordination plugins' default
        )
        started = time.perf_counter()
        await harness.start()
        print(f"cluster up in {time.perf_counter() - started:.1f} s (zk, 3 storage, 2 servers)")
        assert harness.metadata is not None
        moves = Moves()
        moves.watch = await harness.metadata.watch_partition_assignment(0, moves)
        config = ClientConfig(harness.coordination_uri, transport="zmq")
        try:
            async with AsyncWaltzClient(Feed(), config) as client:
                writer = SteadyWriter(client, args.interval)
                writer.start()
                await settle(harness, writer, moves, 5.0)
                now = time_now()
                reference = writer.longest_gap(now - 5.0, now)
                print(
                    f"reference: longest gap between commits over a quiet 5 s: "
                    f"{reference * 1000:.0f} ms ({len(writer.commits)} commits so far)"
                )
                print(
                    f"{'fault':22} {'longest gap':34} {'first commit after':34} "
                    "partition moved after"
                )
                for kind in kinds:
                    results = []
                    for number in range(args.trials):
                        result = await trial(kind, harness, zk, writer, moves)
                        results.append(result)
                        gap, first, moved = result
                        logging.getLogger("bench").warning(
                            "%s trial %d: gap %.2f s, first %s, moved %s",
                            kind,
                            number,
                            gap,
                            "-" if first is None else f"{first:.2f} s",
                            "-" if moved is None else f"{moved:.2f} s",
                        )
                    print(
                        f"{kind:22} {_fmt([r[0] for r in results]):34} "
                        f"{_fmt([r[1] for r in results]):34} "
                        f"{_fmt([r[2] for r in results]) if kind.startswith('owner') else '-'}"
                    )
                await writer.stop()
                if outages:
                    print(
                        "ZooKeeper down (kill -9 to serving again) per coordination-restart "
                        f"trial: {', '.join(f'{o:.1f}' for o in outages)} s"
                    )
                if writer.failures:
                    print(f"{len(writer.failures)} submissions failed, e.g. {writer.failures[:3]}")
        finally:
            if moves.watch is not None:
                moves.watch.cancel()
            await harness.close()


if __name__ == "__main__":
    asyncio.run(main())
