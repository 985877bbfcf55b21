"""Waltz as a PySpark 4 Python data source: format ``waltz`` (batch, streaming, write).

::

    import waltz_spark
    waltz_spark.register(spark)     # the data source, and filter pushdown enabled
    df = spark.read.format("waltz").option("coordination", uri).load()

Options (all strings, as Spark passes them):

- ``coordination`` (required): the cluster's coordination URI.
- ``partitions``: comma-separated Waltz partitions to read (default: all).
- ``startTransactionId`` (inclusive) / ``endTransactionId`` (exclusive): the id range
  of a batch read (default: the whole committed log at planning time).
- ``transactionsPerSplit``: transactions per Spark input partition (default 250000).
- ``transport``: the transport plugin (default ``zmq``).
- ``filterPushdown``: ``false`` to use a reader without ``pushFilters`` (when the session
  does not set ``spark.sql.python.filterPushdown.enabled``).
- streaming: ``startingOffsets`` = ``earliest`` (default) or ``latest``;
  ``maxTransactionsPerTrigger``: at most this many transactions per micro-batch, over
  all partitions (default: no limit, every micro-batch reads all that is committed).
- write: ``onLockFailure`` = ``error`` (default: the job fails after the other rows
  were appended, with an error listing the rejected rows) or ``ignore``; ``timeout``
  seconds for each row (default 120).
- the archive (docs/archive.md): ids at or below a partition's archive mark are read
  from its Parquet files by the executors (no server in the path), the rest through the
  servers. ``archive`` = ``false`` reads everything through the servers;
  ``archiveUrl`` and ``archiveStorageOptions`` (a JSON object of fsspec options) name
  the archive when the mark's URL is not enough (credentials, an endpoint);
  ``verifyRecordChecksums`` = ``true`` checks every archived record's CRC-32C (Parquet's
  page checksums and the ids are always checked).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceWriter,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
    WriterCommitMessage,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StructField,
    StructType,
)

from waltz_api.errors import ConfigError, LockFailureError
from waltz_api.types import Record
from waltz_spark.archived import ArchiveOptions, ArchiveSplit, read_archive_split, split_archived
from waltz_spark.blocks import block_to_batch
from waltz_spark.reader import Endpoint, LogReader

log = logging.getLogger(__name__)

FORMAT = "waltz"
DEFAULT_SPLIT = 250_000
INT64_MAX = 2**63 - 1

SCHEMA = StructType(
    [
        StructField("partition", IntegerType(), False),
        StructField("transaction_id", LongType(), False),
        StructField("header", IntegerType(), False),
        StructField("client_id", IntegerType(), False),
        StructField("generation", IntegerType(), False),
        StructField("req_partition", IntegerType(), False),
        StructField("seq_num", IntegerType(), False),
        StructField("data", BinaryType(), False),
    ]
)
ARROW_SCHEMA = pa.schema(
    [
        pa.field("partition", pa.int32(), False),
        pa.field("transaction_id", pa.int64(), False),
        pa.field("header", pa.int32(), False),
        pa.field("client_id", pa.int32(), False),
        pa.field("generation", pa.int32(), False),
        pa.field("req_partition", pa.int32(), False),
        pa.field("seq_num", pa.int32(), False),
        pa.field("data", pa.binary(), False),
    ]
)


def register(spark: Any) -> None:
    """Register format ``waltz`` with ``spark`` and enable Python filter pushdown."""
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(WaltzDataSource)


# -- options -----------------------------------------------------------------------------------


def _int_option(options: Mapping[str, str], key: str, default: int | None) -> int | None:
    """``key`` is the lower-cased option name (Spark's options are case-insensitive)."""
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"option {key!r} must be an integer, got {raw!r}", key=key) from None


@dataclass
class Settings:
    coordination: str
    transport: str
    partitions: tuple[int, ...] | None
    start: int
    end: int | None
    split: int
    archive: ArchiveOptions = field(default_factory=ArchiveOptions)

    @classmethod
    def of(cls, given: Mapping[str, str]) -> Settings:
        options = {key.lower(): value for key, value in given.items()}
        coordination = options.get("coordination", "")
        if not coordination:
            raise ConfigError(
                "the waltz data source needs the `coordination` option, the cluster's "
                "coordination URI: .option('coordination', 'zk://127.0.0.1:2181/waltz')",
                key="coordination",
            )
        partitions: tuple[int, ...] | None = None
        raw = options.get("partitions", "")
        if raw.strip():
            try:
                partitions = tuple(sorted({int(p) for p in raw.split(",") if p.strip()}))
            except ValueError:
                raise ConfigError(
                    f"option 'partitions' is a comma-separated list of integers, got {raw!r}",
                    key="partitions",
                ) from None
        start = _int_option(options, "starttransactionid", 0)
        assert start is not None
        split = _int_option(options, "transactionspersplit", DEFAULT_SPLIT)
        assert split is not None
        if split < 1:
            raise ConfigError("option 'transactionsPerSplit' must be >= 1", key="partitions")
        return cls(
            coordination=coordination,
            transport=options.get("transport", "zmq") or "zmq",
            partitions=partitions,
            start=max(start, 0),
            end=_int_option(options, "endtransactionid", None),
            split=split,
            archive=ArchiveOptions.of(options),
        )

    def reader(self) -> LogReader:
        return LogReader(self.coordination, transport=self.transport)

    def chosen(self, reader: LogReader) -> list[int]:
        count = reader.num_partitions()
        if self.partitions is None:
            return list(range(count))
        unknown = [p for p in self.partitions if not 0 <= p < count]
        if unknown:
            raise ConfigError(
                f"partitions {unknown} do not exist (the cluster has {count}: 0..{count - 1})",
                key="partitions",
            )
        return list(self.partitions)


# -- filters -------------------------------------------------------------------------------------


@dataclass
class Bounds:
    """What the pushed filters allow: partitions and a transaction id range [low, high)."""

    partitions: set[int] | None = None
    low: int = 0
    high: int = INT64_MAX
    ids: frozenset[int] | None = None
    partition_low: int = 0
    partition_high: int = 2**31

    def allow_partitions(self, values: Iterable[int]) -> None:
        chosen = set(values)
        self.partitions = chosen if self.partitions is None else self.partitions & chosen

    def take(self, f: Filter) -> bool:
        """Apply ``f`` when it is on partition or transaction_id; False: not ours."""
        attribute: tuple[str, ...] = getattr(f, "attribute", ())
        if len(attribute) != 1 or attribute[0] not in ("partition", "transaction_id"):
            return False
        column = attribute[0]
        if isinstance(f, In):
            values = [v for v in f.value if isinstance(v, int) and not isinstance(v, bool)]
            if len(values) != len(f.value):
                return False
            if column == "partition":
                self.allow_partitions(values)
            else:
                chosen = frozenset(values)
                self.ids = chosen if self.ids is None else self.ids & chosen
            return True
        value = getattr(f, "value", None)
        if not isinstance(value, int) or isinstance(value, bool):
            return False
        if column == "partition":
            if isinstance(f, EqualTo):
                self.allow_partitions([value])
                return True
            low, high = {
                GreaterThan: (value + 1, None),
                GreaterThanOrEqual: (value, None),
                LessThan: (None, value),
                LessThanOrEqual: (None, value + 1),
            }.get(type(f), (None, None))
            if low is None and high is None:
                return False
            if low is not None:
                self.partition_low = max(self.partition_low, low)
            if high is not None:
                self.partition_high = min(self.partition_high, high)
            return True
        if isinstance(f, EqualTo):
            self.low, self.high = max(self.low, value), min(self.high, value + 1)
        elif isinstance(f, GreaterThan):
            self.low = max(self.low, value + 1)
        elif isinstance(f, GreaterThanOrEqual):
            self.low = max(self.low, value)
        elif isinstance(f, LessThan):
            self.high = min(self.high, value)
        elif isinstance(f, LessThanOrEqual):
            self.high = min(self.high, value + 1)
        else:
            return False
        return True

    def keeps_partition(self, p: int) -> bool:
        if self.partitions is not None and p not in self.partitions:
            return False
        return self.partition_low <= p < self.partition_high


# -- reading --------------------------------------------------------------------------------


@dataclass
class Split(InputPartition):
    """One Spark input partition: transactions ``start <= id < end`` of a Waltz partition."""

    partition: int
    start: int
    end: int
    endpoint: str = ""
    generation: int = 0
    ids: frozenset[int] | None = field(default=None)

    def __post_init__(self) -> None:
        InputPartition.__init__(self, (self.partition, self.start, self.end))


def plan(
    settings: Settings,
    reader: LogReader,
    ranges: dict[int, tuple[int, int]],
    ids: frozenset[int] | None = None,
) -> list[InputPartition]:
    """The splits of each partition's ``[start, end)``: Parquet scans up to its archive
    mark, then range reads through the servers."""
    archived, live = split_archived(settings.archive, reader, ranges, settings.split, ids)
    return [*archived, *plan_splits(reader, live, settings.split, ids)]


def read_any(settings: Settings, partition: InputPartition) -> Iterator[pa.RecordBatch]:
    if isinstance(partition, ArchiveSplit):
        yield from read_archive_split(partition, ARROW_SCHEMA, settings.archive.verify_records)
    else:
        assert isinstance(partition, Split)
        yield from read_split(settings.coordination, settings.transport, partition)


def plan_splits(
    reader: LogReader,
    ranges: dict[int, tuple[int, int]],
    split: int,
    ids: frozenset[int] | None = None,
) -> list[Split]:
    """Cut each partition's ``[start, end)`` into splits of at most ``split`` transactions."""
    splits: list[Split] = []
    for p, (start, end) in sorted(ranges.items()):
        if end <= start:
            continue
        where = reader.locate(p)
        for at in range(start, end, split):
            chunk = Split(p, at, min(at + split, end), where.endpoint, where.generation, ids)
            if ids is None or any(chunk.start <= i < chunk.end for i in ids):
                splits.append(chunk)
    return splits


def records_to_batch(partition: int, records: Sequence[Record]) -> pa.RecordBatch:
    n = len(records)
    ids = [r.transaction_id for r in records]
    req_ids = [r.req_id for r in records]
    return pa.RecordBatch.from_arrays(
        [
            pa.array([partition] * n, pa.int32()),
            pa.array(ids, pa.int64()),
            pa.array([r.header for r in records], pa.int32()),
            pa.array([q.client_id for q in req_ids], pa.int32()),
            pa.array([q.generation for q in req_ids], pa.int32()),
            pa.array([q.partition_id for q in req_ids], pa.int32()),
            pa.array([q.seq_num for q in req_ids], pa.int32()),
            pa.array([r.data for r in records], pa.binary()),
        ],
        schema=ARROW_SCHEMA,
    )


def read_split(coordination: str, transport: str, split: Split) -> Iterator[pa.RecordBatch]:
    """The committed records of ``split`` as Arrow record batches (runs on executors):
    each range read's block (checksums and ids verified) cut into columns with numpy,
    no Python object per row."""
    with LogReader(coordination, transport=transport) as reader:
        if split.endpoint:
            reader.prime(split.partition, Endpoint(split.endpoint, split.generation))
        for block, offsets in reader.read_blocks(split.partition, split.start, split.end):
            batch = block_to_batch(split.partition, block, offsets, ARROW_SCHEMA, split.ids)
            if batch.num_rows:
                yield batch


class WaltzBatchReader(DataSourceReader):
    """Batch reads, planned from the high-water marks on the driver."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.bounds = Bounds()

    def partitions(self) -> Sequence[InputPartition]:
        s = self.settings
        with s.reader() as reader:
            chosen = [p for p in s.chosen(reader) if self.bounds.keeps_partition(p)]
            marks = reader.high_water_marks(chosen)
            ranges: dict[int, tuple[int, int]] = {}
            for p in chosen:
                top = marks[p] + 1
                end = top if s.end is None else min(s.end, top)
                ranges[p] = (max(s.start, self.bounds.low), min(end, self.bounds.high))
            splits = plan(s, reader, ranges, self.bounds.ids)
        log.info("waltz: %d splits over partitions %s", len(splits), chosen)
        return splits

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from read_any(self.settings, partition)


class WaltzPushdownReader(WaltzBatchReader):
    """The batch reader with ``pushFilters``: filters on ``partition`` and
    ``transaction_id`` (=, <, <=, >, >=, IN) are applied at the source."""

    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:
        for f in filters:
            if not self.bounds.take(f):
                yield f


# -- streaming ----------------------------------------------------------------------------------


def _offsets(marks: dict[int, int]) -> dict[str, int]:
    return {str(p): mark for p, mark in sorted(marks.items())}


def admit(base: Mapping[str, int], marks: Mapping[str, int], limit: int) -> dict[str, int]:
    """The end offset of a micro-batch starting after ``base`` that reads at most
    ``limit`` transactions of those up to ``marks``: a max-min fair share per partition
    (a partition with less available gives its unused share to the others), and at
    least one transaction when any is available."""
    available = {p: max(0, int(m) - int(base.get(p, -1))) for p, m in marks.items()}
    end = {p: int(base.get(p, -1)) for p in marks}
    budget = limit
    waiting = sorted((n, p) for p, n in available.items() if n > 0)
    for i, (n, p) in enumerate(waiting):
        take = min(n, budget // (len(waiting) - i))
        end[p] += take
        budget -= take
    return {p: max(end[p], int(base.get(p, -1))) for p in sorted(end, key=int)}


class WaltzStreamReader(DataSourceStreamReader):
    """Micro-batches of committed transactions.

    An offset is ``{"<partition>": <last transaction id included>}`` (JSON): the
    partitions' committed high-water marks when the micro-batch was planned. A
    micro-batch covers, per partition, ``start + 1 .. end`` (ids above the previous
    offset, up to the new one), so a restart from the checkpoint's offsets reads
    each transaction exactly once.

    Admission control (``maxTransactionsPerTrigger``): PySpark 4.1's Python stream
    reader gets no read limit from Spark (``latestOffset()`` has no arguments), so the
    reader applies its own: the next end offset is at most the limit past the end of
    the last micro-batch it planned. It learns that end from Spark's calls:
    ``partitions(start, end)`` (every micro-batch, including one re-run after a
    restart) and, on a restart, Spark's ``setLatestSeenOffset``, which calls
    ``partitions(latest, latest)`` before the first ``latestOffset``; before any of
    them (a new query) the stream stands at its initial offset."""

    def __init__(self, settings: Settings, starting: str, limit: int | None = None) -> None:
        if starting not in ("earliest", "latest"):
            raise ConfigError(
                f"option 'startingOffsets' is 'earliest' or 'latest', got {starting!r}",
                key="startingOffsets",
            )
        if limit is not None and limit < 1:
            raise ConfigError(
                f"option 'maxTransactionsPerTrigger' must be >= 1, got {limit}",
                key="maxTransactionsPerTrigger",
            )
        self.settings = settings
        self.starting = starting
        self.limit = limit
        self.planned: dict[str, int] | None = None
        """The end offset of the last micro-batch planned (None: none yet)."""
        self._initial: dict[str, int] | None = None
        self._reader: LogReader | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_reader"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _log(self) -> LogReader:
        if self._reader is None:
            self._reader = self.settings.reader()
        return self._reader

    def _marks(self) -> dict[int, int]:
        with self._lock:
            reader = self._log()
            return reader.high_water_marks(self.settings.chosen(reader))

    def initialOffset(self) -> dict[str, int]:
        """Where a new query starts (computed once: Spark 4.1 asks for the latest offset
        of a new query's first micro-batch before its initial offset)."""
        if self._initial is None:
            if self.starting == "latest":
                self._initial = _offsets(self._marks())
            else:
                with self._lock:
                    reader = self._log()
                    self._initial = {
                        str(p): self.settings.start - 1 for p in self.settings.chosen(reader)
                    }
        return dict(self._initial)

    def latestOffset(
        self, start: dict[str, Any] | None = None, limit: Any = None
    ) -> dict[str, int]:
        """The committed high-water marks, capped by ``maxTransactionsPerTrigger`` past
        the last planned end (Spark 4.2+ would pass ``start``; 4.1 passes nothing)."""
        marks = self._marks()
        if self.settings.end is not None:
            marks = {p: min(m, self.settings.end - 1) for p, m in marks.items()}
        latest = _offsets(marks)
        if self.limit is None:
            return latest
        base = start if start is not None else self.planned
        if base is None:  # a new query: its first micro-batch starts at the initial offset
            base = self.initialOffset()
        base_ints = {str(p): int(v) for p, v in base.items()}
        return admit(base_ints, latest, self.limit)

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        self.planned = {str(p): int(top) for p, top in end.items()}
        ranges = {int(p): (int(start.get(p, -1)) + 1, int(top) + 1) for p, top in end.items()}
        with self._lock:
            return plan(self.settings, self._log(), ranges)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        yield from read_any(self.settings, partition)

    def commit(self, end: dict[str, int]) -> None:
        log.debug("waltz stream: committed through %s", json.dumps(end))

    def stop(self) -> None:
        with self._lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None


# -- writing --------------------------------------------------------------------------------------


@dataclass
class WriteResult(WriterCommitMessage):
    """What one Spark task appended: the count, and the rows a lock check rejected."""

    appended: int
    rejected: list[dict[str, Any]]


class RowsRejectedError(LockFailureError):
    """Rows of a write were rejected by a lock check (the other rows were appended)."""

    def __init__(self, rejected: list[dict[str, Any]], appended: int) -> None:
        self.rejected = rejected
        self.appended = appended
        shown = "\n".join(f"  {json.dumps(row, default=repr)}" for row in rejected[:50])
        more = f"\n  ... and {len(rejected) - 50} more" if len(rejected) > 50 else ""
        super().__init__(
            f"waltz write: {len(rejected)} row(s) rejected by a lock failure (not appended; "
            f"{appended} other row(s) were appended). Re-read the log and submit them again, "
            f"or write with .option('onLockFailure', 'ignore'):\n{shown}{more}",
            max(int(row.get("conflicting_transaction_id") or -1) for row in rejected),
        )


class WaltzWriter(DataSourceWriter):
    """Appends each row as one transaction through the Waltz client.

    Columns: ``partition`` (int, default 0), ``header`` (int, default 0), ``data``
    (binary or string), optional ``locks`` (array of struct<name string, id long,
    mode string> or of "name:id" strings, which are write locks) and optional
    ``client_high_water_mark`` (long: the mark the row was built on, which read and
    write locks are checked against; default: the partition's high-water mark
    when the task started, advanced by the feed)."""

    def __init__(self, settings: Settings, given: Mapping[str, str]) -> None:
        self.settings = settings
        options = {key.lower(): value for key, value in given.items()}
        policy = options.get("onlockfailure", "error") or "error"
        if policy not in ("error", "ignore"):
            raise ConfigError(
                f"option 'onLockFailure' is 'error' or 'ignore', got {policy!r}",
                key="onLockFailure",
            )
        self.policy = policy
        self.timeout = float(options.get("timeout", "120") or "120")

    def write(self, iterator: Iterator[Any]) -> WriteResult:
        from waltz_spark.writer import append_rows

        rows = (row.asDict(recursive=False) for row in iterator)
        appended, rejected = append_rows(
            self.settings.coordination, self.settings.transport, rows, self.timeout
        )
        return WriteResult(appended, rejected)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        results = [m for m in messages if isinstance(m, WriteResult)]
        appended = sum(m.appended for m in results)
        rejected = [row for m in results for row in m.rejected]
        log.info("waltz write: %d appended, %d rejected", appended, len(rejected))
        if rejected and self.policy == "error":
            raise RowsRejectedError(rejected, appended)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        results = [m for m in messages if isinstance(m, WriteResult)]
        log.warning(
            "waltz write aborted: %d row(s) were appended before (a log is append-only)",
            sum(m.appended for m in results),
        )


# -- the data source -------------------------------------------------------------------------------


class WaltzDataSource(DataSource):
    """Format ``waltz``: read (batch and streaming) and append Waltz transactions."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        settings = Settings.of(dict(self.options))
        if str(self.options.get("filterPushdown", "true")).lower() == "false":
            return WaltzBatchReader(settings)
        return WaltzPushdownReader(settings)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        settings = Settings.of(dict(self.options))
        options = {key.lower(): value for key, value in dict(self.options).items()}
        limit = _int_option(options, "maxtransactionspertrigger", None)
        return WaltzStreamReader(
            settings, options.get("startingoffsets", "earliest") or "earliest", limit
        )

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise ConfigError("a Waltz log is append-only: write with .mode('append')", key="mode")
        return WaltzWriter(Settings.of(dict(self.options)), dict(self.options))
