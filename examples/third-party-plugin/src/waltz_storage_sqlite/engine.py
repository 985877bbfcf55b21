"""A Waltz storage engine on one SQLite database (WAL mode, ``synchronous=FULL``).

Layout: ``<location>/waltz-storage.sqlite3`` holds three tables:

- ``meta``: the cluster key, the number of partitions, the format version and the
  cluster feature level it was told (one format at every level);
- ``partitions``: the hosted partitions and their session info;
- ``records``: every record, keyed by (partition, transaction id).

Durability comes from SQLite: every change is one SQLite transaction, and a
commit returns only once the write-ahead log is synced (``synchronous=FULL``).
A crash therefore leaves each change applied or not, never half; a record's
CRC-32C is checked again on every read (:class:`~waltz_api.errors.CorruptionError`).

Writes of every partition go through one writer thread, which commits all
the changes queued while it was busy in one SQLite transaction (group
commit: one sync for many appends). Reads use a second connection on a
reader thread and see only committed data (WAL snapshots).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sqlite3
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import crc32c

from waltz_api.contracts.storage import StorageEngine, StoragePartition
from waltz_api.errors import (
    ChecksumError,
    CorruptionError,
    PartitionClosedError,
    PartitionNotFoundError,
    StorageAppendError,
    StorageError,
)
from waltz_api.features import MIN_FEATURE_LEVEL
from waltz_api.types import NO_TRANSACTION, Record, RecordHeader, ReqId, SessionInfo

logger = logging.getLogger(__name__)

T = TypeVar("T")

DB_FILE_NAME = "waltz-storage.sqlite3"
FORMAT_VERSION = 2
"""Version 2 added the low-water mark's session and the availability of a partition;
a version-1 database is migrated when it is opened (two columns added)."""
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_GROUP = 256
"""Most queued changes committed together in one SQLite transaction."""

SYNCHRONOUS_MODES = ("full", "extra")

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE partitions (
    partition_id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL,
    low_water_mark INTEGER NOT NULL,
    local_low_water_mark INTEGER NOT NULL,
    low_water_mark_session_id INTEGER NOT NULL DEFAULT -1,
    available INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE records (
    partition_id INTEGER NOT NULL,
    transaction_id INTEGER NOT NULL,
    client_id INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    req_partition_id INTEGER NOT NULL,
    seq_num INTEGER NOT NULL,
    header INTEGER NOT NULL,
    checksum INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (partition_id, transaction_id)
);
"""

_RECORD_COLUMNS = (
    "transaction_id, client_id, generation, req_partition_id, seq_num, header, checksum"
)


@dataclass(frozen=True)
class SqliteOptions:
    """The engine's options (``[storage.options]`` of a storage node)."""

    synchronous: str = "full"
    """``full`` (sync the WAL on every commit) or ``extra`` (also sync the directory)."""
    wal_autocheckpoint: int = 1000
    """WAL pages after which SQLite checkpoints the WAL into the database (0: never)."""

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> SqliteOptions:
        given = dict(options or {})
        known = {"synchronous", "wal_autocheckpoint"}
        unknown = sorted(set(given) - known)
        if unknown:
            raise StorageError(
                f"unknown sqlite storage option(s) {', '.join(unknown)}; "
                f"valid options: {', '.join(sorted(known))}"
            )
        synchronous = str(given.get("synchronous", cls.synchronous)).lower()
        if synchronous not in SYNCHRONOUS_MODES:
            raise StorageError(
                f"sqlite storage option synchronous must be one of "
                f"{', '.join(SYNCHRONOUS_MODES)} (a weaker mode would lose acknowledged "
                f"appends on a power failure), not {given['synchronous']!r}"
            )
        checkpoint = given.get("wal_autocheckpoint", cls.wal_autocheckpoint)
        if isinstance(checkpoint, bool) or not isinstance(checkpoint, int) or checkpoint < 0:
            raise StorageError(
                f"sqlite storage option wal_autocheckpoint must be an integer >= 0, "
                f"not {checkpoint!r}"
            )
        return cls(synchronous=synchronous, wal_autocheckpoint=checkpoint)


def _connect(path: Path, options: SqliteOptions) -> sqlite3.Connection:
    # isolation_level=None: no implicit transactions, the engine issues BEGIN/COMMIT itself
    connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StorageError(f"{path}: SQLite refused WAL mode (got {mode!r})")
        connection.execute(f"PRAGMA synchronous={options.synchronous.upper()}")
        connection.execute(f"PRAGMA wal_autocheckpoint={options.wal_autocheckpoint}")
        connection.execute("PRAGMA busy_timeout=30000")
    except BaseException:
        connection.close()
        raise
    return connection


@dataclass
class _Job:
    """A change for the writer thread: ``apply`` runs inside the group's transaction,
    ``on_commit`` runs in the event loop once that transaction is durable."""

    apply: Callable[[sqlite3.Connection], Any]
    on_commit: Callable[[Any], None] | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    result: Any = None
    error: BaseException | None = None


class _Writer(threading.Thread):
    """The only thread that writes: commits queued jobs in groups (group commit)."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        super().__init__(name="waltz-sqlite-writer", daemon=True)
        self._connection = connection
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.commits = 0
        self.jobs = 0

    def submit(self, job: _Job) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        self._queue.put(None)

    def run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            group = [first]
            while len(group) < MAX_GROUP:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stopping = True  # commit what came before the stop, then end
                    break
                group.append(job)
            self._commit(group)
        self._connection.close()

    def _commit(self, group: list[_Job]) -> None:
        connection = self._connection
        try:
            connection.execute("BEGIN IMMEDIATE")
            for job in group:
                connection.execute("SAVEPOINT job")
                try:
                    job.result = job.apply(connection)
                except Exception as exc:  # this job only: its changes are rolled back
                    connection.execute("ROLLBACK TO job")
                    job.error = exc
                connection.execute("RELEASE job")
            connection.execute("COMMIT")
            self.commits += 1
            self.jobs += len(group)
        except Exception as exc:
            logger.exception("sqlite storage: a group commit of %d changes failed", len(group))
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            failure = StorageError(f"the SQLite commit failed, nothing was stored: {exc}")
            for job in group:
                job.error = failure
        for job in group:
            try:
                job.loop.call_soon_threadsafe(_finish, job)
            except RuntimeError:  # its event loop is closed: nobody waits for it
                logger.warning("sqlite storage: a change committed after its loop closed")


def _finish(job: _Job) -> None:
    """In the event loop: apply the committed change to memory, then wake the caller."""
    if job.error is None and job.on_commit is not None:
        try:
            job.on_commit(job.result)
        except Exception as exc:
            job.error = exc
    if job.future.done():
        return
    if job.error is not None:
        job.future.set_exception(job.error)
    else:
        job.future.set_result(job.result)


def _check_fields(partition_id: int, record: Record) -> None:
    r = record.req_id
    for name, value in (
        ("client_id", r.client_id),
        ("generation", r.generation),
        ("partition_id", r.partition_id),
        ("seq_num", r.seq_num),
        ("header", record.header),
    ):
        if not INT32_MIN <= value <= INT32_MAX:
            raise StorageAppendError(
                f"partition {partition_id}: transaction {record.transaction_id}: {name} "
                f"{value} is out of range (ReqId fields and the header are signed 32-bit); "
                "nothing was stored"
            )


def _record_from_row(partition_id: int, row: Sequence[Any]) -> Record:
    txid, client_id, generation, req_partition, seq_num, header, checksum, data = row
    data = bytes(data)
    if crc32c.crc32c(data) != checksum:
        raise CorruptionError(
            f"partition {partition_id}: transaction {txid} fails its CRC-32C checksum in the "
            "SQLite database; restore this replica from another one (remove and re-add the "
            "partition)"
        )
    req_id = ReqId(client_id, generation, req_partition, seq_num)
    return Record(txid, req_id, header, data, checksum)


class SqliteStoragePartition(StoragePartition):
    """One partition's log: rows of the ``records`` table."""

    def __init__(self, engine: SqliteStorageEngine, partition_id: int, info: SessionInfo) -> None:
        self._engine = engine
        self.partition_id = partition_id
        self._info = info
        self._max_txid = NO_TRANSACTION
        self._available = True
        self._removed = False

    def _check_open(self) -> None:
        if self._removed:
            raise PartitionClosedError(
                f"partition {self.partition_id} was removed from this storage "
                "(add it again to host it)"
            )
        self._engine.check_open()

    def max_transaction_id(self) -> int:
        self._check_open()
        return self._max_txid

    def session_info(self) -> SessionInfo:
        self._check_open()
        return self._info

    async def set_session_info(self, info: SessionInfo) -> None:
        self._check_open()
        pid = self.partition_id

        def apply(connection: sqlite3.Connection) -> None:
            connection.execute(
                "UPDATE partitions SET session_id = ?, low_water_mark = ?, "
                "local_low_water_mark = ?, low_water_mark_session_id = ? WHERE partition_id = ?",
                (
                    info.session_id,
                    info.low_water_mark,
                    info.local_low_water_mark,
                    info.low_water_mark_session_id,
                    pid,
                ),
            )

        def on_commit(_: object) -> None:
            self._info = info

        await self._engine.write(apply, on_commit)

    def available(self) -> bool:
        self._check_open()
        return self._available

    async def set_available(self, available: bool) -> None:
        self._check_open()
        pid = self.partition_id

        def apply(connection: sqlite3.Connection) -> None:
            connection.execute(
                "UPDATE partitions SET available = ? WHERE partition_id = ?",
                (1 if available else 0, pid),
            )

        def on_commit(_: object) -> None:
            self._available = available

        await self._engine.write(apply, on_commit)

    async def append(self, records: Sequence[Record]) -> None:
        self._check_open()
        if not records:
            return
        pid = self.partition_id
        expected = self._max_txid + 1
        rows: list[tuple[Any, ...]] = []
        for i, record in enumerate(records):
            txid = record.transaction_id
            if txid != expected + i:
                raise StorageAppendError(
                    f"partition {pid}: append of transaction {txid} at position {i} of the "
                    f"batch does not continue the log, which expects {expected + i}; nothing "
                    "was stored (truncate or ask max_transaction_id first)"
                )
            if crc32c.crc32c(record.data) != record.checksum:
                raise ChecksumError(
                    f"partition {pid}: transaction {txid}: the data does not match its "
                    "CRC-32C checksum; nothing was stored"
                )
            _check_fields(pid, record)
            r = record.req_id
            rows.append(
                (
                    pid,
                    txid,
                    r.client_id,
                    r.generation,
                    r.partition_id,
                    r.seq_num,
                    record.header,
                    record.checksum,
                    record.data,
                )
            )
        last = records[-1].transaction_id

        def apply(connection: sqlite3.Connection) -> None:
            connection.executemany(
                f"INSERT INTO records (partition_id, {_RECORD_COLUMNS}, data) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )

        def on_commit(_: object) -> None:
            self._max_txid = last

        await self._engine.write(apply, on_commit)

    async def truncate(self, transaction_id: int) -> None:
        self._check_open()
        if transaction_id < NO_TRANSACTION:
            raise StorageError(f"cannot truncate after transaction {transaction_id} (min -1)")
        if transaction_id >= self._max_txid:
            return
        pid = self.partition_id

        def apply(connection: sqlite3.Connection) -> None:
            connection.execute(
                "DELETE FROM records WHERE partition_id = ? AND transaction_id > ?",
                (pid, transaction_id),
            )

        def on_commit(_: object) -> None:
            self._max_txid = transaction_id

        await self._engine.write(apply, on_commit)

    async def read_record(self, transaction_id: int) -> Record | None:
        records = await self._read(transaction_id, 1, INT64_MAX)
        return records[0] if records else None

    async def read_header(self, transaction_id: int) -> RecordHeader | None:
        headers = await self.read_headers(transaction_id, 1)
        return headers[0] if headers else None

    async def read_records(
        self, start: int, max_records: int, max_bytes: int = 16 * 1024 * 1024
    ) -> list[Record]:
        return await self._read(start, max_records, max_bytes)

    async def _read(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        self._check_open()
        if start < 0 or max_records <= 0 or start > self._max_txid:
            return []
        pid = self.partition_id
        stop = min(self._max_txid, start + max_records - 1)

        def read(connection: sqlite3.Connection) -> list[Record]:
            result: list[Record] = []
            size = 0
            rows = connection.execute(
                f"SELECT {_RECORD_COLUMNS}, data FROM records WHERE partition_id = ? "
                "AND transaction_id BETWEEN ? AND ? ORDER BY transaction_id",
                (pid, start, stop),
            )
            for row in rows:
                size += len(row[-1])
                if result and size > max_bytes:
                    break
                result.append(_record_from_row(pid, row))
            return result

        return await self._engine.read(read)

    async def read_headers(self, start: int, max_records: int) -> list[RecordHeader]:
        self._check_open()
        if start < 0 or max_records <= 0 or start > self._max_txid:
            return []
        pid = self.partition_id
        stop = min(self._max_txid, start + max_records - 1)

        def read(connection: sqlite3.Connection) -> list[RecordHeader]:
            rows = connection.execute(
                "SELECT transaction_id, client_id, generation, req_partition_id, seq_num, header "
                "FROM records WHERE partition_id = ? AND transaction_id BETWEEN ? AND ? "
                "ORDER BY transaction_id",
                (pid, start, stop),
            )
            return [
                RecordHeader(txid, ReqId(client_id, generation, req_partition, seq_num), header)
                for txid, client_id, generation, req_partition, seq_num, header in rows
            ]

        return await self._engine.read(read)


class SqliteStorageEngine(StorageEngine):
    """Storage in one SQLite database file under the location directory."""

    def __init__(
        self,
        *,
        directory: Path,
        options: SqliteOptions,
        cluster_key: uuid.UUID,
        num_partitions: int,
        reader: sqlite3.Connection,
        writer: sqlite3.Connection,
    ) -> None:
        self.directory = directory
        self.options = options
        self._cluster_key = cluster_key
        self._num_partitions = num_partitions
        self._partitions: dict[int, SqliteStoragePartition] = {}
        self._reader = reader
        self._readers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="waltz-sqlite-reader")
        self._writer = _Writer(writer)
        self._writer.start()
        self._closed = False

    # -- opening -----------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        location: str,
        *,
        cluster_key: uuid.UUID | None = None,
        num_partitions: int | None = None,
        options: Mapping[str, Any] | None = None,
        feature_level: int | None = None,
    ) -> SqliteStorageEngine:
        # One format at every cluster feature level (waltz_api.features): the level is
        # recorded (meta) and reported, as the contract asks, and changes nothing else.
        parsed = SqliteOptions.parse(options)
        directory = Path(location)
        level = cls.max_feature_level if feature_level is None else feature_level
        engine = await asyncio.to_thread(
            cls._open_blocking, directory, parsed, cluster_key, num_partitions, level
        )
        try:
            if cluster_key is not None or num_partitions is not None:
                engine.check_cluster_key(
                    cluster_key if cluster_key is not None else engine.cluster_key,
                    num_partitions if num_partitions is not None else engine.num_partitions,
                )
        except BaseException:
            await engine.close()
            raise
        return engine

    @classmethod
    def _open_blocking(
        cls,
        directory: Path,
        options: SqliteOptions,
        cluster_key: uuid.UUID | None,
        num_partitions: int | None,
        feature_level: int,
    ) -> SqliteStorageEngine:
        path = directory / DB_FILE_NAME
        if not path.exists():
            cls._create(
                directory, path, options, cluster_key, num_partitions, feature_level=feature_level
            )
        writer = _connect(path, options)
        try:
            reader = _connect(path, options)
        except BaseException:
            writer.close()
            raise
        try:
            meta = dict(reader.execute("SELECT key, value FROM meta").fetchall())
            version = int(meta.get("format_version", "0"))
            if version == 1:
                _migrate_from_1(writer, path)
                version = FORMAT_VERSION
            if version != FORMAT_VERSION:
                raise CorruptionError(
                    f"{path}: unsupported format version {version} (this engine reads "
                    f"version {FORMAT_VERSION})"
                )
            engine = cls(
                directory=directory,
                options=options,
                cluster_key=uuid.UUID(meta["cluster_key"]),
                num_partitions=int(meta["num_partitions"]),
                reader=reader,
                writer=writer,
            )
            # storage created before feature levels: the first level
            engine._feature_level = int(meta.get("feature_level", str(MIN_FEATURE_LEVEL)))
        except sqlite3.DatabaseError as exc:
            reader.close()
            writer.close()
            raise CorruptionError(f"{path} is not a readable Waltz SQLite storage: {exc}") from exc
        except BaseException:
            reader.close()
            writer.close()
            raise
        try:
            engine._load_partitions()
        except BaseException:
            engine._writer.stop()
            engine._writer.join()
            engine._readers.shutdown(wait=True)
            reader.close()
            raise
        logger.info(
            "sqlite storage at %s open: cluster %s, %d partitions, hosting %s",
            directory,
            engine.cluster_key,
            engine.num_partitions,
            engine.partition_ids() or "none",
        )
        return engine

    def _load_partitions(self) -> None:
        """Recovery is SQLite's own (its WAL); this loads the in-memory state."""
        reader = self._reader
        infos = reader.execute(
            "SELECT partition_id, session_id, low_water_mark, local_low_water_mark, "
            "low_water_mark_session_id, available FROM partitions ORDER BY partition_id"
        ).fetchall()
        tops = dict(
            reader.execute(
                "SELECT partition_id, MAX(transaction_id) FROM records GROUP BY partition_id"
            ).fetchall()
        )
        for pid, session_id, low, local_low, low_session, available in infos:
            info = SessionInfo(session_id, low, local_low, low_session)
            part = SqliteStoragePartition(self, pid, info)
            part._max_txid = tops.get(pid, NO_TRANSACTION)
            part._available = bool(available)
            self._partitions[pid] = part

    @staticmethod
    def _create(
        directory: Path,
        path: Path,
        options: SqliteOptions,
        cluster_key: uuid.UUID | None,
        num_partitions: int | None,
        *,
        feature_level: int,
    ) -> None:
        if cluster_key is None or num_partitions is None:
            raise StorageError(
                f"{directory} is not a Waltz SQLite storage yet: creating one needs the "
                "cluster key and the number of partitions"
            )
        if num_partitions < 1:
            raise StorageError(f"number of partitions must be >= 1, not {num_partitions}")
        temporary = path.with_name(path.name + ".creating")
        if directory.exists():
            others = sorted(p.name for p in directory.iterdir() if p != temporary)
            if others:
                raise StorageError(
                    f"{directory} holds files ({', '.join(others[:5])}) but no {DB_FILE_NAME}: "
                    "it is not a Waltz SQLite storage (perhaps another engine's); choose an "
                    "empty or new directory"
                )
        directory.mkdir(parents=True, exist_ok=True)
        # built under a temporary name and renamed: a crash never leaves a half-made storage
        temporary.unlink(missing_ok=True)
        connection = sqlite3.connect(temporary, isolation_level=None)
        try:
            connection.execute("PRAGMA synchronous=FULL")
            connection.executescript(_SCHEMA)
            connection.execute("BEGIN")
            connection.executemany(
                "INSERT INTO meta (key, value) VALUES (?, ?)",
                [
                    ("format_version", str(FORMAT_VERSION)),
                    ("cluster_key", str(cluster_key)),
                    ("num_partitions", str(num_partitions)),
                    ("feature_level", str(feature_level)),
                ],
            )
            connection.execute("COMMIT")
        finally:
            connection.close()
        temporary.rename(path)
        _fsync_directory(directory)
        logger.info("sqlite storage created at %s for cluster %s", path, cluster_key)

    # -- the engine --------------------------------------------------------------

    @property
    def cluster_key(self) -> uuid.UUID:
        return self._cluster_key

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    async def raise_feature_level(self, level: int) -> None:
        self._check_feature_level(level)
        if level <= self._feature_level:
            return

        def apply(connection: sqlite3.Connection) -> None:
            connection.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('feature_level', ?)",
                (str(level),),
            )

        def on_commit(_: object) -> None:
            self._feature_level = max(self._feature_level, level)

        await self.write(apply, on_commit)

    def check_open(self) -> None:
        if self._closed:
            raise StorageError(f"the sqlite storage at {self.directory} is closed")

    def partition_ids(self) -> list[int]:
        return sorted(self._partitions)

    def partition(self, partition_id: int) -> SqliteStoragePartition:
        part = self._partitions.get(partition_id)
        if part is None:
            raise PartitionNotFoundError(
                f"partition {partition_id} is not hosted by the sqlite storage at "
                f"{self.directory}; hosted: {self.partition_ids() or 'none'} (add it first)"
            )
        return part

    def _check_partition_id(self, partition_id: int) -> None:
        if not 0 <= partition_id < self._num_partitions:
            raise PartitionNotFoundError(
                f"partition {partition_id} does not exist: the cluster has partitions "
                f"0..{self._num_partitions - 1}"
            )

    async def add_partition(self, partition_id: int) -> SqliteStoragePartition:
        self.check_open()
        self._check_partition_id(partition_id)
        existing = self._partitions.get(partition_id)
        if existing is not None:
            return existing
        info = SessionInfo()

        def apply(connection: sqlite3.Connection) -> None:
            connection.execute("DELETE FROM records WHERE partition_id = ?", (partition_id,))
            connection.execute(
                "INSERT OR REPLACE INTO partitions (partition_id, session_id, low_water_mark, "
                "local_low_water_mark, low_water_mark_session_id, available) "
                "VALUES (?, ?, ?, ?, ?, 1)",
                (
                    partition_id,
                    info.session_id,
                    info.low_water_mark,
                    info.local_low_water_mark,
                    info.low_water_mark_session_id,
                ),
            )

        def on_commit(_: object) -> None:
            self._partitions.setdefault(
                partition_id, SqliteStoragePartition(self, partition_id, info)
            )

        await self.write(apply, on_commit)
        return self._partitions[partition_id]

    async def remove_partition(self, partition_id: int) -> None:
        self.check_open()
        self._check_partition_id(partition_id)

        def apply(connection: sqlite3.Connection) -> None:
            connection.execute("DELETE FROM records WHERE partition_id = ?", (partition_id,))
            connection.execute("DELETE FROM partitions WHERE partition_id = ?", (partition_id,))

        def on_commit(_: object) -> None:
            part = self._partitions.pop(partition_id, None)
            if part is not None:
                part._removed = True

        await self.write(apply, on_commit)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.stop()
        await asyncio.to_thread(self._writer.join)
        await asyncio.get_running_loop().run_in_executor(self._readers, self._reader.close)
        self._readers.shutdown(wait=True)

    def stats(self) -> dict[str, int]:
        """Group-commit figures: SQLite commits and the changes they carried."""
        return {"commits": self._writer.commits, "changes": self._writer.jobs}

    # -- threads -------------------------------------------------------------------

    async def write(
        self,
        apply: Callable[[sqlite3.Connection], T],
        on_commit: Callable[[T], None] | None = None,
    ) -> T:
        """Run ``apply`` in the writer thread's next group commit; once it is durable,
        run ``on_commit`` in the loop. A cancelled caller still waits for the commit
        (the change may be on disk), then is cancelled."""
        self.check_open()
        loop = asyncio.get_running_loop()
        job = _Job(apply, on_commit, loop, loop.create_future())
        self._writer.submit(job)
        try:
            result: T = await asyncio.shield(job.future)
        except asyncio.CancelledError:
            if not job.future.done():
                await asyncio.wait([job.future])
            raise
        return result

    async def read(self, query: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``query`` on the reader connection (committed data only)."""
        self.check_open()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, query, self._reader)


def _migrate_from_1(connection: sqlite3.Connection, path: Path) -> None:
    """Version 1 -> 2, in one SQLite transaction: the low-water mark's session (unknown
    for what version 1 wrote) and the availability (available) of each partition."""
    connection.execute("BEGIN IMMEDIATE")
    try:
        connection.execute(
            "ALTER TABLE partitions ADD COLUMN low_water_mark_session_id INTEGER NOT NULL "
            "DEFAULT -1"
        )
        connection.execute("ALTER TABLE partitions ADD COLUMN available INTEGER NOT NULL DEFAULT 1")
        connection.execute(
            "UPDATE meta SET value = ? WHERE key = 'format_version'", (str(FORMAT_VERSION),)
        )
        connection.execute("COMMIT")
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    logger.warning("%s: migrated from format version 1 to %d", path, FORMAT_VERSION)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
