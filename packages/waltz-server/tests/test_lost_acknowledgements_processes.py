"""Issue 27 on real processes: a replica whose storage lost what it acknowledged rejoins a
store session, the owner dies before it caught up, and no acknowledged transaction may be
lost.

Three ``waltz storage`` processes on the fs engine (A, B, C), two ``waltz server``
processes, the local coordination, ZeroMQ, one partition. C's node runs through
``slow_sync.py``: once the cluster is up its disk turns slow (every fdatasync and fsync
1.5 s longer), so C stays connected but lags far behind, and A and B acknowledge what
commits. Clients of the client library (``AsyncWaltzClient``) commit all along, and
every transaction acknowledged to them is counted with its id and data. Then A's
storage node is killed and loses what it acknowledged: the tail of its segment is cut
and left damaged (its engine reports LOST_SESSION at start-up), or its data directory is
wiped (a new disk). A restarts; the owner logs that A rejoins its store session and is
killed -9 at once, before A caught up, and C's disk is fast again (so the next recovery
hears from every replica at once, not from C seconds after A caught up). Once the
partition moved and recovered, the whole log is read back: every acknowledged
transaction must be in it, at its id, exactly once, with its data.

Before the fix of issue 27 the rejoin cleared A's LOST_SESSION (its marks rewritten by
the session), the next recovery counted A as a clean voter, and closed the session at
the log end of A or C, truncating B below acknowledged transactions.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from process_support import DEADLINE, Writers, library_client

from waltz_conformance.suites.system.clients import read_log
from waltz_conformance.suites.system.harness import SystemHarness, wait_for
from waltz_conformance.suites.system.members import (
    Member,
    ServerProcessMember,
    StorageProcessMember,
)
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools

pytestmark = [pytest.mark.timeout(300), pytest.mark.system, pytest.mark.slow]

PARTITION = 0
A, B, C = 0, 1, 2
SLOW_SYNC = Path(__file__).with_name("slow_sync.py")
SYNC_DELAY = 1.5
"""Seconds added to every fdatasync and fsync of C's storage node."""
WRITERS = 16
MIN_ACKED = 1500
"""Acknowledged transactions before A is stopped."""
MIN_LAG = 600
"""How far C's log must be behind the highest acknowledged id before A is stopped."""
LOST_MARKER = "LOST until a store session starts here again"
"""What the fs engine logs at start-up when it found it lost records it acknowledged."""


class SlowReplica(SystemHarness):
    """The system harness, storage node C run through ``slow_sync.py``: its syncs are slow
    while the file :attr:`slow_flag` exists."""

    @property
    def slow_flag(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "c-disk-is-slow"

    def _make_storage(self, index: int) -> Member:
        member = super()._make_storage(index)
        if index == C:
            assert isinstance(member, StorageProcessMember)
            member.process.wrap = [
                sys.executable,
                str(SLOW_SYNC),
                str(self.slow_flag),
                str(SYNC_DELAY),
            ]
        return member


def damage_tail(data_dir: Path) -> None:
    """Cut the second half of the newest segment of the partition (at a record's end) and
    damage the record before the cut: not the shape of a torn write, so the engine moves
    it aside at start-up and reports LOST_SESSION (it may have acknowledged what it
    lost)."""
    (report,) = [p for p in tools.verify(data_dir).partitions if p.partition_id == PARTITION]
    pdir = data_dir / str(PARTITION)
    newest = tools.segment_firsts(pdir)[-1]
    keep = (newest + report.max_transaction_id) // 2
    assert newest < keep < report.max_transaction_id, (newest, report)
    path, start, end = tools.find_record(data_dir, PARTITION, keep)
    assert path == pdir / fmt.segment_file_name(newest, fmt.SEGMENT_SUFFIX)
    with path.open("r+b") as f:
        f.truncate(end)
        f.seek(start + fmt.RECORD_HEAD.size + 1)  # in its data: its checksum fails
        byte = f.read(1)
        f.seek(start + fmt.RECORD_HEAD.size + 1)
        f.write(bytes([byte[0] ^ 0xFF]))


async def kill_owner_on_rejoin(
    server: ServerProcessMember, node: str, offset: int, slow_flag: Path
) -> str:
    """Tail the owner's log from ``offset``; kill it -9 as soon as it logs that ``node``
    rejoins its store session, then make C's disk fast again. Returns the line."""
    pattern = re.compile(rf"[^\n]*replica {re.escape(node)} rejoins at -?\d+")
    deadline = time.monotonic() + DEADLINE
    with server.process.log_path.open("rb") as log_file:
        log_file.seek(offset)
        text = ""
        while True:
            text += log_file.read().decode(errors="replace")
            found = pattern.search(text)
            if found:
                server.process.kill()
                await asyncio.to_thread(slow_flag.unlink)
                return found.group(0)
            if not server.alive:
                raise AssertionError(f"the owner exited before A rejoined: {text[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the owner never logged that {node} rejoins: {text[-3000:]}")
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("loss", ["damaged tail", "wiped disk"])
async def test_no_acknowledged_transaction_is_lost_when_the_owner_dies_as_a_replica_rejoins(
    tmp_path: Path, loss: str
) -> None:
    harness = SlowReplica.of_processes(
        tmp_path,
        "issue27",
        num_servers=2,
        # small storage appends: C, its syncs slow, receives few records per sync
        server_settings={"max_batch_records": 32},
    )
    started = time.monotonic()
    await harness.start()
    client = library_client(harness, PARTITION)
    writers = Writers(client, PARTITION, WRITERS, lambda w, n: f"writer-{w}-{n}|".encode() * 4)
    watcher: asyncio.Task[str] | None = None
    try:
        await client.start()
        writers.start()
        harness.slow_flag.touch()  # C's disk is slow from now on
        c_end = -1

        async def lagging() -> bool:
            nonlocal c_end
            if len(writers.acked) < MIN_ACKED:
                return False
            # (slow: C's node answers between syncs)
            c_end = await harness.replica_end(C, PARTITION)
            return c_end < writers.highest - MIN_LAG

        await wait_for(lagging, DEADLINE, f"{MIN_ACKED} commits with C {MIN_LAG} behind")

        # A's node stops and loses what it acknowledged
        server_id, _, generation = await harness.owner(PARTITION)
        owner = harness.servers[harness.server_index(server_id)]
        assert isinstance(owner, ServerProcessMember)
        offset = owner.process.log_path.stat().st_size
        await harness.kill_storage_node(A)
        if loss == "damaged tail":
            await asyncio.to_thread(damage_tail, tmp_path / f"data{A}")
        else:
            harness.wipe_storage(A)
        acked_before = dict(writers.acked)
        watcher = asyncio.create_task(
            kill_owner_on_rejoin(owner, harness.storage_nodes[A], offset, harness.slow_flag)
        )
        await harness.restart_storage_node(A)
        rejoin = await asyncio.wait_for(watcher, DEADLINE)
        killed_at = time.monotonic()
        if loss == "damaged tail":
            assert LOST_MARKER in (tmp_path / f"storage{A}.log").read_text()

        # the partition moves; its new owner recovers and serves it
        await harness.wait_moved(PARTITION, server_id, generation)

        async def resumed() -> bool:
            # (a client told the log lost what it applied commits no more: judged below)
            ahead = writers.errors["ClientAheadError"] > 0
            return ahead or any(t >= killed_at for t in writers.acked_at.values())

        await wait_for(resumed, DEADLINE, "a commit after the owner's kill")
        await writers.stop()
        log = await read_log(harness, PARTITION)
    finally:
        try:
            writers.stopping = True
            tasks: list[asyncio.Task[Any]] = [*writers.tasks]
            tasks += [watcher] if watcher is not None else []
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await client.close()
        finally:
            await harness.close()  # every process it started, by pid

    assert [r.transaction_id for r in log] == list(range(len(log)))
    copies = Counter(r.data for r in log)
    lost = sorted(t for t, data in writers.acked.items() if t >= len(log) or log[t].data != data)
    duplicated = sorted(t for t, data in writers.acked.items() if copies[data] > 1)
    lost_before = [t for t in lost if t in acked_before]
    assert not lost and not duplicated and not writers.acked_twice, (
        f"{len(lost)} of {len(writers.acked)} acknowledged transactions lost "
        f"({len(lost_before)} of them acknowledged before A stopped; ids "
        f"{lost[:3]}..{lost[-3:]}), {len(duplicated)} duplicated, ids acknowledged "
        f"twice {writers.acked_twice[:5]}; the log ends at {len(log) - 1}, C's at "
        f"{c_end} before A stopped; the owner logged "
        f"{rejoin!r}; client errors {dict(writers.errors)}"
    )
    assert any(t >= killed_at for t in writers.acked_at.values()), (
        f"no commit after the owner's kill; client errors {dict(writers.errors)}"
    )
    sys.stdout.write(
        f"\n{loss}: {len(writers.acked)} acknowledged, none lost; C at {c_end} of "
        f"{max(acked_before)} when A stopped; {time.monotonic() - started:.0f} s\n"
    )
