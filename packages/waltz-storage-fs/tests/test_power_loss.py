"""Power loss at every step: nothing acknowledged is ever lost.

The real fs engine runs a workload (create, add partitions, concurrent appends
across segment rolls and index checkpoints, session info updates, availability,
a truncation, a close and a reopen, and the migration of a format-1 directory)
on :class:`~waltz_storage_fs.powerloss.PowerLossFiles`, which snapshots what the
disk would hold after each write, flush, rename or unlink. For every step and
every crash state (only what completed flushes covered; everything written;
the last pending write torn either way; file contents and directory entries
out of step) the real engine opens the state from real files and the test
checks: every acknowledged record, session info and availability survives;
every record present is one that was appended (never garbage); power loss never
looks like damage (no hole, no lost tail); the control file always has a valid
struct for every hosted partition.

``WALTZ_POWER_LOSS_ROUNDS=<n>`` runs the workload n times with more records
(the CI run is one round).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fsutil import CrashState, CrashStates, new_engine, open_or_fail, preloaded
from test_format_compat import V1

from waltz_api.types import LOST_SESSION, NO_SESSION, Record, SessionInfo
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.powerloss import PowerLossFiles, Snapshot

pytestmark = pytest.mark.timeout(900)

KEY = uuid.UUID("7c2e4b1a-9d3f-4e6a-b5c8-1f0a2d3e4b5c")
OPTIONS = {"segment_size": 700, "index_checkpoint_interval": 3}
ROUNDS = int(os.environ.get("WALTZ_POWER_LOSS_ROUNDS", "1"))


def data(transaction_id: int, partition_id: int, epoch: int) -> bytes:
    return f"e{epoch}-p{partition_id}-t{transaction_id}|".encode() * (1 + transaction_id % 3)


def record(transaction_id: int, partition_id: int, epoch: int = 1) -> Record:
    return make_record(transaction_id, partition_id, data(transaction_id, partition_id, epoch))


@dataclass
class Model:
    """What the workload was told: each fact with the step at which it was acknowledged."""

    partitions: dict[int, int] = field(default_factory=dict)
    """partition -> step at which add_partition returned."""
    records: dict[tuple[int, int], list[tuple[int, Record]]] = field(default_factory=dict)
    """(partition, id) -> [(ack step, record)] in the order appended."""
    infos: dict[int, list[tuple[int, SessionInfo]]] = field(default_factory=dict)
    """partition -> [(ack step or -1 while in flight, info)]."""
    availability: dict[int, list[tuple[int, bool]]] = field(default_factory=dict)
    truncations: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    """partition -> [(start step, ack step, kept up to)]."""


JOURNAL_OPTIONS = {**OPTIONS, "journal_size": 4096, "checkpoint_bytes": 1500}
"""At level 3: a journal that wraps and checkpoints several times in the workload."""


class Workload:
    def __init__(
        self,
        files: PowerLossFiles,
        location: Path,
        rounds: int,
        *,
        level: int | None = None,
        options: dict[str, int] = OPTIONS,
    ) -> None:
        self.files = files
        self.location = location
        self.rounds = rounds
        self.level = level
        self.options = options
        self.model = Model()

    def now(self) -> int:
        return self.files.step

    async def open(self) -> FsStorageEngine:
        return await FsStorageEngine.open(
            str(self.location),
            cluster_key=KEY,
            num_partitions=3,
            options=self.options,
            feature_level=self.level,
            files=self.files,
        )

    async def append(self, engine: FsStorageEngine, pid: int, records: list[Record]) -> None:
        await engine.partition(pid).append(records)
        step = self.now()
        for r in records:
            self.model.records.setdefault((pid, r.transaction_id), []).append((step, r))

    async def set_info(self, engine: FsStorageEngine, pid: int, info: SessionInfo) -> None:
        infos = self.model.infos.setdefault(pid, [])
        infos.append((-1, info))
        await engine.partition(pid).set_session_info(info)
        infos[-1] = (self.now(), info)

    async def set_available(self, engine: FsStorageEngine, pid: int, available: bool) -> None:
        states = self.model.availability.setdefault(pid, [])
        states.append((-1, available))
        await engine.partition(pid).set_available(available)
        states[-1] = (self.now(), available)

    async def run(self) -> None:
        engine = await self.open()
        for pid in (0, 1):
            await engine.add_partition(pid)
            self.model.partitions[pid] = self.now()
        n = 20 * self.rounds

        async def writer(pid: int, start: int, stop: int, batch: int, epoch: int = 1) -> None:
            for first in range(start, stop, batch):
                ids = range(first, min(first + batch, stop))
                await self.append(engine, pid, [record(t, pid, epoch) for t in ids])

        await asyncio.gather(writer(0, 0, n, 2), writer(1, 0, n // 2, 1))
        await self.set_info(engine, 0, SessionInfo(1, n - 1, n - 1, 1))
        await self.set_available(engine, 1, False)
        await asyncio.gather(writer(0, n, 2 * n, 3), self.set_info(engine, 1, SessionInfo(4, 2, 1)))
        started = self.now()
        await engine.partition(0).truncate(n + 1)
        self.model.truncations.setdefault(0, []).append((started, self.now(), n + 1))
        await writer(0, n + 2, n + 8, 2, epoch=2)
        await self.set_available(engine, 1, True)
        await self.set_info(engine, 0, SessionInfo(2, n + 7, n + 7, 2))
        await engine.close()
        engine = await self.open()  # recovery's own steps are crash points too
        await writer(0, n + 8, n + 10, 1, epoch=2)
        await engine.close()


@dataclass
class Checked:
    states: int = 0
    distinct: int = 0
    quarantined: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


async def check_state(
    crash: CrashState, model: Model, *, options: dict[str, int] = OPTIONS
) -> str | None:
    """Open one crash state with the real engine; the first broken promise, or None."""
    where, step = crash.where, crash.snapshot.step
    storage = crash.storage
    if not (storage / fmt.CONTROL_FILE_NAME).exists():
        if model.partitions and min(model.partitions.values()) <= step:
            return f"{where}: the control file is gone after partitions were added"
        return None
    dump = tools.read_control_file(storage)
    for pid, added in model.partitions.items():
        if added <= step and dump.partitions[pid].current is None:
            return f"{where}: both structs of partition {pid} are invalid"
    try:
        engine = await FsStorageEngine.open(str(storage), options=options)
    except Exception as exc:
        return f"{where}: the engine does not open: {exc!r}"
    try:
        return await _check_engine(engine, step, where, model)
    finally:
        await engine.close()


async def _check_engine(engine: FsStorageEngine, step: int, where: str, model: Model) -> str | None:
    for pid, added in model.partitions.items():
        if added > step:
            continue
        try:
            part = engine.partition(pid)
        except Exception as exc:
            return f"{where}: partition {pid} does not open: {exc!r}"
        if part.missing_ranges():
            return f"{where}: partition {pid} has holes {part.missing_ranges()}"
        info = part.session_info()
        if info.low_water_mark_session_id not in (NO_SESSION, *range(0, 100)):
            return f"{where}: partition {pid} looks damaged: {info}"
        infos = model.infos.get(pid, [])
        acked = [i for s, i in infos if 0 <= s <= step]
        allowed = [acked[-1] if acked else SessionInfo()]
        allowed += [i for s, i in infos[len(acked) : len(acked) + 1]]
        if info not in allowed:
            return f"{where}: partition {pid} session info {info}, expected one of {allowed}"
        states = model.availability.get(pid, [])
        acked_a = [a for s, a in states if 0 <= s <= step]
        allowed_a = {acked_a[-1] if acked_a else True}
        allowed_a |= {a for s, a in states[len(acked_a) : len(acked_a) + 1]}
        if part.available() not in allowed_a:
            return f"{where}: partition {pid} availability {part.available()}"
        present = await part.read_records(0, 10_000, 1 << 30)
        if [r.transaction_id for r in present] != list(range(part.max_transaction_id() + 1)):
            return f"{where}: partition {pid} reads back {len(present)} records, not dense"
        truncations = model.truncations.get(pid, [])
        truncated_at = max((kept for _, s, kept in truncations if s <= step), default=None)
        # a truncation under way may have removed any of the records after it
        cutting = [kept for start, s, kept in truncations if start < step < s]
        for (p, txid), versions in model.records.items():
            if p != pid:
                continue
            must = [r for s, r in versions if s <= step]
            if truncated_at is not None and txid > truncated_at:
                # only what was appended after the acknowledged truncation counts
                must = [r for r in must if r.data.startswith(b"e2")]
            got = present[txid] if txid < len(present) else None
            if got is None and any(txid > kept for kept in cutting):
                continue
            if must and got != must[-1]:
                return f"{where}: partition {pid} lost acknowledged transaction {txid}: {got}"
            if got is not None and got not in [r for _, r in versions]:
                return f"{where}: partition {pid} transaction {txid} is garbage: {got}"
    return None


async def crash_everywhere(
    crash_states: Path,
    snapshots: list[Snapshot],
    model: Model,
    checked: Checked,
    *,
    options: dict[str, int] = OPTIONS,
) -> None:
    crashes = CrashStates(snapshots, crash_states)
    for crash in crashes:
        failure = await check_state(crash, model, options=options)
        if failure is not None:
            checked.failures.append(failure)
        for entry in tools.list_quarantine(crash.storage):
            checked.quarantined.append(f"{crash.name}: {entry.folder.name}")
        shutil.rmtree(crash.directory)
        if len(checked.failures) >= 5:
            break
    checked.states += crashes.states
    checked.distinct += crashes.distinct


def recorder(snapshots: list[Snapshot]) -> Callable[[Snapshot], None]:
    return snapshots.append


@pytest.mark.parametrize("journal", [False, True], ids=["format-3", "journal"])
async def test_power_loss_at_every_step_of_a_workload(
    tmp_path: Path, crash_states: Path, journal: bool, request: pytest.FixtureRequest
) -> None:
    """At level 3 (``journal``) every round of both partitions is one journal entry and
    one flush: a crash at each point of a shared round, of a checkpoint (the journal
    wraps several times) and of the replay at the next open loses nothing acknowledged."""
    snapshots: list[Snapshot] = []
    base = tmp_path / "sim"
    files = PowerLossFiles(base, on_step=recorder(snapshots))
    options = JOURNAL_OPTIONS if journal else OPTIONS
    level = request.getfixturevalue("journal_level") if journal else None
    workload = Workload(files, base / "storage", ROUNDS, level=level, options=options)
    await workload.run()
    assert len(snapshots) > 150, "the workload made too few steps to be a test"
    checked = Checked()
    await crash_everywhere(crash_states, snapshots, workload.model, checked, options=options)
    reasons = sorted(
        {q.split(": ", 1)[0] + ": " + q.split("Z-", 1)[-1] for q in checked.quarantined}
    )
    sys.stderr.write(
        f"\n{len(snapshots)} steps, {checked.states} crash states, {checked.distinct} distinct "
        f"opened; quarantine folders made: {reasons}\n"
    )
    assert not checked.failures, "\n".join(checked.failures)


async def test_power_loss_while_a_format_1_directory_is_migrated(
    tmp_path: Path, crash_states: Path
) -> None:
    snapshots: list[Snapshot] = []
    base = tmp_path / "sim"
    files = preloaded(base, V1)
    files.on_step = recorder(snapshots)
    engine = await FsStorageEngine.open(
        str(base / "storage"), options={"segment_size": 600}, files=files
    )
    await engine.close()
    assert any("rename" in s.operation for s in snapshots)
    expected = {0: [make_record(t, 0) for t in range(30)], 2: [make_record(t, 2) for t in range(5)]}
    failures: list[str] = []
    for crash in CrashStates(snapshots, crash_states):
        opened = await open_or_fail(crash, failures)
        if opened is None:
            continue
        try:
            for pid, records in expected.items():
                got = await opened.partition(pid).read_records(0, 100)
                if got != records:
                    failures.append(f"{crash.where}: partition {pid} reads back {len(got)}")
            if opened.partition(0).session_info() != SessionInfo(5, 27, 27):
                failures.append(f"{crash.where}: {opened.partition(0).session_info()}")
        finally:
            await opened.close()
        shutil.rmtree(crash.directory)
    assert not failures, "\n".join(failures[:5])


@dataclass
class PrefixModel:
    """What the prefix workload was told, each fact with its step."""

    appended: list[tuple[int, Record]] = field(default_factory=list)
    """(ack step, record), in the order appended."""
    drops: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(start step, ack step, through, start returned)."""
    truncations: list[tuple[int, int, int]] = field(default_factory=list)
    """(start step, ack step, kept up to)."""


async def test_power_loss_while_an_archived_prefix_is_dropped(
    tmp_path: Path, crash_states: Path
) -> None:
    """Drop a prefix (whole segments, then past the log's end), truncate below the start,
    append after it, reopen: at every crash point the log opens without a hole or a
    LOST mark, never starts above what a drop was asked to delete, keeps the start of
    every acknowledged drop, and holds every acknowledged record at or above its start."""
    snapshots: list[Snapshot] = []
    base = tmp_path / "sim"
    files = PowerLossFiles(base, on_step=recorder(snapshots))
    model = PrefixModel()
    location = str(base / "storage")
    engine, (part,) = await new_engine(location, KEY, 1, options=OPTIONS, files=files)

    async def append(ids: range, epoch: int = 1) -> None:
        for t in ids:
            await part.append([record(t, 0, epoch)])
            model.appended.append((files.step, record(t, 0, epoch)))

    async def drop(through: int) -> None:
        started = files.step
        start = await part.drop_prefix(through)
        model.drops.append((started, files.step, through, start))

    await append(range(0, 30))
    await drop(12)
    await append(range(30, 36))
    await drop(40)  # past the end: the log continues at 41
    await append(range(41, 45))
    started = files.step
    await part.truncate(38)  # below the start: empty, continues at 39
    model.truncations.append((started, files.step, 38))
    await append(range(39, 43), epoch=2)
    await engine.close()
    engine = await FsStorageEngine.open(location, options=OPTIONS, files=files)
    part = engine.partition(0)
    await append(range(43, 45), epoch=2)
    await drop(43)
    await engine.close()
    assert len(snapshots) > 60, "the workload made too few steps to be a test"

    def problem(opened: FsStorageEngine, step: int) -> str | None:
        p = opened.partition(0)
        if p.missing_ranges() or p.session_info().low_water_mark_session_id == LOST_SESSION:
            return f"damage reported: {p.missing_ranges()} {p.session_info()}"
        start = p.log_start()
        asked = max((t for s, _, t, _ in model.drops if s < step), default=-1)
        cut = [kept for s, _, kept in model.truncations if s < step]
        if start > asked + 1 and not any(start == kept + 1 for kept in cut):
            return f"the log starts at {start}, but no drop beyond {asked} was asked"
        done = [(a, got) for _, a, _, got in model.drops if a <= step]
        cutting = [s for s, _, _ in model.truncations if s < step]
        moved_back = bool(cutting) and cutting[-1] > (done[-1][0] if done else -1)
        if done and not moved_back and start < done[-1][1]:
            return f"the log starts at {start}, before acknowledged drop's {done[-1][1]}"
        return None

    failures: list[str] = []
    for crash in CrashStates(snapshots, crash_states):
        if not (crash.storage / fmt.CONTROL_FILE_NAME).exists():
            shutil.rmtree(crash.directory)
            continue
        opened = await open_or_fail(crash, failures, OPTIONS)
        if opened is None:
            continue
        try:
            if 0 not in opened.partition_ids():
                continue
            found = problem(opened, crash.snapshot.step)
            p = opened.partition(0)
            start, top = p.log_start(), p.max_transaction_id()
            present = await p.read_records(start, 1000, 1 << 30) if top >= start else []
            if [r.transaction_id for r in present] != list(range(start, top + 1)):
                found = found or f"reads back {len(present)} records from {start}, not dense"
            latest: dict[int, Record] = {}
            for acked, r in model.appended:
                if acked <= crash.snapshot.step:
                    latest[r.transaction_id] = r
            truncated = max(  # a truncation under way may have cut any record after it
                (k for s, _, k in model.truncations if s < crash.snapshot.step), default=None
            )
            for r in present:
                if r not in [x for _, x in model.appended]:
                    found = found or f"transaction {r.transaction_id} is garbage"
            for txid, r in latest.items():
                if txid < start or txid > top:
                    if txid > top and truncated is None:
                        found = found or f"lost acknowledged transaction {txid}"
                    continue
                if truncated is not None and txid > truncated and not r.data.startswith(b"e2"):
                    continue
                if present[txid - start] != r:
                    found = found or f"transaction {txid} is not the acknowledged one"
            if found:
                failures.append(f"{crash.where}: {found}")
        finally:
            await opened.close()
        shutil.rmtree(crash.directory)
    assert not failures, "\n".join(failures[:5])
