"""The StorageEngine conformance suite.

(Above 800 lines on purpose: the module is the harness, two small helpers and one
suite class whose tests are the contract's checklist in the contract's order; split, a
reader would lose that order, and a plugin author imports one module.)

A backend author subclasses :class:`StorageSuite` and provides a ``harness``
fixture returning a :class:`StorageHarness` (or a subclass of it)::

    class TestMyStorage(StorageSuite):
        @pytest.fixture
        def harness(self, tmp_path: Path) -> StorageHarness:
            return StorageHarness(
                name="mine", engine_class=MyEngine, root=tmp_path,
                capabilities={"reopen"},
            )

Capabilities (declared by the harness, never guessed):

- ``reopen``: an engine closed and opened again at the same location sees
  everything that was stored.
- ``crash_reopen``: a writer process killed with SIGKILL loses nothing it
  was acknowledged (:meth:`StorageHarness.kill_writer_midway`). The harness
  needs ``engine_ref`` ("module:Class") so the writer subprocess can open the
  engine, or overrides :meth:`StorageHarness.writer_command`.
- ``file_faults``: the harness can find records on disk and damage files
  (:meth:`StorageHarness.record_extent`, :meth:`StorageHarness.index_files`,
  :meth:`StorageHarness.data_files`, :meth:`StorageHarness.metadata_files`,
  :meth:`StorageHarness.stray_names`, :meth:`StorageHarness.tear_session_info`):
  cut files at every byte offset, flip bits, tear a session info struct, and
  the seeded damage sweep (:mod:`waltz_conformance.suites.storage_damage`:
  truncations, bit flips, zeroed sectors and pages, stray, duplicated and
  foreign files; ``--waltz-damage-variants N``, default 1000).
- ``segments``: the engine takes a ``segment_size`` option and splits the log
  into segments (:meth:`StorageHarness.segment_count`).
- ``repair``: start-up recovery keeps intact records after damaged ones and
  reports the damaged ones as ``missing_ranges``, which ``repair`` fills.
- ``availability``: the engine keeps a partition's availability
  (``set_available``) across a reopen.
- ``prefix``: the engine deletes an archived prefix of the log (``drop_prefix``),
  keeps the log's start (``log_start``) across a reopen, and never reports the
  deleted prefix as missing.
- ``scrub``: ``scrub`` reads back the sealed records while the engine runs; damage it
  finds becomes a missing range. Its test (with ``file_faults``, ``repair`` and
  ``segments``) damages a record through :meth:`StorageHarness.record_extent` while the
  engine is open: the engine must read its disk, not a copy of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import crc32c
import pytest
import pytest_asyncio

from waltz_api import wire
from waltz_api.contracts.storage import ScrubProgress, StorageEngine, StoragePartition
from waltz_api.errors import (
    ChecksumError,
    ClusterKeyMismatchError,
    CorruptionError,
    PartitionClosedError,
    PartitionNotFoundError,
    RecordsArchivedError,
    StorageAppendError,
    StorageError,
)
from waltz_api.features import MIN_FEATURE_LEVEL
from waltz_api.types import LOST_SESSION, Record, ReqId, SessionInfo
from waltz_conformance.harness import Harness, requires, skip_unless_capable
from waltz_conformance.records import make_record as make_record  # noqa: PLC0414 (re-exported)
from waltz_conformance.suites import storage_damage


@dataclass
class StorageHarness(Harness):
    """How the suite opens (and, with the capabilities, damages) a backend's storage."""

    engine_class: type[StorageEngine] | None = None
    root: Path = field(default_factory=Path)
    options: Mapping[str, Any] = field(default_factory=dict)
    engine_ref: str | None = None
    _counter: int = 0

    def new_location(self) -> str:
        self._counter += 1
        return str(self.root / f"storage-{self._counter}")

    async def open(
        self,
        location: str,
        *,
        cluster_key: uuid.UUID | None = None,
        num_partitions: int | None = None,
        options: Mapping[str, Any] | None = None,
        feature_level: int | None = None,
    ) -> StorageEngine:
        assert self.engine_class is not None, "the harness needs engine_class"
        merged = {**self.options, **(options or {})}
        if feature_level is None:  # an engine of an earlier release takes no such argument
            return await self.engine_class.open(
                location, cluster_key=cluster_key, num_partitions=num_partitions, options=merged
            )
        return await self.engine_class.open(
            location,
            cluster_key=cluster_key,
            num_partitions=num_partitions,
            options=merged,
            feature_level=feature_level,
        )

    # -- file_faults ---------------------------------------------------------------------

    def record_extent(
        self, location: str, partition_id: int, transaction_id: int
    ) -> tuple[Path, int, int]:
        """(file, start, end) of a stored record's bytes (the engine must be closed)."""
        raise NotImplementedError(f"{self.name}: record_extent needs 'file_faults'")

    def index_files(self, location: str, partition_id: int) -> list[Path]:
        """The partition's index files (which recovery rebuilds), oldest first."""
        raise NotImplementedError(f"{self.name}: index_files needs 'file_faults'")

    def tear_session_info(self, location: str, partition_id: int, which: str) -> None:
        """Damage the session info as a torn write would: ``which`` is ``"newest"``
        (the last one written) or ``"both"``."""
        raise NotImplementedError(f"{self.name}: tear_session_info needs 'file_faults'")

    def data_files(self, location: str, partition_id: int) -> list[Path]:
        """The files holding the partition's records, in log order (the sweep damages
        them)."""
        raise NotImplementedError(f"{self.name}: data_files needs 'file_faults'")

    def metadata_files(self, location: str) -> list[Path]:
        """Files the engine reads at open that hold no record (a control file)."""
        raise NotImplementedError(f"{self.name}: metadata_files needs 'file_faults'")

    def stray_names(self, location: str, partition_id: int) -> list[Path]:
        """Free paths where the engine would take an extra file for one of the partition's
        (before, between and after its own): the sweep puts stray, duplicated and
        foreign files there."""
        raise NotImplementedError(f"{self.name}: stray_names needs 'file_faults'")

    def copy_location(self, source: str, target: str) -> None:
        shutil.copytree(source, target)

    def scratch(self) -> StorageHarness:
        """The harness for the damage sweep's many short-lived copies (a harness may put
        them on a faster file system, such as a tmpfs); this default is itself."""
        return self

    # -- crash_reopen ----------------------------------------------------------------------

    def writer_command(
        self,
        location: str,
        cluster_key: uuid.UUID,
        num_partitions: int,
        partitions: list[int],
        *,
        batch: int = 5,
        sessions: bool = False,
    ) -> list[str]:
        """The command of the writer process (override to run it elsewhere)."""
        assert self.engine_ref, f"{self.name}: crash_reopen needs the harness's engine_ref"
        command = [
            sys.executable,
            "-m",
            "waltz_conformance.suites._storage_writer",
            "--engine",
            self.engine_ref,
            "--location",
            location,
            "--cluster-key",
            str(cluster_key),
            "--num-partitions",
            str(num_partitions),
            "--options",
            json.dumps(dict(self.options)),
            "--batch",
            str(batch),
            "--partitions",
            *(str(p) for p in partitions),
        ]
        if sessions:
            command.append("--sessions")
        return command

    def kill_writer_midway(
        self,
        location: str,
        cluster_key: uuid.UUID,
        num_partitions: int,
        partitions: list[int],
        *,
        target: int,
        acked: dict[int, int],
        batch: int = 5,
        sessions: bool = False,
    ) -> None:
        """Run a writer process on the (closed) storage, let it acknowledge ``target``
        appends (or session updates), then SIGKILL it while it writes.

        ``acked`` gets the highest acknowledged id (or session id) per partition.
        Blocking: call it through ``asyncio.to_thread``."""
        command = self.writer_command(
            location, cluster_key, num_partitions, partitions, batch=batch, sessions=sessions
        )
        _run_writer_and_kill(command, target, acked)

    # -- segments -------------------------------------------------------------------------

    def segment_count(self, location: str, partition_id: int) -> int:
        raise NotImplementedError(f"{self.name}: segment_count needs 'segments'")


class Store:
    """One storage location under test: opens, reopens and finally closes its engines."""

    def __init__(self, harness: StorageHarness, num_partitions: int = 4) -> None:
        self.harness = harness
        self.location = harness.new_location()
        self.cluster_key = uuid.uuid4()
        self.num_partitions = num_partitions
        self.engine: StorageEngine | None = None
        self._opened: list[StorageEngine] = []

    async def open(
        self, location: str | None = None, *, feature_level: int | None = None, **options: Any
    ) -> StorageEngine:
        engine = await self.harness.open(
            location or self.location,
            cluster_key=self.cluster_key,
            num_partitions=self.num_partitions,
            options=options,
            feature_level=feature_level,
        )
        self._opened.append(engine)
        if location is None:
            self.engine = engine
        return engine

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()
            self.engine = None

    async def reopen(self, **options: Any) -> StorageEngine:
        await self.close()
        return await self.open(**options)

    async def close_all(self) -> None:
        for engine in self._opened:
            await engine.close()


async def append_range(
    engine: StorageEngine, partition_id: int, start: int, stop: int, batch: int = 1
) -> None:
    part = engine.partition(partition_id)
    for first in range(start, stop, batch):
        await part.append(
            [make_record(t, partition_id) for t in range(first, min(first + batch, stop))]
        )


async def assert_log(engine: StorageEngine, partition_id: int, last: int) -> None:
    """The partition holds exactly the records ``0..last`` made by :func:`make_record`."""
    part = engine.partition(partition_id)
    assert part.max_transaction_id() == last
    got: list[Record] = []
    while len(got) <= last:
        chunk = await part.read_records(len(got), 1000)
        assert chunk, f"read_records({len(got)}) returned nothing below max id {last}"
        got.extend(chunk)
    assert got == [make_record(t, partition_id) for t in range(last + 1)]


class StorageSuite:
    """The shared tests of a StorageEngine. Subclass it and provide ``harness``."""

    pytestmark = [pytest.mark.asyncio]

    @pytest.fixture
    def harness(self) -> StorageHarness:
        raise NotImplementedError("subclass StorageSuite and provide a `harness` fixture")

    @pytest.fixture(autouse=True)
    def _capabilities(self, request: pytest.FixtureRequest, harness: StorageHarness) -> None:
        skip_unless_capable(request, harness)

    @pytest_asyncio.fixture
    async def store(self, harness: StorageHarness) -> AsyncIterator[Store]:
        store = Store(harness)
        try:
            yield store
        finally:
            await store.close_all()

    # -- basics -----------------------------------------------------------------------------

    async def test_new_storage_is_empty(self, store: Store) -> None:
        engine = await store.open()
        assert engine.cluster_key == store.cluster_key
        assert engine.num_partitions == store.num_partitions
        assert engine.partition_ids() == []
        with pytest.raises(PartitionNotFoundError):
            engine.partition(0)
        part = await engine.add_partition(0)
        assert engine.partition_ids() == [0]
        assert part.max_transaction_id() == -1
        assert part.session_info() == SessionInfo(-1, -1, -1)
        assert await part.read_record(0) is None
        assert await part.read_header(0) is None
        assert await part.read_records(0, 10) == []
        assert await part.read_headers(0, 10) == []
        assert await engine.add_partition(0) is engine.partition(0)

    async def test_creating_needs_key_and_partitions(self, store: Store) -> None:
        with pytest.raises(StorageError, match="cluster key"):
            await store.harness.open(store.location)

    async def test_partition_out_of_range(self, store: Store) -> None:
        engine = await store.open()
        with pytest.raises(PartitionNotFoundError, match=r"partitions 0\.\.3"):
            await engine.add_partition(store.num_partitions)
        with pytest.raises(PartitionNotFoundError):
            await engine.add_partition(-1)

    async def test_append_and_read(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(1)
        await part.append([make_record(0, 1)])
        await part.append([make_record(t, 1) for t in range(1, 4)])
        await part.append([make_record(t, 1) for t in range(4, 10)])
        assert part.max_transaction_id() == 9
        for t in range(10):
            assert await part.read_record(t) == make_record(t, 1)
            assert await part.read_header(t) == make_record(t, 1).record_header
        assert await part.read_record(10) is None
        assert await part.read_record(-1) is None
        assert await part.read_records(2, 5) == [make_record(t, 1) for t in range(2, 7)]
        assert await part.read_records(7, 100) == [make_record(t, 1) for t in range(7, 10)]
        assert await part.read_records(10, 5) == []
        assert await part.read_headers(3, 4) == [
            make_record(t, 1).record_header for t in range(3, 7)
        ]
        assert await part.read_headers(8, 10) == [
            make_record(t, 1).record_header for t in range(8, 10)
        ]
        assert await part.read_records(0, 0) == []

    async def test_empty_data_and_large_data(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(0)
        big = os.urandom(300_000)
        await part.append([make_record(0, data=b""), make_record(1, data=big)])
        assert await part.read_record(0) == make_record(0, data=b"")
        assert await part.read_record(1) == make_record(1, data=big)

    async def test_read_records_respects_max_bytes(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(0)
        await part.append([make_record(t, data=bytes([t]) * 100) for t in range(10)])
        got = await part.read_records(0, 10, max_bytes=250)
        assert [r.transaction_id for r in got] == [0, 1]
        got = await part.read_records(3, 10, max_bytes=1)
        assert [r.transaction_id for r in got] == [3]
        got = await part.read_records(5, 10, max_bytes=10_000)
        assert [r.transaction_id for r in got] == [5, 6, 7, 8, 9]

    async def test_read_block_is_read_records_in_wire_form(self, store: Store) -> None:
        """``read_block`` (what a range read sends on) holds exactly the records
        ``read_records`` returns, with the same budgets, in the wire's record layout."""
        engine = await store.open()
        part = await engine.add_partition(0)
        await part.append([make_record(t, data=bytes([t]) * (t * 37 % 150)) for t in range(12)])
        for start in (0, 3, 11, 12, 40):
            for count, budget in ((5, 16 * 1024 * 1024), (100, 16 * 1024 * 1024), (10, 200)):
                expected = await part.read_records(start, count, budget)
                block = await part.read_block(start, count, budget)
                assert isinstance(block, wire.RecordBlock)
                assert block.raw == wire.encode_records(expected)
                assert len(block) == len(expected)
                assert block.check(start) == block.offsets()
        assert len(await part.read_block(0, 0)) == 0

    async def test_append_must_continue_the_log(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(0)
        with pytest.raises(StorageAppendError):
            await part.append([make_record(1)])
        assert part.max_transaction_id() == -1
        await part.append([make_record(t) for t in range(3)])
        for bad in ([make_record(4)], [make_record(3), make_record(5)], [make_record(2)]):
            with pytest.raises(StorageAppendError):
                await part.append(bad)
            assert part.max_transaction_id() == 2
        assert await part.read_record(3) is None
        await part.append([make_record(3)])
        await assert_log(engine, 0, 3)

    async def test_start_append_settles_like_append(self, store: Store) -> None:
        """An engine that starts appends without waiting (``starts_appends``) refuses at
        once what ``append`` refuses, storing nothing, and resolves the future once the
        records are stored; one that does not refuses the call, storing nothing."""
        engine = await store.open()
        part = await engine.add_partition(0)
        if not part.starts_appends:
            with pytest.raises(StorageError, match="call append"):
                part.start_append([make_record(0)])
            assert part.max_transaction_id() == -1
            return
        with pytest.raises(StorageAppendError):
            part.start_append([make_record(1)])
        assert part.max_transaction_id() == -1
        await asyncio.wait_for(part.start_append([make_record(0), make_record(1)]), 30)
        assert part.max_transaction_id() == 1
        await asyncio.wait_for(part.start_append([make_record(2)]), 30)
        await assert_log(engine, 0, 2)

    async def test_checksum_mismatch_is_refused(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(0)
        good = make_record(1)
        bad = Record(2, good.req_id, 0, b"payload", crc32c.crc32c(b"other"))
        with pytest.raises(ChecksumError):
            await part.append([make_record(0), good, bad])
        assert part.max_transaction_id() == -1
        assert await part.read_record(0) is None
        await append_range(engine, 0, 0, 3)
        await assert_log(engine, 0, 2)

    async def test_out_of_range_fields_are_refused(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(0)
        record = make_record(0)
        huge = Record(0, ReqId(2**40, 0, 0, 0), 0, record.data, record.checksum)
        with pytest.raises(StorageAppendError):
            await part.append([huge])
        assert part.max_transaction_id() == -1

    async def test_truncate(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(0)
        await append_range(engine, 0, 0, 10, batch=3)
        await part.truncate(5)
        assert part.max_transaction_id() == 5
        assert await part.read_record(6) is None
        assert await part.read_records(4, 10) == [make_record(4), make_record(5)]
        await part.truncate(10)  # above the log: nothing happens
        await part.truncate(5)
        assert part.max_transaction_id() == 5
        other = make_record(6, data=b"a different record six")
        await part.append([other])
        assert await part.read_record(6) == other
        await part.truncate(-1)
        assert part.max_transaction_id() == -1
        assert await part.read_record(0) is None
        await append_range(engine, 0, 0, 4)
        await assert_log(engine, 0, 3)
        with pytest.raises(StorageError):
            await part.truncate(-2)

    @requires("reopen")
    async def test_truncate_is_durable_across_reopen(self, store: Store) -> None:
        engine = await store.open()
        await engine.add_partition(0)
        await engine.add_partition(2)
        await append_range(engine, 0, 0, 20, batch=4)
        await append_range(engine, 2, 0, 5)
        await engine.partition(0).truncate(11)
        await engine.partition(2).truncate(-1)
        engine = await store.reopen()
        assert engine.partition_ids() == [0, 2]
        await assert_log(engine, 0, 11)
        assert engine.partition(2).max_transaction_id() == -1
        await append_range(engine, 0, 12, 15)
        await append_range(engine, 2, 0, 2)
        engine = await store.reopen()
        await assert_log(engine, 0, 14)
        await assert_log(engine, 2, 1)

    @requires("reopen")
    async def test_everything_survives_reopen(self, store: Store) -> None:
        engine = await store.open()
        await engine.add_partition(3)
        await append_range(engine, 3, 0, 25, batch=7)
        info = SessionInfo(5, 20, 18)
        await engine.partition(3).set_session_info(info)
        engine = await store.reopen()
        await assert_log(engine, 3, 24)
        assert engine.partition(3).session_info() == info
        await append_range(engine, 3, 25, 30)
        await assert_log(engine, 3, 29)

    async def test_session_info(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(0)
        for session in range(1, 6):
            info = SessionInfo(session, session * 10, session * 10 - 3)
            await part.set_session_info(info)
            assert part.session_info() == info

    @requires("reopen")
    async def test_session_info_survives_reopen(self, store: Store) -> None:
        engine = await store.open()
        for pid in (0, 1):
            await engine.add_partition(pid)
        await engine.partition(0).set_session_info(SessionInfo(1, 0, 0))
        await engine.partition(0).set_session_info(SessionInfo(2, 5, 4))
        await engine.partition(1).set_session_info(SessionInfo(9, -1, -1))
        engine = await store.reopen()
        assert engine.partition(0).session_info() == SessionInfo(2, 5, 4)
        assert engine.partition(1).session_info() == SessionInfo(9, -1, -1)
        await engine.partition(0).set_session_info(SessionInfo(3, 6, 6))
        engine = await store.reopen()
        assert engine.partition(0).session_info() == SessionInfo(3, 6, 6)

    async def test_new_storage_is_created_at_the_feature_level_given(self, store: Store) -> None:
        engine = await store.open()
        assert engine.feature_level == engine.max_feature_level
        other = await store.open(store.harness.new_location(), feature_level=MIN_FEATURE_LEVEL)
        assert other.feature_level == MIN_FEATURE_LEVEL

    async def test_raise_feature_level_keeps_everything_and_never_lowers(
        self, store: Store
    ) -> None:
        engine = await store.open(feature_level=MIN_FEATURE_LEVEL)
        part = await engine.add_partition(1)
        await append_range(engine, 1, 0, 12, batch=4)
        await part.set_session_info(SessionInfo(3, 7, 7, 3))
        await part.truncate(9)
        top = engine.max_feature_level
        await engine.raise_feature_level(top)
        assert engine.feature_level == top
        await assert_log(engine, 1, 9)
        assert part.session_info() == SessionInfo(3, 7, 7, 3)
        assert part.log_start() == 0
        await append_range(engine, 1, 10, 14)  # appends go on, in the new formats
        await engine.raise_feature_level(top)  # idempotent
        await engine.raise_feature_level(MIN_FEATURE_LEVEL)  # never lowered
        assert engine.feature_level == top
        with pytest.raises(StorageError, match=str(top + 1)):
            await engine.raise_feature_level(top + 1)
        assert engine.feature_level == top
        await assert_log(engine, 1, 13)

    @requires("reopen")
    async def test_feature_level_survives_reopen(self, store: Store) -> None:
        engine = await store.open(feature_level=MIN_FEATURE_LEVEL)
        await engine.add_partition(0)
        await append_range(engine, 0, 0, 5)
        engine = await store.reopen()  # opening never raises the level, nor lowers it
        assert engine.feature_level == MIN_FEATURE_LEVEL
        await engine.raise_feature_level(engine.max_feature_level)
        await append_range(engine, 0, 5, 8)
        engine = await store.reopen()
        assert engine.feature_level == engine.max_feature_level
        await assert_log(engine, 0, 7)
        engine = await store.reopen(feature_level=MIN_FEATURE_LEVEL)
        assert engine.feature_level == engine.max_feature_level

    @requires("reopen")
    async def test_cluster_key_mismatch(self, store: Store) -> None:
        engine = await store.open()
        with pytest.raises(ClusterKeyMismatchError):
            engine.check_cluster_key(uuid.uuid4(), store.num_partitions)
        with pytest.raises(ClusterKeyMismatchError):
            engine.check_cluster_key(store.cluster_key, store.num_partitions + 1)
        engine.check_cluster_key(store.cluster_key, store.num_partitions)
        await store.close()
        with pytest.raises(ClusterKeyMismatchError):
            await store.harness.open(
                store.location, cluster_key=uuid.uuid4(), num_partitions=store.num_partitions
            )
        with pytest.raises(ClusterKeyMismatchError):
            await store.harness.open(
                store.location, cluster_key=store.cluster_key, num_partitions=7
            )
        engine = await store.harness.open(store.location)  # no key given: not checked
        try:
            assert engine.cluster_key == store.cluster_key
        finally:
            await engine.close()

    @requires("reopen")
    async def test_remove_partition(self, store: Store) -> None:
        engine = await store.open()
        for pid in (0, 1):
            await engine.add_partition(pid)
            await append_range(engine, pid, 0, 5)
        await engine.remove_partition(0)
        await engine.remove_partition(0)  # idempotent
        assert engine.partition_ids() == [1]
        with pytest.raises(PartitionNotFoundError):
            engine.partition(0)
        engine = await store.reopen()
        assert engine.partition_ids() == [1]
        await assert_log(engine, 1, 4)
        part = await engine.add_partition(0)
        assert part.max_transaction_id() == -1
        assert part.session_info() == SessionInfo()

    async def test_many_partitions_append_concurrently(self, harness: StorageHarness) -> None:
        store = Store(harness, num_partitions=16)
        try:
            engine = await store.open()
            for pid in range(16):
                await engine.add_partition(pid)

            async def write(pid: int) -> None:
                await append_range(engine, pid, 0, 30 + pid, batch=1 + pid % 4)

            await asyncio.gather(*(write(pid) for pid in range(16)))
            for pid in range(16):
                await assert_log(engine, pid, 29 + pid)
            if "reopen" in harness.capabilities:
                engine = await store.reopen()
                for pid in range(16):
                    await assert_log(engine, pid, 29 + pid)
        finally:
            await store.close_all()

    # -- segments ---------------------------------------------------------------------------

    @requires("segments", "reopen")
    async def test_segment_rollover_and_reads_across_segments(self, store: Store) -> None:
        engine = await store.open(segment_size=1024)
        part = await engine.add_partition(0)
        await append_range(engine, 0, 0, 120, batch=7)
        await assert_log(engine, 0, 119)
        segments = store.harness.segment_count(store.location, 0)
        assert segments >= 5
        assert await part.read_records(10, 80) == [make_record(t) for t in range(10, 90)]
        assert await part.read_headers(0, 120) == [make_record(t).record_header for t in range(120)]
        await part.truncate(40)
        assert store.harness.segment_count(store.location, 0) < segments
        await assert_log(engine, 0, 40)
        engine = await store.reopen(segment_size=1024)
        await assert_log(engine, 0, 40)
        await append_range(engine, 0, 41, 130, batch=10)
        engine = await store.reopen(segment_size=1024)
        await assert_log(engine, 0, 129)
        await engine.partition(0).truncate(-1)
        assert store.harness.segment_count(store.location, 0) <= 1
        engine = await store.reopen(segment_size=1024)
        assert engine.partition(0).max_transaction_id() == -1
        await append_range(engine, 0, 0, 3)
        await assert_log(engine, 0, 2)

    # -- the low-water mark's session, availability -------------------------------------

    async def test_session_info_keeps_the_low_water_mark_session(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(2)
        info = SessionInfo(7, 40, 38, 6)
        await part.set_session_info(info)
        assert part.session_info() == info
        lost = SessionInfo(8, 40, 38, LOST_SESSION)
        await part.set_session_info(lost)
        assert part.session_info() == lost
        if "reopen" in store.harness.capabilities:
            engine = await store.reopen()
            assert engine.partition(2).session_info() == lost

    @requires("availability")
    async def test_availability_is_kept(self, store: Store) -> None:
        engine = await store.open()
        for pid in (0, 1):
            await engine.add_partition(pid)
        assert engine.partition(0).available()
        await engine.partition(0).set_available(False)
        assert not engine.partition(0).available() and engine.partition(1).available()
        if "reopen" in store.harness.capabilities:
            engine = await store.reopen()
            assert not engine.partition(0).available() and engine.partition(1).available()
            await engine.partition(0).set_available(True)
            engine = await store.reopen()
            assert engine.partition(0).available()
        await engine.remove_partition(0)
        assert (await engine.add_partition(0)).available()

    # -- deleting an archived prefix ------------------------------------------------------

    async def _read_from(self, engine: StorageEngine, partition_id: int, start: int) -> list[int]:
        part = engine.partition(partition_id)
        got: list[Record] = []
        while start + len(got) <= part.max_transaction_id():
            chunk = await part.read_records(start + len(got), 1000)
            assert chunk, f"read_records({start + len(got)}) returned nothing"
            got.extend(chunk)
        assert got == [make_record(r.transaction_id, partition_id) for r in got]
        return [r.transaction_id for r in got]

    async def test_without_prefix_the_log_starts_at_zero(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(0)
        await append_range(engine, 0, 0, 5)
        assert part.log_start() == 0
        extents = part.local_extents()
        assert extents and extents[0].first == 0 and extents[-1].last == 4
        if "prefix" not in store.harness.capabilities:
            with pytest.raises(StorageError):
                await part.drop_prefix(2)
            await assert_log(engine, 0, 4)

    @requires("prefix")
    async def test_drop_prefix_never_deletes_beyond_through(self, store: Store) -> None:
        options: dict[str, Any] = (
            {"segment_size": 1024} if "segments" in store.harness.capabilities else {}
        )
        engine = await store.open(**options)
        part = await engine.add_partition(1)
        await append_range(engine, 1, 0, 120, batch=7)
        start = await part.drop_prefix(61)
        assert 0 <= start <= 62 and part.log_start() == start
        assert part.max_transaction_id() == 119
        assert await self._read_from(engine, 1, start) == list(range(start, 120))
        if start > 0:
            for read in (
                part.read_records(start - 1, 10),
                part.read_record(0),
                part.read_headers(start - 1, 3),
            ):
                with pytest.raises(RecordsArchivedError):
                    await read
        extents = part.local_extents()
        assert extents[0].first == start and extents[-1].last == 119
        assert all(a.last + 1 == b.first for a, b in itertools.pairwise(extents))
        assert part.missing_ranges() == []
        again = await part.drop_prefix(10)  # below the start: nothing changes
        assert again == start == part.log_start()
        await append_range(engine, 1, 120, 125)
        assert await self._read_from(engine, 1, start) == list(range(start, 125))
        if "reopen" in store.harness.capabilities:
            engine = await store.reopen(**options)
            part = engine.partition(1)
            assert part.log_start() == start and part.missing_ranges() == []
            assert part.session_info() == SessionInfo()
            assert await self._read_from(engine, 1, start) == list(range(start, 125))

    @requires("prefix")
    async def test_drop_prefix_past_the_end_starts_the_log_after_it(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(0)
        await append_range(engine, 0, 0, 40, batch=5)
        assert await part.drop_prefix(99) == 100
        assert part.log_start() == 100 and part.max_transaction_id() == 99
        assert part.local_extents() == []
        with pytest.raises(RecordsArchivedError):
            await part.read_records(50, 10)
        assert await part.read_records(100, 10) == []
        with pytest.raises(StorageAppendError):
            await part.append([make_record(40)])
        await append_range(engine, 0, 100, 105)
        assert await self._read_from(engine, 0, 100) == list(range(100, 105))
        if "reopen" in store.harness.capabilities:
            engine = await store.reopen()
            part = engine.partition(0)
            assert part.log_start() == 100 and part.max_transaction_id() == 104
            assert part.missing_ranges() == []
        # an empty partition started after the archive mark (a new replica)
        fresh = await engine.add_partition(2)
        assert await fresh.drop_prefix(7) == 8 and fresh.max_transaction_id() == 7
        await append_range(engine, 2, 8, 10)
        assert await self._read_from(engine, 2, 8) == [8, 9]

    @requires("prefix")
    async def test_truncate_below_the_log_start_empties_the_log(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(0)
        await append_range(engine, 0, 0, 30, batch=5)
        await part.drop_prefix(49)
        await append_range(engine, 0, 50, 60)
        await part.truncate(55)
        assert part.max_transaction_id() == 55 and part.log_start() == 50
        await part.truncate(20)
        assert part.max_transaction_id() == 20 and part.log_start() == 21
        assert await part.read_records(21, 10) == []
        await append_range(engine, 0, 21, 23)
        assert await self._read_from(engine, 0, 21) == [21, 22]
        if "reopen" in store.harness.capabilities:
            engine = await store.reopen()
            part = engine.partition(0)
            assert (part.log_start(), part.max_transaction_id()) == (21, 22)
            assert part.missing_ranges() == []

    # -- scrub ------------------------------------------------------------------------------

    async def test_scrub_reads_only_sealed_records(self, store: Store) -> None:
        """The last extent (appended to) is not scrubbed; without ``scrub`` a call is
        refused and changes nothing."""
        engine = await store.open()
        part = await engine.add_partition(0)
        await append_range(engine, 0, 0, 5)
        if "scrub" not in store.harness.capabilities:
            with pytest.raises(StorageError):
                await part.scrub(0, 1 << 20)
        elif len(part.local_extents()) == 1:
            assert await _scrub_pass(part, 1 << 20) == [ScrubProgress(None)]
        await assert_log(engine, 0, 4)

    @requires("scrub", "file_faults", "repair", "segments")
    async def test_scrub_makes_damage_under_a_running_engine_a_missing_range(
        self, store: Store
    ) -> None:
        """A byte of a sealed record flipped on disk while the engine runs: a scrub pass
        finds it, the range holding it is missing (reads name it; every other record
        reads back identical), it stays missing across a reopen, and repair fills it. A
        call with a budget of one byte verifies one record."""
        engine = await store.open(segment_size=1024)
        part = await engine.add_partition(0)
        await append_range(engine, 0, 0, 60, batch=3)
        sealed = part.local_extents()[:-1]
        assert len(sealed) >= 2, sealed
        calls = await _scrub_pass(part, 1)
        assert sum(c.records for c in calls) >= sum(e.last - e.first + 1 for e in sealed)
        assert all(c.records <= 1 for c in calls)
        assert not any(c.damaged for c in calls) and part.missing_ranges() == []

        victim = sealed[1].first + 1
        path, start, end = store.harness.record_extent(store.location, 0, victim)
        with path.open("r+b") as f:  # under the running engine
            f.seek((start + end) // 2)
            byte = f.read(1)[0]
            f.seek((start + end) // 2)
            f.write(bytes([byte ^ 0x10]))
        damaged = [r for c in await _scrub_pass(part, 4096) for r in c.damaged]
        assert len(damaged) == 1 and damaged[0][0] <= victim <= damaged[0][1], damaged
        first, last = damaged[0]
        assert part.missing_ranges() == damaged
        assert part.max_transaction_id() == 59
        for t in range(60):
            if first <= t <= last:
                with pytest.raises(CorruptionError, match=f"transaction {t}"):
                    await part.read_record(t)
            else:
                assert await part.read_record(t) == make_record(t)
        assert not any(c.damaged for c in await _scrub_pass(part, 4096))
        if "reopen" in store.harness.capabilities:
            engine = await store.reopen(segment_size=1024)
            part = engine.partition(0)
            assert part.missing_ranges() == damaged
        await part.repair([make_record(t) for t in range(first, last + 1)])
        assert part.missing_ranges() == []
        await assert_log(engine, 0, 59)
        assert not any(c.damaged for c in await _scrub_pass(part, 4096))

    # -- the damage sweep ----------------------------------------------------------------

    damage_sweep_variants: ClassVar[int] = 1000
    """Variants of the sweep (``--waltz-damage-variants`` overrides it)."""

    @requires("file_faults", "reopen")
    async def test_damage_sweep(
        self, harness: StorageHarness, request: pytest.FixtureRequest
    ) -> None:
        """Seeded damage of every kind (storage_damage): every record served is
        byte-identical or refused with an error naming it; no intact record is
        deleted; with ``repair``, missing ranges filled make the log whole."""
        variants = request.config.getoption("waltz_damage_variants", None)
        count = int(variants) if variants is not None else self.damage_sweep_variants
        seed = int(request.config.getoption("waltz_damage_seed", None) or 0)
        sweeper = harness.scratch()
        options = dict(harness.options)
        pristine = await storage_damage.build_pristine(sweeper, options)
        result = storage_damage.SweepResult()
        try:
            for i in range(count):
                await storage_damage.run_variant(sweeper, pristine, seed + i, options, result)
                if len(result.failures) >= 10:
                    break
        finally:
            storage_damage.remove(sweeper, pristine)
        request.node.user_properties.append(("damage_sweep", result.summary()))
        sys.stderr.write(f"\n{harness.name}: {result.summary()}\n")
        assert not result.failures, "\n".join(result.failures)
        assert result.changed_served == 0 and result.intact_deleted == 0
        assert result.variants == count

    # -- crash safety -------------------------------------------------------------------------

    @requires("file_faults", "reopen")
    async def test_torn_session_info_falls_back_to_the_other_struct(self, store: Store) -> None:
        engine = await store.open()
        part = await engine.add_partition(1)
        await part.set_session_info(SessionInfo(1, 10, 9))
        await part.set_session_info(SessionInfo(2, 20, 19))
        await store.close()
        store.harness.tear_session_info(store.location, 1, "newest")
        engine = await store.open()
        assert engine.partition(1).session_info() == SessionInfo(1, 10, 9)
        await engine.partition(1).set_session_info(SessionInfo(3, 30, 29))
        engine = await store.reopen()
        assert engine.partition(1).session_info() == SessionInfo(3, 30, 29)

    @requires("file_faults", "reopen")
    async def test_both_session_structs_torn_closes_only_that_partition(self, store: Store) -> None:
        engine = await store.open()
        for pid in (0, 1):
            await engine.add_partition(pid)
            await append_range(engine, pid, 0, 3)
        await store.close()
        store.harness.tear_session_info(store.location, 0, "both")
        engine = await store.open()
        with pytest.raises(PartitionClosedError, match="partition 0"):
            engine.partition(0)
        await assert_log(engine, 1, 2)
        await append_range(engine, 1, 3, 5)
        await assert_log(engine, 1, 4)
        # the way out: remove the partition and add it again (then catch up)
        await engine.remove_partition(0)
        part = await engine.add_partition(0)
        assert part.max_transaction_id() == -1
        engine = await store.reopen()
        assert engine.partition(0).max_transaction_id() == -1
        await assert_log(engine, 1, 4)

    @requires("crash_reopen")
    async def test_kill_during_appends_loses_nothing_acknowledged(self, store: Store) -> None:
        harness = store.harness
        engine = await store.open()
        for pid in (0, 1):
            await engine.add_partition(pid)
        await store.close()
        acked = {0: -1, 1: -1}
        for round_ in range(3):
            await asyncio.to_thread(
                harness.kill_writer_midway,
                store.location,
                store.cluster_key,
                store.num_partitions,
                [0, 1],
                target=40 + 15 * round_,
                acked=acked,
                batch=1 + 4 * round_,
            )
            engine = await store.open()
            for pid in (0, 1):
                part = engine.partition(pid)
                last = part.max_transaction_id()
                assert last >= acked[pid], f"partition {pid} lost acknowledged appends"
                await assert_log(engine, pid, last)
            await store.close()

    @requires("crash_reopen")
    async def test_kill_during_session_info_updates(self, store: Store) -> None:
        harness = store.harness
        engine = await store.open()
        for pid in (0, 1):
            await engine.add_partition(pid)
        await store.close()
        acked = {0: -1, 1: -1}
        await asyncio.to_thread(
            harness.kill_writer_midway,
            store.location,
            store.cluster_key,
            store.num_partitions,
            [0, 1],
            target=60,
            acked=acked,
            sessions=True,
        )
        engine = await store.open()
        for pid in (0, 1):
            info = engine.partition(pid).session_info()
            # the last acknowledged update, or the one after it that was under way
            assert acked[pid] <= info.session_id <= acked[pid] + 1, (pid, info, acked)
            assert info == SessionInfo(
                info.session_id, info.session_id * 2, info.session_id * 2 - 1, info.session_id
            )

    @requires("file_faults", "reopen")
    async def test_cut_at_every_byte_of_the_last_records(self, store: Store) -> None:
        harness = store.harness
        engine = await store.open()
        await engine.add_partition(0)
        await append_range(engine, 0, 0, 12, batch=2)
        await store.close()
        path, start, _ = harness.record_extent(store.location, 0, 9)
        _, _, end = harness.record_extent(store.location, 0, 11)
        record_starts = [harness.record_extent(store.location, 0, t)[1] for t in (9, 10, 11)]
        relative = path.relative_to(store.location)
        for offset in range(start, end):
            copy = f"{store.location}-cut-{offset}"
            harness.copy_location(store.location, copy)
            os.truncate(Path(copy) / relative, offset)
            engine = await store.open(copy)
            expected = 8 + sum(1 for s in record_starts[1:] if s <= offset)
            await assert_log(engine, 0, expected)
            # the log goes on from the recovered prefix
            await append_range(engine, 0, expected + 1, expected + 2)
            await assert_log(engine, 0, expected + 1)
            await engine.close()
            shutil.rmtree(copy)
        # cutting the index (rebuilt at recovery) loses nothing
        index = harness.index_files(store.location, 0)[-1]
        relative = index.relative_to(store.location)
        size = index.stat().st_size
        for offset in range(max(0, size - 3 * 8 - 3), size):
            copy = f"{store.location}-icut-{offset}"
            harness.copy_location(store.location, copy)
            os.truncate(Path(copy) / relative, offset)
            engine = await store.open(copy)
            await assert_log(engine, 0, 11)
            await engine.close()
            shutil.rmtree(copy)

    @requires("file_faults", "reopen")
    async def test_bit_flips_are_detected(self, store: Store) -> None:
        harness = store.harness
        engine = await store.open()
        await engine.add_partition(0)
        await append_range(engine, 0, 0, 12, batch=3)
        await store.close()
        rng = random.Random(1234)
        for victim in (2, 6, 11):
            path, start, end = harness.record_extent(store.location, 0, victim)
            relative = path.relative_to(store.location)
            positions = (
                range(start, end) if victim == 11 else sorted(rng.sample(range(start, end), 12))
            )
            for position in positions:
                copy = f"{store.location}-flip-{victim}-{position}"
                harness.copy_location(store.location, copy)
                target = Path(copy) / relative
                with target.open("r+b") as f:
                    f.seek(position)
                    byte = f.read(1)[0]
                    f.seek(position)
                    f.write(bytes([byte ^ (1 << rng.randrange(8))]))
                engine = await store.open(copy)
                await _assert_never_wrong(engine, 0, 11, victim)
                await engine.close()
                shutil.rmtree(copy)


async def _scrub_pass(part: StoragePartition, max_bytes: int) -> list[ScrubProgress]:
    """Every call of one scrub pass (bounded: a pass that never ends fails)."""
    calls: list[ScrubProgress] = []
    start: int | None = 0
    while start is not None:
        progress = await part.scrub(start, max_bytes)
        calls.append(progress)
        assert progress.records or progress.next_start is None, "a call verified nothing"
        assert len(calls) <= 10_000, "the scrub pass does not end"
        start = progress.next_start
    return calls


def _run_writer_and_kill(command: list[str], target: int, acked: dict[int, int]) -> None:
    """Start the writer, let it acknowledge ``target`` appends, then SIGKILL it mid-write.

    ``acked`` gets the highest acknowledged id per partition."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        acks, pending = _read_acks(proc, target, acked, timeout=60.0)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.stdout is not None and proc.stderr is not None
    # acknowledgements already in the pipe count too
    _count_acks((pending + proc.stdout.read()).split(b"\n"), acked)
    errors = proc.stderr.read().decode(errors="replace")
    proc.stdout.close()
    proc.stderr.close()
    assert acks >= target, f"the writer acknowledged only {acks} appends: {errors}"
    assert proc.returncode == -signal.SIGKILL, f"the writer ended by itself: {errors}"


def _read_acks(
    proc: subprocess.Popen[bytes], target: int, acked: dict[int, int], timeout: float
) -> tuple[int, bytes]:
    """Read ``<partition> <id>`` acknowledgements until ``target`` of them (or a timeout).

    Returns the count and any partial last line (for the caller's final read)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    count = 0
    pending = b""
    while count < target and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        count += _count_acks(lines, acked)
    return count, pending


def _count_acks(lines: list[bytes], acked: dict[int, int]) -> int:
    count = 0
    for line in lines:
        if line.strip():
            pid_s, txid_s = line.split()
            acked[int(pid_s)] = max(acked[int(pid_s)], int(txid_s))
            count += 1
    return count


async def _assert_never_wrong(engine: StorageEngine, pid: int, last: int, victim: int) -> None:
    """Every record reads back right, or raises CorruptionError, or was truncated away;
    the damaged one is never returned."""
    part = engine.partition(pid)
    top = part.max_transaction_id()
    assert top <= last
    for t in range(last + 1):
        try:
            record = await part.read_record(t)
        except CorruptionError:
            continue
        if t > top:
            assert record is None
        else:
            assert record == make_record(t, pid), f"transaction {t} read back wrong"
            assert t != victim, f"the damaged transaction {victim} was returned"
    try:
        records = await part.read_records(0, last + 1)
    except CorruptionError:
        return
    assert records == [make_record(t, pid) for t in range(len(records))]
    assert len(records) <= victim
