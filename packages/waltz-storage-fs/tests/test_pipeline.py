"""The committer's two stages: a group's control flush runs with the next group's data.

A group's appends are acknowledged once its data flush and then the control flush
covering its new ends completed (test_acked_end.py); the control flush of one group
and the data flush of the next are under way at once, so under sustained appends each
flush time carries one of each. An action (a truncation) runs once the appends before
it are acknowledged and nothing is under way; and an end staged after a truncation
never rises above the log it cut. Power loss at every step of pipelined appends never
loses an acknowledged record and never looks like damage.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import uuid
from pathlib import Path

import pytest
from fsutil import CrashStates, FailingFlush, acked_end, new_engine

from waltz_api.errors import PartitionClosedError
from waltz_api.types import LOST_SESSION, Record
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs.committer import Job, LoopRunner, ThreadRunner
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.files import Files
from waltz_storage_fs.powerloss import PowerLossFiles, Snapshot

pytestmark = pytest.mark.timeout(300)

FORMAT_3 = 2
"""The level whose commit round this module tests (control file format 3: the ends
flushed in the control file before an append is acknowledged)."""
KEY = uuid.UUID("5b0e8d2c-7a41-4f93-9c6e-1d2f3a4b5c6d")
OPTIONS = {"segment_size": 700, "index_checkpoint_interval": 3}
DEADLINE = 60.0
"""Seconds to wait for a thread's event (a slow, loaded machine is still far below)."""


async def settle() -> None:
    """Let every task that can run, run (no thread, no I/O: a few loop turns do it)."""
    for _ in range(100):
        await asyncio.sleep(0)


class Ticks:
    """A ``flush_wait`` on a clock of flush times: every flush requested waits for the
    next tick; a tick completes all of them at once (free until ``ticking``)."""

    def __init__(self) -> None:
        self.ticking = False
        self.waiting = 0
        self._tick = asyncio.Event()

    async def __call__(self) -> None:
        if not self.ticking:
            await asyncio.sleep(0)
            return
        self.waiting += 1
        await self._tick.wait()

    def tick(self) -> int:
        """Complete the flushes waiting; how many there were."""
        waiting, self.waiting = self.waiting, 0
        self._tick.set()
        self._tick = asyncio.Event()
        return waiting


class Counting(Files):
    """The real files; counts the flushes of the data files and of the control file."""

    def __init__(self) -> None:
        self.control_fd = -1
        self.data = 0
        self.control = 0

    def fdatasync(self, fd: int) -> None:
        super().fdatasync(fd)
        if fd == self.control_fd:
            self.control += 1
        else:
            self.data += 1


async def test_under_sustained_appends_a_flush_time_carries_a_data_and_a_control_flush(
    tmp_path: Path,
) -> None:
    """One batch arrives per flush time: each is acknowledged two flush times after it
    arrived (its data's, then the control file's, with the next batch's data), every
    flush time but the first and last flushes both, and a batch costs one data flush
    and one control flush. (With the two flushes of a round in sequence, a batch that
    arrives while a round is on the disk waits for it: three flush times.)"""
    ticks = Ticks()
    files = Counting()
    engine, (part,) = await new_engine(
        tmp_path / "storage",
        KEY,
        1,
        feature_level=FORMAT_3,
        files=files,
        runner=LoopRunner(flush_wait=ticks),
    )
    files.control_fd = engine.control.fd
    observed: list[float] = []
    engine.fsync_observer = observed.append
    ticks.ticking = True
    batches = 12
    done_at: dict[int, int] = {}
    clock = [0]
    tasks = []
    per_tick: list[int] = []
    try:
        for batch in range(batches + 3):
            if batch < batches:
                task = asyncio.ensure_future(part.append([make_record(batch)]))
                task.add_done_callback(lambda _t, b=batch: done_at.setdefault(b, clock[0]))
                tasks.append(task)
            await settle()
            per_tick.append(ticks.tick())
            clock[0] += 1
            await settle()
        await asyncio.gather(*tasks)
        assert {b: done_at[b] - b for b in range(batches)} == dict.fromkeys(range(batches), 2)
        assert per_tick == [1] + [2] * (batches - 1) + [1, 0, 0]
        # a flush of the data files (at an index checkpoint, the index too) and one of
        # the control file per batch, each seen by the observer
        assert files.control == batches
        assert len(observed) == 2 * batches
        assert part.max_transaction_id() == batches - 1
    finally:
        ticks.ticking = False
        await engine.close()
    assert acked_end(tmp_path / "storage") == batches


class Holding(Files):
    """The real files; holds the data flushes while ``hold`` is set (each until the test
    releases it), and records the order of the flushes. The first control flush waits
    for the second data flush to be under way (up to a deadline: if it never comes,
    the flush goes on, recorded as alone)."""

    def __init__(self) -> None:
        self.control_fd = -1
        self.hold = False
        self.held = threading.Semaphore(0)
        self.release = threading.Semaphore(0)
        self.events: list[str] = []
        self._lock = threading.Lock()
        self._data_held = 0
        self._second_held = threading.Event()
        self._first_control = True

    def _event(self, event: str) -> None:
        with self._lock:
            self.events.append(event)

    def fdatasync(self, fd: int) -> None:
        if fd == self.control_fd:
            if self._first_control:
                self._first_control = False
                if not self._second_held.wait(DEADLINE):
                    self._event("control flush alone")
            self._event("control flush")
            super().fdatasync(fd)
            self._event("control flushed")
            return
        if self.hold:
            self._event("data held")
            self._data_held += 1
            if self._data_held == 2:
                self._second_held.set()
            self.held.release()
            if not self.release.acquire(timeout=DEADLINE):
                raise AssertionError("the test never released a held data flush")
        super().fdatasync(fd)
        self._event("data flushed")


async def acquired(semaphore: threading.Semaphore) -> None:
    """Wait (off the loop) for a thread's release, with a deadline."""
    ok = await asyncio.get_running_loop().run_in_executor(None, semaphore.acquire, True, DEADLINE)
    assert ok, "a flush never came"


async def test_a_groups_control_flush_runs_while_the_next_groups_data_is_flushed(
    tmp_path: Path,
) -> None:
    files = Holding()
    engine, (part,) = await new_engine(
        tmp_path / "storage", KEY, 1, feature_level=FORMAT_3, files=files, runner=ThreadRunner(2)
    )
    files.control_fd = engine.control.fd
    files.events.clear()
    files.hold = True
    try:
        first = asyncio.ensure_future(part.append([make_record(0)]))
        await acquired(files.held)  # the first group's data is on the disk
        second = asyncio.ensure_future(part.append([make_record(1), make_record(2)]))
        await settle()
        files.release.release()
        await acquired(files.held)  # the second group's data is on the disk
        # ... and meanwhile the first one is covered and acknowledged
        await asyncio.wait_for(asyncio.shield(first), DEADLINE)
        assert not second.done()
        files.hold = False
        files.release.release()
        await asyncio.wait_for(second, DEADLINE)
    finally:
        files.hold = False
        files.release.release()
        await engine.close()
    assert files.events == [
        "data held",
        "data flushed",
        "data held",  # the second group's data flush, under way ...
        "control flush",  # ... while the first one's end is flushed
        "control flushed",
        "data flushed",
        "control flush",
        "control flushed",
    ]
    assert acked_end(tmp_path / "storage") == 3


@pytest.mark.parametrize("failing", ["control", "data"])
async def test_a_failed_flush_fails_the_appends_it_was_for(tmp_path: Path, failing: str) -> None:
    """The first group (partition 0) is covered by the control flush that runs with the
    second group's data flush (partition 1): a failed control flush fails the first
    group and closes partition 0; a failed data flush the second, closing partition 1."""
    ticks = Ticks()
    files = FailingFlush()
    engine, parts = await new_engine(
        tmp_path / "storage",
        KEY,
        2,
        feature_level=FORMAT_3,
        files=files,
        runner=LoopRunner(flush_wait=ticks),
    )
    await parts[1].append([make_record(0, 1)])  # its segment exists: one data file to flush
    ticks.ticking = True
    try:
        first = asyncio.ensure_future(parts[0].append([make_record(0, 0)]))
        await settle()
        assert ticks.tick() == 1  # the first group's data
        await settle()
        second = asyncio.ensure_future(parts[1].append([make_record(1, 1)]))
        await settle()
        if failing == "control":
            files.fail.add(engine.control.fd)
        else:
            files.fail.add(parts[1]._segments[-1].data_fd)
        assert ticks.tick() == 2  # the first group's control flush, the second's data
        await settle()
        ticks.ticking = False
        ticks.tick()
        await settle()
        broken, fine = (first, second) if failing == "control" else (second, first)
        with pytest.raises(PartitionClosedError, match="I/O error"):
            await broken
        await fine
        closed = 0 if failing == "control" else 1
        with pytest.raises(PartitionClosedError):
            await parts[closed].append([make_record(2 - closed, closed)])
        await parts[1 - closed].append([make_record(2 - closed, 1 - closed)])
    finally:
        ticks.ticking = False
        await engine.close()


async def test_a_truncation_after_a_flush_keeps_a_later_end_below_the_cut(
    tmp_path: Path,
) -> None:
    """The race the committer's order rules out (an action runs only when nothing is
    under way), played by hand on the partition: a group flushed (its end not written
    yet), a truncation below it, records written after the cut and not flushed; the
    end written then is never the flushed group's (above the cut log: a power loss
    then would read the unflushed records' loss as a lost acknowledged tail)."""
    location = tmp_path / "storage"
    engine, (part,) = await new_engine(location, KEY, 1, feature_level=FORMAT_3, options=OPTIONS)
    await part.append([make_record(t) for t in range(10)])
    assert acked_end(location) == 10
    loop = asyncio.get_running_loop()

    def job(first: int, records: list[Record]) -> Job:
        blob, lengths = part._encode(records, first)
        return Job(loop.create_future(), part, blob, lengths, first)

    def race() -> None:
        flushes: set[tuple[int, int]] = set()
        part.write_batch(job(10, [make_record(t) for t in range(10, 15)]), flushes)
        for _, fd in flushes:
            engine.files.fdatasync(fd)
        part.note_flushed()  # a group flushed: durable to 15, its end not written yet
        part.truncate_now(11)  # the log ends at 12 now (the end, 10, stays)
        assert acked_end(location) == 10
        after = [make_record(t, data=b"after") for t in range(12, 14)]
        part.write_batch(job(12, after), set())  # not flushed
        assert part.stage_acked_end()
        engine.control.sync()
        # what is durable: up to 11; never 15, over records 12..14 not flushed
        assert acked_end(location) == 12

    await engine.run_committed(race)
    await engine.close()


async def test_an_action_runs_once_the_appends_before_it_are_acknowledged(
    tmp_path: Path,
) -> None:
    """Appends and a truncation queued at once: the truncation waits until the appends'
    end is flushed in the control file (then lowers it), and the appends after it wait
    for the truncation."""
    ticks = Ticks()
    files = Counting()
    location = tmp_path / "storage"
    engine, (part,) = await new_engine(
        location,
        KEY,
        1,
        feature_level=FORMAT_3,
        options=OPTIONS,
        files=files,
        runner=LoopRunner(flush_wait=ticks),
    )
    files.control_fd = engine.control.fd
    seen: list[tuple[str, int]] = []
    truncate_now = part.truncate_now

    def truncating(transaction_id: int) -> None:
        seen.append(("truncation starts, the end", acked_end(location)))
        truncate_now(transaction_id)

    part.truncate_now = truncating  # type: ignore[method-assign]
    ticks.ticking = True
    try:
        appends = [
            asyncio.ensure_future(part.append([make_record(t) for t in range(f, f + 2)]))
            for f in (0, 2, 4)
        ]
        truncation = asyncio.ensure_future(part.truncate(2))
        after = asyncio.ensure_future(part.append([make_record(3, data=b"after")]))
        while not after.done():
            await settle()
            ticks.tick()
        await asyncio.gather(*appends, truncation, after)
    finally:
        ticks.ticking = False
        await engine.close()
    assert seen == [("truncation starts, the end", 6)]
    assert acked_end(location) == 4
    engine = await FsStorageEngine.open(str(location), options=OPTIONS)
    try:
        records = await engine.partition(0).read_records(0, 100)
        assert [r.data for r in records] == [make_record(t).data for t in range(3)] + [b"after"]
    finally:
        await engine.close()


async def test_power_loss_at_every_step_of_pipelined_appends(
    tmp_path: Path, crash_states: Path
) -> None:
    """Appends to two partitions arriving while flushes are under way (each flush time
    carries a group's data and the control flush of the one before), then a truncation
    and more appends; a crash state at every step: every acknowledged record is there,
    every record there is one appended, and nothing looks damaged (no LOST, no hole)."""
    snapshots: list[Snapshot] = []
    base = tmp_path / "sim"
    files = PowerLossFiles(base, on_step=snapshots.append)
    ticks = Ticks()
    location = str(base / "storage")
    _engine, parts = await new_engine(  # never closed: the process dies
        location,
        KEY,
        2,
        feature_level=FORMAT_3,
        options=OPTIONS,
        files=files,
        runner=LoopRunner(flush_wait=ticks),
    )
    acked: dict[tuple[int, int], tuple[int, bytes]] = {}
    """(partition, id) -> (step acknowledged, data)."""
    appended: set[tuple[int, int, bytes]] = set()
    tasks: list[asyncio.Future[None]] = []

    def append(pid: int, first: int, count: int, tag: bytes) -> None:
        records = [
            make_record(t, pid, data=tag + b"%d-%d|" % (pid, t) * (1 + t % 3))
            for t in range(first, first + count)
        ]
        appended.update((pid, r.transaction_id, r.data) for r in records)

        def done(task: asyncio.Future[None]) -> None:
            if task.exception() is None:
                for r in records:
                    acked[(pid, r.transaction_id)] = (files.step, r.data)

        task = asyncio.ensure_future(parts[pid].append(records))
        task.add_done_callback(done)
        tasks.append(task)

    ticks.ticking = True
    both = 0
    try:
        for wave in range(8):
            append(0, 2 * wave, 2, b"a")
            if wave % 2 == 0:
                append(1, wave // 2, 1, b"a")
            await settle()
            both += ticks.tick() == 2
            await settle()
        while not all(task.done() for task in tasks):
            ticks.tick()
            await settle()
        await asyncio.gather(*tasks)
        assert both >= 6, "the flushes were not pipelined: not the case this test is for"
        ticks.ticking = False
        truncating = files.step
        await parts[0].truncate(9)
        ticks.ticking = True
        for wave in range(3):
            append(0, 10 + 2 * wave, 2, b"b")
            await settle()
            ticks.tick()
            await settle()
        while not all(task.done() for task in tasks):
            ticks.tick()
            await settle()
        await asyncio.gather(*tasks)
    finally:
        ticks.ticking = False
    # no close: the process dies here
    assert len(snapshots) > 100
    failures: list[str] = []
    for crash in CrashStates(snapshots, crash_states):
        where, at = crash.where, crash.snapshot.step
        if not (crash.storage / "waltz-storage.ctl").exists():
            shutil.rmtree(crash.directory)
            continue
        opened = await FsStorageEngine.open(str(crash.storage), options=OPTIONS)
        try:
            for pid in opened.partition_ids():
                p = opened.partition(pid)
                if p.session_info().low_water_mark_session_id == LOST_SESSION:
                    failures.append(f"{where}: partition {pid} is LOST")
                if p.missing_ranges():
                    failures.append(f"{where}: partition {pid} has holes")
                present = await p.read_records(0, 1000)
                for r in present:
                    if (pid, r.transaction_id, r.data) not in appended:
                        failures.append(f"{where}: {pid}/{r.transaction_id} is garbage")
                by_id = {r.transaction_id: r.data for r in present}
                for (apid, txid), (step, data) in acked.items():
                    if apid != pid or step > at:
                        continue
                    cut = pid == 0 and txid > 9 and truncating <= at
                    if cut and data.startswith(b"a"):
                        continue  # cut by the truncation (under way or done)
                    if by_id.get(txid) != data:
                        failures.append(f"{where}: acknowledged {pid}/{txid} lost")
        finally:
            await opened.close()
        shutil.rmtree(crash.directory)
        if len(failures) >= 5:
            break
    assert not failures, "\n".join(failures)


class ControlGate(Files):
    """The real files; each control flush waits until the test releases it (signalling
    that it began), each data flush signals that it ended."""

    def __init__(self) -> None:
        self.control_fd = -1
        self.control_began = threading.Semaphore(0)
        self.control_release = threading.Semaphore(0)
        self.data_flushed = threading.Semaphore(0)

    def fdatasync(self, fd: int) -> None:
        if fd == self.control_fd:
            self.control_began.release()
            if not self.control_release.acquire(timeout=DEADLINE):
                raise AssertionError("the test never released a control flush")
        super().fdatasync(fd)
        if self.control_fd >= 0 and fd != self.control_fd:  # not the engine's set-up
            self.data_flushed.release()


async def test_under_load_a_group_starts_while_the_control_file_is_flushed_alone(
    tmp_path: Path,
) -> None:
    """ThreadRunner: at low load the committer flushes the control file itself (one
    thread hop less); once appends came during such a flush, the next one alone runs
    in a flusher thread and a group coming meanwhile has its data flushed at once."""
    files = ControlGate()
    engine, (part,) = await new_engine(
        tmp_path / "storage", KEY, 1, feature_level=FORMAT_3, files=files, runner=ThreadRunner(2)
    )
    files.control_fd = engine.control.fd
    try:
        first = asyncio.ensure_future(part.append([make_record(0)]))
        await acquired(files.data_flushed)
        await acquired(files.control_began)  # the first one's, alone
        second = asyncio.ensure_future(part.append([make_record(1)]))  # comes meanwhile
        await settle()
        files.control_release.release()
        await asyncio.wait_for(first, DEADLINE)
        await acquired(files.data_flushed)  # the second one's data, after it
        await acquired(files.control_began)  # the second one's control flush, alone
        third = asyncio.ensure_future(part.append([make_record(2)]))
        await acquired(files.data_flushed)  # the third one's data, meanwhile
        assert not second.done()
        files.control_release.release()
        await asyncio.wait_for(second, DEADLINE)
        await acquired(files.control_began)
        files.control_release.release()
        await asyncio.wait_for(third, DEADLINE)
    finally:
        for _ in range(3):
            files.control_release.release()
        await engine.close()
    assert acked_end(tmp_path / "storage") == 3
