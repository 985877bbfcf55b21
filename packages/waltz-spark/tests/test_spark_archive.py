"""Format ``waltz`` over a partly archived log (docs/archive.md, "Spark"): a real cluster
whose server archives, each partition about half archived (the storage nodes deleted
that half) and half live; a real local Spark. The archive is a local directory, and for
one test a real S3-compatible server (moto on loopback) that the executors read through
s3fs. About 25 s with Spark's start."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_spark_source import COLUMNS, log_rows, reader, spark_rows

from waltz_spark import LogReader
from waltz_spark.archived import ArchiveSplit
from waltz_spark.datasource import Settings, Split, WaltzPushdownReader
from waltz_spark.testing import PARTITIONS, BackgroundCluster, append

pytestmark = [pytest.mark.timeout(240), pytest.mark.system, pytest.mark.slow]

KEEP = 100
"""Transactions kept local (not archived) per partition."""


BATCH = 4
"""Records per storage append (the server's ``max_batch_records``). A replica deletes
archived records by whole segments, and a segment rolls only between two appends: a
replica that lags is sent its backlog in big appends (up to ``max_batch_records``, 512
by default, times the 4 appends in flight, merged by the storage node), so its first
segment can reach past the mark (a failing run: all of 0..209 in one segment, the mark
at 109), and stays until the mark passes it. With 4, a segment (4096 bytes, about 80
records) ends at most 16 records late, below the mark, on every replica however loaded
the machine."""


def _lag(node: Any) -> threading.Event:
    """Make ``node`` a lagging replica: its second append of each partition waits until
    the event returned is set (at most 30 s; the server queues what it sends it
    meanwhile, the other two commit)."""
    release = threading.Event()
    for partition_id in range(PARTITIONS):
        stored = node.engine.partition(partition_id)
        append_now = stored.append
        calls = itertools.count(1)

        async def append_late(
            records: Any, append_now: Any = append_now, calls: Any = calls
        ) -> Any:
            if next(calls) == 2:
                await asyncio.to_thread(release.wait, 30)
            return await append_now(records)

        stored.append = append_late
    return release


ARCHIVE = {
    "min_range_bytes": 1,
    "max_range_bytes": 6000,
    "max_local_bytes": 0,
    "max_local_age": 0,
    "keep_local_transactions": KEEP,
    "row_group_bytes": 2048,
    "interval": 0.1,
}
"""The server's ``[server.archive]`` but its url and storage options."""


def _wait_archived(running: BackgroundCluster, which: Callable[[Any], bool]) -> dict[int, int]:
    """Until each partition's archive mark is within ``KEEP`` (and 5) of its high-water
    mark and the storage nodes ``which`` says deleted every segment within it; the
    marks. On the deadline, fails with every replica's segments."""
    deadline = time.monotonic() + 120
    while True:
        with LogReader(running.uri) as log:
            marks = log.archive_marks(range(PARTITIONS))
            tops = log.high_water_marks(range(PARTITIONS))
        extents = [
            [(e.first, e.last, e.size) for e in node.engine.partition(p).local_extents()]
            for node in running.nodes
            for p in range(PARTITIONS)
        ]
        held = [
            node.engine.partition(p).log_start() > 0
            and all(e.last > marks[p].mark for e in node.engine.partition(p).local_extents())
            for node in running.nodes
            if which(node)
            for p in range(PARTITIONS)
        ]
        if all(marks[p].mark >= tops[p] - KEEP - 5 for p in range(PARTITIONS)) and all(held):
            return {p: marks[p].mark for p in range(PARTITIONS)}
        if time.monotonic() >= deadline:
            raise AssertionError(f"not archived: {marks} {tops}, segments {extents}")
        time.sleep(0.2)


@contextlib.contextmanager
def half_archived(
    root: Path,
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    lagging: bool = False,
) -> Iterator[tuple[BackgroundCluster, dict]]:
    """A running cluster archiving to ``url``, each partition about half archived (its
    storage nodes deleted that half); its archive marks. ``lagging``: storage node 0
    lags behind the others until every append is committed (see :data:`BATCH`)."""
    settings = {
        "max_batch_records": BATCH,
        "archive": {"url": url, "storage_options": storage_options or {}, **ARCHIVE},
    }
    running = BackgroundCluster(
        root, server_settings=settings, storage_options={"segment_size": 4096}
    )
    running.start()
    try:
        release = _lag(running.nodes[0]) if lagging else threading.Event()
        append(running.uri, [(i % PARTITIONS, i, f"row-{i}".encode() * 3) for i in range(420)])
        release.set()
        yield running, _wait_archived(running, lambda node: True)
    finally:
        running.stop()


@pytest.fixture(scope="module")
def half(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BackgroundCluster, dict]]:
    root = tmp_path_factory.mktemp("archived")
    with half_archived(root, f"file://{root / 'archive'}") as running:
        yield running


def test_half_archived_half_live_equals_the_log(spark: Any, half: tuple) -> None:
    cluster, marks = half
    log = log_rows(cluster.uri)  # through the server: it reads the archived half too
    assert len(log) == 420
    df = reader(spark, cluster.uri, transactionsPerSplit="60")
    assert df.columns == COLUMNS
    assert spark_rows(df) == log
    through_servers = reader(spark, cluster.uri, archive="false")
    assert spark_rows(through_servers) == log
    # the seam, exactly: each id once on either side of every partition's mark
    near = " OR ".join(
        f"(partition = {p} AND transaction_id BETWEEN {m - 3} AND {m + 3})"
        for p, m in marks.items()
    )
    seam = spark_rows(df.where(near))
    assert seam == [
        r for r in log if any(r[0] == p and m - 3 <= r[1] <= m + 3 for p, m in marks.items())
    ]
    assert len(seam) == 7 * len(marks)


def test_the_plan_cuts_at_the_mark(half: tuple) -> None:
    cluster, marks = half
    source = WaltzPushdownReader(
        Settings.of({"coordination": cluster.uri, "transactionsPerSplit": "25"})
    )
    splits = source.partitions()
    for p, mark in marks.items():
        archived = sorted(
            (s.start, s.end) for s in splits if isinstance(s, ArchiveSplit) and s.partition == p
        )
        live = sorted((s.start, s.end) for s in splits if isinstance(s, Split) and s.partition == p)
        assert archived and live
        covered = archived + live
        assert covered[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(covered))
        assert archived[-1][1] == mark + 1 == live[0][0]  # no gap, no overlap
    rows = [b for s in splits if isinstance(s, ArchiveSplit) for b in source.read(s)]
    assert sum(b.num_rows for b in rows) == sum(m + 1 for m in marks.values())


def test_streaming_from_the_beginning_crosses_into_the_live_log(
    spark: Any, half: tuple, tmp_path: Path
) -> None:
    cluster, _ = half
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    def run_once() -> None:
        stream = spark.readStream.format("waltz").option("coordination", cluster.uri).load()
        query = (
            stream.writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(processingTime="200 milliseconds")
            .start()
        )
        try:
            query.processAllAvailable()
        finally:
            query.stop()

    run_once()
    written = spark_rows(spark.read.parquet(str(out)).select(*COLUMNS))
    assert written == log_rows(cluster.uri)


def test_a_half_archived_log_on_s3_is_read_by_the_executors(
    spark: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The archive on a real S3-compatible server (moto on loopback): the executors read
    the archived half through s3fs with ``archiveStorageOptions``, the rest comes from
    the servers, and the whole equals the log."""
    from waltz_archive.testing import S3Server

    root = tmp_path_factory.mktemp("archived-s3")
    with S3Server(root / "s3") as s3:
        s3.create_bucket("spark-archive")
        with half_archived(root, s3.url("spark-archive"), s3.storage_options) as (
            cluster,
            marks,
        ):
            options = json.dumps(s3.storage_options)
            log = log_rows(cluster.uri)
            settings = Settings.of({"coordination": cluster.uri, "archiveStorageOptions": options})
            splits = WaltzPushdownReader(settings).partitions()
            archived = [s for s in splits if isinstance(s, ArchiveSplit)]
            assert archived and all(s.url.startswith("s3://") for s in archived)
            assert {s.partition for s in archived} == set(marks)
            df = reader(spark, cluster.uri, archiveStorageOptions=options)
            assert spark_rows(df) == log


def test_a_lagging_replica_deletes_the_archived_half_too(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Storage node 0 lags until the others committed every append (the server then
    sends it its backlog in bigger appends): it too deletes the archived half within the
    fixture's deadline (the spark env's failure, without the fixture's cap: its first
    segment held all of 0..209, the mark at 109)."""
    root = tmp_path_factory.mktemp("lagging")
    with half_archived(root, f"file://{root / 'archive'}", lagging=True) as (cluster, marks):
        lagging = cluster.nodes[0].engine
        for p, mark in marks.items():
            assert lagging.partition(p).log_start() > 0
            assert all(e.last > mark for e in lagging.partition(p).local_extents())


def test_a_replica_whose_segment_reaches_past_the_mark_is_deleted_once_the_mark_passes(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Without the fixture's cap: storage node 0 lags, so one of its segments reaches past
    the archive mark and it keeps it while the others delete theirs; once more appends
    move the mark past that segment, node 0 deletes it too (the owner asks again every
    round: a replica is never left behind for good)."""
    root = tmp_path_factory.mktemp("past-the-mark")
    settings = {"archive": {"url": f"file://{root / 'archive'}", **ARCHIVE}}
    running = BackgroundCluster(
        root, server_settings=settings, storage_options={"segment_size": 4096}
    )
    running.start()
    try:
        release = _lag(running.nodes[0])
        append(running.uri, [(i % PARTITIONS, i, f"row-{i}".encode() * 3) for i in range(420)])
        release.set()
        first = _wait_archived(running, lambda node: node is not running.nodes[0])
        held = [
            e.last
            for p in range(PARTITIONS)
            for e in running.nodes[0].engine.partition(p).local_extents()[:1]
            if e.last > first[p]
        ]
        assert held, "node 0 did not lag: its segments all end below the mark"
        append(running.uri, [(i % PARTITIONS, i, b"more") for i in range(420, 840)])
        marks = _wait_archived(running, lambda node: True)
        assert all(marks[p] > first[p] for p in range(PARTITIONS))
    finally:
        running.stop()
