"""Format ``waltz`` with a real local Spark session against a real Waltz cluster."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.datasource import EqualTo, GreaterThanOrEqual, In, LessThan, StringContains

from waltz_api.errors import ConfigError, ServerError
from waltz_api.types import Record
from waltz_spark import LogReader
from waltz_spark.datasource import Settings, WaltzPushdownReader
from waltz_spark.testing import PARTITIONS, BackgroundCluster, append

pytestmark = [pytest.mark.timeout(240), pytest.mark.system, pytest.mark.slow]

COLUMNS = [
    "partition",
    "transaction_id",
    "header",
    "client_id",
    "generation",
    "req_partition",
    "seq_num",
    "data",
]


def log_rows(uri: str) -> list[tuple[Any, ...]]:
    """The committed log of every partition, read directly (no Spark)."""
    rows: list[tuple[Any, ...]] = []
    with LogReader(uri) as reader:
        marks = reader.high_water_marks(range(reader.num_partitions()))
        for p, top in marks.items():
            records: list[Record] = []
            for chunk in reader.read(p, 0, top + 1, max_records=37):
                records.extend(chunk)
            assert [r.transaction_id for r in records] == list(range(top + 1))
            for r in records:
                q = r.req_id
                rows.append(
                    (
                        p,
                        r.transaction_id,
                        r.header,
                        q.client_id,
                        q.generation,
                        q.partition_id,
                        q.seq_num,
                        r.data,
                    )
                )
    return sorted(rows)


def spark_rows(df: Any) -> list[tuple[Any, ...]]:
    return sorted(
        tuple(bytes(v) if isinstance(v, bytearray) else v for v in row) for row in df.collect()
    )


@pytest.fixture(scope="module")
def seeded(cluster: BackgroundCluster) -> list[tuple[Any, ...]]:
    append(cluster.uri, [(i % PARTITIONS, i, f"seed-{i}".encode()) for i in range(240)])
    return log_rows(cluster.uri)


def reader(spark: Any, uri: str, **options: str) -> Any:
    r = spark.read.format("waltz").option("coordination", uri)
    for key, value in options.items():
        r = r.option(key, value)
    return r.load()


def test_batch_read_equals_the_log(spark: Any, cluster: BackgroundCluster, seeded: list) -> None:
    df = reader(spark, cluster.uri, transactionsPerSplit="25")
    assert df.columns == COLUMNS
    assert df.count() == len(seeded) == 240
    assert spark_rows(df) == seeded
    headers = {row[2]: row[7] for row in seeded}
    assert all(data == f"seed-{h}".encode() for h, data in headers.items())


def test_filters_and_options_select_at_the_source(
    spark: Any, cluster: BackgroundCluster, seeded: list
) -> None:
    df = reader(spark, cluster.uri, transactionsPerSplit="10")
    chosen = df.where("partition = 1 AND transaction_id >= 10 AND transaction_id < 30")
    expected = [r for r in seeded if r[0] == 1 and 10 <= r[1] < 30]
    assert spark_rows(chosen) == expected and len(expected) == 20
    listed = df.where("transaction_id IN (3, 5, 77) AND header % 2 = 0")
    assert spark_rows(listed) == [r for r in seeded if r[1] in (3, 5, 77) and r[2] % 2 == 0]
    by_option = reader(
        spark, cluster.uri, partitions="0", startTransactionId="100", endTransactionId="110"
    )
    assert spark_rows(by_option) == [r for r in seeded if r[0] == 0 and 100 <= r[1] < 110]
    with pytest.raises(Exception, match="partitions"):
        reader(spark, cluster.uri, partitions="0,9").count()


def test_pushed_filters_shrink_the_plan(cluster: BackgroundCluster, seeded: list) -> None:
    source = WaltzPushdownReader(
        Settings.of({"coordination": cluster.uri, "transactionsPerSplit": "10"})
    )
    everything = len(source.partitions())
    filters = [
        EqualTo(("partition",), 1),
        GreaterThanOrEqual(("transaction_id",), 10),
        LessThan(("transaction_id",), 30),
        StringContains(("data",), "seed"),
    ]
    left = list(source.pushFilters(filters))
    assert left == [filters[3]]  # ours are applied at the source; Spark keeps the rest
    splits = source.partitions()
    assert len(splits) == 2 < everything
    assert {(s.partition, s.start, s.end) for s in splits} == {(1, 10, 20), (1, 20, 30)}
    listed = WaltzPushdownReader(Settings.of({"coordination": cluster.uri}))
    assert list(listed.pushFilters([In(("transaction_id",), (4, 7))])) == []
    batches = [b for s in listed.partitions() for b in listed.read(s)]
    assert sorted(
        (p, t)
        for b in batches
        for p, t in zip(b.column(0).to_pylist(), b.column(1).to_pylist(), strict=True)
    ) == [(0, 4), (0, 7), (1, 4), (1, 7)]
    with pytest.raises(ConfigError, match="coordination"):
        Settings.of({})


def test_the_reader_pipeline_survives_short_chunks(
    cluster: BackgroundCluster, seeded: list
) -> None:
    """Chunks cut by max_bytes are shorter than asked: the reads asked ahead are dropped."""
    with LogReader(cluster.uri) as log:
        top = log.high_water_mark(1)
        chunks = list(log.read(1, 3, top + 1, max_records=37, max_bytes=100, depth=4))
        with pytest.raises(ServerError, match="not committed"):
            list(log.read(1, 0, top + 5))
    assert any(len(c) < 37 for c in chunks[:-1])
    ids = [r.transaction_id for c in chunks for r in c]
    assert ids == list(range(3, top + 1))
    assert [(1, r.transaction_id, r.data) for c in chunks for r in c] == [
        (r[0], r[1], r[7]) for r in log_rows(cluster.uri) if r[0] == 1 and 3 <= r[1] <= top
    ]


def test_streaming_restart_is_exactly_once(
    spark: Any, cluster: BackgroundCluster, seeded: list, tmp_path: Path
) -> None:
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
    first = spark.read.parquet(str(out)).count()
    assert first >= len(seeded)
    append(cluster.uri, [(i % PARTITIONS, 1000 + i, f"more-{i}".encode()) for i in range(30)])
    run_once()  # restarted from its checkpoint
    written = spark_rows(spark.read.parquet(str(out)).select(*COLUMNS))
    log = log_rows(cluster.uri)
    assert written == log  # nothing lost, nothing twice
    assert len({(r[0], r[1]) for r in written}) == len(written)


def test_writer_round_trips(spark: Any, cluster: BackgroundCluster, seeded: list) -> None:
    with LogReader(cluster.uri) as log:
        before = log.high_water_marks(range(PARTITIONS))
    rows = [(i % PARTITIONS, 5000 + i, f"written-{i}".encode()) for i in range(40)]
    df = spark.createDataFrame(rows, "partition int, header int, data binary").repartition(2)
    df.write.format("waltz").option("coordination", cluster.uri).mode("append").save()
    new = [r for r in log_rows(cluster.uri) if r[1] > before[r[0]]]
    assert sorted((r[0], r[2], r[7]) for r in new) == sorted(rows)
    read_back = reader(spark, cluster.uri).where("header >= 5000 AND header < 6000")
    assert sorted((r[0], r[2], bytes(r[7])) for r in read_back.collect()) == sorted(rows)


def test_a_lock_failure_row_is_reported(spark: Any, cluster: BackgroundCluster) -> None:
    from waltz_spark import RowsRejectedError

    locks = "partition int, header int, data string, locks array<struct<name:string,id:long,mode:string>>, client_high_water_mark long"  # noqa: E501
    with LogReader(cluster.uri) as log:
        built_on = log.high_water_mark(0)
    first = spark.createDataFrame([(0, 7001, "take", [("acct", 9, "write")], built_on)], locks)
    first.write.format("waltz").option("coordination", cluster.uri).mode("append").save()
    # two rows built on the same old state: the locked one conflicts, the other goes in
    stale = spark.createDataFrame(
        [
            (0, 7002, "take again", [("acct", 9, "write")], built_on),
            (0, 7003, "unrelated", [("acct", 10, "write")], built_on),
        ],
        locks,
    ).coalesce(1)
    with pytest.raises(Exception, match="rejected by a lock failure") as failed:
        stale.write.format("waltz").option("coordination", cluster.uri).mode("append").save()
    assert "take again" in str(failed.value) and "unrelated" not in str(failed.value)
    assert RowsRejectedError.__name__ in str(failed.value)
    time.sleep(0)  # the appended row is visible to a new read at once
    headers = [r.header for r in reader(spark, cluster.uri, partitions="0").collect()]
    assert 7001 in headers and 7003 in headers and 7002 not in headers
    ignored = spark.createDataFrame(
        [(0, 7004, "again", ["acct:9"], built_on)],
        "partition int, header int, data string, locks array<string>, client_high_water_mark long",
    )
    ignored.write.format("waltz").option("coordination", cluster.uri).option(
        "onLockFailure", "ignore"
    ).mode("append").save()
    assert 7004 not in [r.header for r in reader(spark, cluster.uri, partitions="0").collect()]


def test_bank_report_balances_equal_the_operations(
    spark: Any, cluster: BackgroundCluster, tmp_path: Path
) -> None:
    import json
    import random

    from waltz_bank.spark_jobs import bank_report

    rng = random.Random(5)
    ops: list[dict[str, Any]] = []
    for i in range(60):
        kind = ["deposit", "withdraw", "transfer", "audit"][i % 4]
        if kind == "transfer":
            ops.append({"id": i, "op": kind, "source": rng.randrange(5), "target": 5 + i % 3,
                        "amount": rng.randint(1, 50)})  # fmt: skip
        elif kind == "audit":
            ops.append({"id": i, "op": kind, "accounts": [0, 1], "total": 0})
        else:
            ops.append({"id": i, "op": kind, "account": rng.randrange(8),
                        "amount": rng.randint(1, 50)})  # fmt: skip
    append(cluster.uri, [(i % PARTITIONS, 9000 + i, json.dumps(op).encode()) for i, op in
                         enumerate(ops)])  # fmt: skip
    expected: dict[int, int] = {}
    for op in ops:
        if op["op"] == "deposit":
            expected[op["account"]] = expected.get(op["account"], 0) + op["amount"]
        elif op["op"] == "withdraw":
            expected[op["account"]] = expected.get(op["account"], 0) - op["amount"]
        elif op["op"] == "transfer":
            expected[op["source"]] = expected.get(op["source"], 0) - op["amount"]
            expected[op["target"]] = expected.get(op["target"], 0) + op["amount"]
    figures = bank_report(spark, cluster.uri, tmp_path / "report")
    balances = {
        r["account"]: r["balance"]
        for r in spark.read.parquet(str(tmp_path / "report" / "balances")).collect()
    }
    assert balances == expected
    summary = {
        r["op"]: (r["count"], r["amount"])
        for r in spark.read.parquet(str(tmp_path / "report" / "summary")).collect()
    }
    assert summary["audit"] == (15, 0)
    assert summary["deposit"] == (15, sum(o["amount"] for o in ops if o["op"] == "deposit"))
    assert figures["operations"] == {"deposit": 15, "withdraw": 15, "transfer": 15, "audit": 15}
    assert figures["total_balance"] == sum(expected.values())
