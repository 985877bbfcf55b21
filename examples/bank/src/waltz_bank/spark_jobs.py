"""The bank demo's pipeline jobs on the Waltz log, on Apache Spark through the ``waltz``
data source of waltz-spark (``pip install 'waltz-example-bank[spark]'``).

The bank's log holds one JSON operation per transaction (``waltz_bank.bank``):
``deposit {account, amount}``, ``withdraw {account, amount}``, ``transfer {source,
target, amount}`` and ``audit {accounts, total}``, each with an ``id`` and a ``ts``
(milliseconds since the Unix epoch, UTC; records written before ``ts`` existed have
none). Transactions that are not bank operations are skipped.

:func:`bank_report` (batch) reads the whole log with the ``waltz`` data source and
writes, under ``out``:

- ``balances/`` (Parquet): one row per account (``account``, ``balance``,
  ``deposited``, ``withdrawn``, ``transferred_in``, ``transferred_out``, ``operations``);
- ``summary/`` (Parquet): one row per operation kind (``op``, ``count``, ``amount``);
- ``daily/`` (Parquet): one row per UTC day (``day``; null for operations without
  ``ts``): ``operations``, ``deposits``, ``withdrawals``, ``transfers``, ``audits``
  (counts), ``deposited``, ``withdrawn``, ``transferred`` (amounts), ``volume`` (the
  three amounts together), ``net_flow`` (deposited - withdrawn: the change of the money
  in the bank) and ``accounts`` (distinct accounts whose balance a deposit, withdrawal
  or transfer changed that day);
- ``positions/`` (Parquet): the log position covered (``high_water_mark`` per partition);
- ``daily_volume.svg``: a stacked bar chart of the daily amounts by operation.

:func:`start_bank_stream` (streaming) keeps per-account balances, the per-operation
summary and the positions current in a SQLite database, exactly once across restarts
(see :class:`BankStreamSink`).

Both run from ``waltz spark bank-report`` / ``waltz spark bank-stream`` (commands this
package adds to the ``waltz`` command line, :mod:`waltz_bank.spark_cli`), from
``python -m waltz_bank.spark_jobs bank-report ...``, or with spark-submit (this file is
the application; waltz-spark must be installed where the driver and executors run)::

    JOBS=$(python -c 'import waltz_bank.spark_jobs as j; print(j.__file__)')
    spark-submit --master 'local[*]' "$JOBS" bank-report --coordination URI --out report/
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sqlite3
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from waltz_api.errors import ConfigError

log = logging.getLogger(__name__)

OP_SCHEMA = (
    "op string, account long, source long, target long, amount long, "
    "accounts array<long>, total long, ts long"
)
OPERATIONS = ("deposit", "withdraw", "transfer", "audit")
DAY_MS = 86_400_000
CHART = "daily_volume.svg"


# -- shared transformations ------------------------------------------------------------------


def parse_operations(raw: Any) -> Any:
    """``raw`` (the ``waltz`` schema) -> one row per transaction: ``partition``,
    ``transaction_id``, the operation's fields and ``day`` (a UTC date, or null); ``op``
    is null for a transaction that is not a bank operation."""
    from pyspark.sql import functions as F

    parsed = raw.select(
        "partition",
        "transaction_id",
        F.from_json(F.col("data").cast("string"), OP_SCHEMA).alias("o"),
    ).select("partition", "transaction_id", "o.*")
    known = F.col("op").isin(*OPERATIONS)
    day = F.when(
        F.col("ts").isNotNull(),
        F.date_from_unix_date(F.floor(F.col("ts") / F.lit(DAY_MS)).cast("int")),
    )
    return parsed.withColumn("op", F.when(known, F.col("op"))).withColumn("day", day)


def movements_of(ops: Any) -> Any:
    """One row per balance change: ``account``, ``day``, ``change`` and the four
    per-kind amount columns (deposits, withdrawals and both sides of transfers)."""
    from pyspark.sql import functions as F

    zero = F.lit(0).cast("long")
    amount = F.col("amount")

    def side(kind: str, account: str, change: Any, column: str) -> Any:
        picked = {c: zero for c in ("deposited", "withdrawn", "transferred_in", "transferred_out")}
        picked[column] = amount
        return ops.where(F.col("op") == kind).select(
            F.col(account).alias("account"),
            "day",
            change.alias("change"),
            *(value.alias(name) for name, value in picked.items()),
        )

    return (
        side("deposit", "account", amount, "deposited")
        .unionByName(side("withdraw", "account", -amount, "withdrawn"))
        .unionByName(side("transfer", "source", -amount, "transferred_out"))
        .unionByName(side("transfer", "target", amount, "transferred_in"))
    )


def balances_of(ops: Any) -> Any:
    from pyspark.sql import functions as F

    return (
        movements_of(ops)
        .groupBy("account")
        .agg(
            F.sum("change").alias("balance"),
            F.sum("deposited").alias("deposited"),
            F.sum("withdrawn").alias("withdrawn"),
            F.sum("transferred_in").alias("transferred_in"),
            F.sum("transferred_out").alias("transferred_out"),
            F.count("*").alias("operations"),
        )
    )


def summary_of(ops: Any) -> Any:
    from pyspark.sql import functions as F

    zero = F.lit(0).cast("long")
    return (
        ops.where(F.col("op").isNotNull())
        .groupBy("op")
        .agg(F.count("*").alias("count"), F.coalesce(F.sum("amount"), zero).alias("amount"))
    )


def daily_of(ops: Any) -> Any:
    """The daily summary (see the module docstring); ``day`` null = operations without
    a timestamp."""
    from pyspark.sql import functions as F

    zero = F.lit(0).cast("long")
    bank = ops.where(F.col("op").isNotNull())

    def count(kind: str) -> Any:
        return F.sum(F.when(F.col("op") == kind, 1).otherwise(0)).cast("long")

    def total(kind: str) -> Any:
        return F.coalesce(F.sum(F.when(F.col("op") == kind, F.col("amount"))), zero)

    per_day = bank.groupBy("day").agg(
        F.count("*").alias("operations"),
        count("deposit").alias("deposits"),
        count("withdraw").alias("withdrawals"),
        count("transfer").alias("transfers"),
        count("audit").alias("audits"),
        total("deposit").alias("deposited"),
        total("withdraw").alias("withdrawn"),
        total("transfer").alias("transferred"),
    )
    touched = (
        movements_of(ops)
        .groupBy(F.col("day").alias("touched_day"))
        .agg(F.countDistinct("account").alias("accounts"))
    )
    joined = per_day.join(touched, per_day["day"].eqNullSafe(touched["touched_day"]), "left")
    return joined.select(
        "day",
        "operations",
        "deposits",
        "withdrawals",
        "transfers",
        "audits",
        "deposited",
        "withdrawn",
        "transferred",
        (F.col("deposited") + F.col("withdrawn") + F.col("transferred")).alias("volume"),
        (F.col("deposited") - F.col("withdrawn")).alias("net_flow"),
        F.coalesce(F.col("accounts"), zero).alias("accounts"),
    )


# -- the chart -------------------------------------------------------------------------------

SERIES = (("deposited", "#2e7d32"), ("withdrawn", "#c62828"), ("transferred", "#1565c0"))


def _nice_step(top: float, ticks: int = 5) -> int:
    raw = max(top / ticks, 1.0)
    magnitude = 10 ** (len(str(int(raw))) - 1)
    for factor in (1, 2, 5, 10):
        if factor * magnitude >= raw:
            return int(factor * magnitude)
    return int(10 * magnitude)  # pragma: no cover (10 * magnitude >= raw always)


def render_daily_chart(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """A self-contained SVG stacked bar chart: per day (rows with a ``day``), the
    deposited, withdrawn and transferred amounts. No plotting dependency."""
    dated = sorted((r for r in rows if r.get("day") is not None), key=lambda r: r["day"])
    width, height = max(480, min(1800, 120 + 48 * len(dated))), 390
    label_every = max(1, -(-len(dated) // 40))  # at most 40 day labels
    left, right, top, bottom = 70, 20, 40, 110
    plot_w, plot_h = width - left - right, height - top - bottom
    highest = max((sum(int(r[name] or 0) for name, _ in SERIES) for r in dated), default=0)
    step = _nice_step(highest or 1)
    y_max = step * max(1, -(-highest // step))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="14">'
        "Daily volume by operation (UTC days)</text>",
    ]
    for tick in range(0, y_max + 1, step):
        y = top + plot_h - plot_h * tick / y_max
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#ddd"/>'
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{tick}</text>'
        )
    slot = plot_w / max(len(dated), 1)
    bar = min(40.0, slot * 0.7)
    for i, row in enumerate(dated):
        x = left + slot * i + (slot - bar) / 2
        y = float(top + plot_h)
        for name, color in SERIES:
            h = plot_h * int(row[name] or 0) / y_max
            y -= h
            parts.append(
                f'<rect class="{name}" x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" '
                f'height="{h:.1f}" fill="{color}"><title>{escape(str(row["day"]))} {name}: '
                f"{int(row[name] or 0)}</title></rect>"
            )
        if i % label_every:
            continue
        label_x, label_y = x + bar / 2, top + plot_h + 14
        parts.append(
            f'<text x="{label_x:.1f}" y="{label_y}" text-anchor="end" '
            f'transform="rotate(-45 {label_x:.1f} {label_y})">{escape(str(row["day"]))}</text>'
        )
    if not dated:
        parts.append(
            f'<text x="{left + plot_w / 2}" y="{top + plot_h / 2}" text-anchor="middle">'
            "no dated operations</text>"
        )
    parts.append(
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" '
        f'stroke="black"/><line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" '
        'stroke="black"/>'
    )
    for i, (name, color) in enumerate(SERIES):
        x = left + 10 + i * 110
        parts.append(
            f'<rect x="{x}" y="{height - 18}" width="10" height="10" fill="{color}"/>'
            f'<text x="{x + 14}" y="{height - 9}">{name}</text>'
        )
    parts.append("</svg>")
    target = Path(path)
    target.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return target


def _local_path(location: str) -> Path | None:
    if "://" not in location:
        return Path(location)
    if location.startswith("file://"):
        return Path(location[len("file://") :])
    return None


# -- the batch report ------------------------------------------------------------------------


def bank_report(
    spark: Any, coordination: str, out: str | Path, chart: str | Path | None = None
) -> dict[str, Any]:
    """Compute the bank's balances, summaries and chart from the log; returns the figures.

    ``out`` is a local folder or any Hadoop path; the chart goes to ``chart`` (a local
    file), by default ``out/daily_volume.svg`` when ``out`` is local (else none)."""
    from pyspark.sql import functions as F

    from waltz_spark.datasource import register

    register(spark)
    raw = spark.read.format("waltz").option("coordination", coordination).load()
    parsed = parse_operations(raw).cache()
    try:
        balances = balances_of(parsed)
        summary = summary_of(parsed)
        daily = daily_of(parsed)
        marks = parsed.groupBy("partition").agg(F.max("transaction_id").alias("high_water_mark"))
        target = str(out).rstrip("/")
        local = _local_path(target)
        if local is not None:
            local.mkdir(parents=True, exist_ok=True)
        # sorted within each file, no global sort (it would cost a sampling job each);
        # the small tables as one file each
        balances.sortWithinPartitions("account").write.mode("overwrite").parquet(
            f"{target}/balances"
        )
        for name, table, key in (
            ("summary", summary, "op"),
            ("daily", daily, "day"),
            ("positions", marks, "partition"),
        ):
            table.coalesce(1).sortWithinPartitions(key).write.mode("overwrite").parquet(
                f"{target}/{name}"
            )
        # the figures from what was written (the daily table is small and has them all
        # but the number of accounts: sum of the net flows = sum of the balances)
        accounts = spark.read.parquet(f"{target}/balances").count()
        days = [r.asDict() for r in spark.read.parquet(f"{target}/daily").collect()]
        if chart is None and local is not None:
            chart = local / CHART
        drawn = None if chart is None else str(render_daily_chart(days, chart))
        kinds = (("deposit", "deposits"), ("withdraw", "withdrawals"),
                 ("transfer", "transfers"), ("audit", "audits"))  # fmt: skip
        operations = {op: sum(int(d[column]) for d in days) for op, column in kinds}
        figures = {
            "accounts": accounts,
            "total_balance": sum(int(d["net_flow"]) for d in days),
            "operations": {op: n for op, n in operations.items() if n},
            "days": sum(1 for d in days if d["day"] is not None),
            "undated_operations": sum(d["operations"] for d in days if d["day"] is None),
            "chart": drawn,
        }
    finally:
        parsed.unpersist()
    log.info("bank report written to %s: %s", target, figures)
    return figures


# -- the streaming job -----------------------------------------------------------------------

_TABLES = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS batches (batch_id INTEGER PRIMARY KEY, "
    "transactions INTEGER NOT NULL, operations INTEGER NOT NULL, applied_at REAL NOT NULL)",
    "CREATE TABLE IF NOT EXISTS balances (account INTEGER PRIMARY KEY, "
    "balance INTEGER NOT NULL, deposited INTEGER NOT NULL, withdrawn INTEGER NOT NULL, "
    "transferred_in INTEGER NOT NULL, transferred_out INTEGER NOT NULL, "
    "operations INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS summary (op TEXT PRIMARY KEY, count INTEGER NOT NULL, "
    "amount INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS positions (partition INTEGER PRIMARY KEY, "
    "high_water_mark INTEGER NOT NULL)",
)
_BALANCE_COLUMNS = (
    "balance",
    "deposited",
    "withdrawn",
    "transferred_in",
    "transferred_out",
    "operations",
)


class BankStreamSink:
    """The ``foreachBatch`` function of the streaming job: adds each micro-batch's
    changes to SQLite tables ``balances``, ``summary`` and ``positions`` (on the driver).

    Exactly once: Spark gives a micro-batch the same id and the same offsets (so the
    same transactions) when it re-runs it after a restart, and the sink applies a
    batch and records its id in ``batches`` in one SQLite transaction, skipping an id
    it already applied. The database belongs to one checkpoint: it remembers the
    checkpoint's location and refuses another one (a new checkpoint numbers its
    batches from 0 again)."""

    def __init__(self, database: str | Path, checkpoint: str) -> None:
        self.database = str(database)
        self.checkpoint = checkpoint
        with self._connect() as db:
            for statement in _TABLES:
                db.execute(statement)
            row = db.execute("SELECT value FROM meta WHERE key = 'checkpoint'").fetchone()
            applied = db.execute("SELECT max(batch_id) FROM batches").fetchone()[0]
            if row is not None and row[0] != checkpoint:
                raise ConfigError(
                    f"database {self.database} holds the state of the stream with checkpoint "
                    f"{row[0]!r}, not {checkpoint!r}: use that checkpoint, or a new database",
                    key="checkpoint",
                )
            local = _local_path(checkpoint)
            if applied is not None and local is not None:
                # Spark logs a micro-batch's offsets before running it: a checkpoint
                # that has not reached the last batch applied is not this stream's
                planned = [int(f.name) for f in (local / "offsets").glob("*") if f.name.isdigit()]
                if not planned or max(planned) < applied:
                    raise ConfigError(
                        f"database {self.database} applied micro-batches up to {applied} but "
                        f"checkpoint {checkpoint} only reached "
                        f"{max(planned) if planned else 'none'}: it was lost or replaced; "
                        "start over with a new database (the stream re-reads the log from "
                        "the start)",
                        key="checkpoint",
                    )
            db.execute(
                "INSERT OR IGNORE INTO meta (key, value) VALUES ('checkpoint', ?)", (checkpoint,)
            )
        db.close()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.database, timeout=60)

    def __call__(self, batch: Any, batch_id: int) -> None:
        from pyspark.sql import functions as F

        # the three aggregations as one Spark job over the micro-batch read once (cached:
        # the read tasks are the expensive part)
        ops = parse_operations(batch).persist()
        try:
            changes = (
                balances_of(ops)
                .withColumn("kind", F.lit("balance"))
                .unionByName(summary_of(ops).withColumn("kind", F.lit("summary")), True)
                .unionByName(
                    ops.groupBy("partition")
                    .agg(F.max("transaction_id").alias("hwm"), F.count("*").alias("n"))
                    .withColumn("kind", F.lit("position")),
                    True,
                )
                .collect()
            )
        finally:
            ops.unpersist()
        balances = [r.asDict() for r in changes if r["kind"] == "balance"]
        summary = [r.asDict() for r in changes if r["kind"] == "summary"]
        marks = [r for r in changes if r["kind"] == "position"]
        size = sum(int(r["n"]) for r in marks)
        operations = sum(int(r["count"]) for r in summary)
        db = self._connect()
        try:
            with db:  # one transaction: the batch's changes and its id
                done = db.execute("SELECT 1 FROM batches WHERE batch_id = ?", (batch_id,))
                if done.fetchone() is not None:
                    log.info("bank stream: micro-batch %d was applied already", batch_id)
                    return
                for row in balances:
                    values = [int(row[c]) for c in _BALANCE_COLUMNS]
                    db.execute(
                        "INSERT INTO balances (account, balance, deposited, withdrawn, "
                        "transferred_in, transferred_out, operations) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(account) DO UPDATE SET "
                        + ", ".join(f"{c} = {c} + excluded.{c}" for c in _BALANCE_COLUMNS),
                        (int(row["account"]), *values),
                    )
                for row in summary:
                    db.execute(
                        "INSERT INTO summary (op, count, amount) VALUES (?, ?, ?) "
                        "ON CONFLICT(op) DO UPDATE SET count = count + excluded.count, "
                        "amount = amount + excluded.amount",
                        (row["op"], int(row["count"]), int(row["amount"])),
                    )
                for row in marks:
                    db.execute(
                        "INSERT INTO positions (partition, high_water_mark) VALUES (?, ?) "
                        "ON CONFLICT(partition) DO UPDATE SET high_water_mark = "
                        "max(high_water_mark, excluded.high_water_mark)",
                        (int(row["partition"]), int(row["hwm"])),
                    )
                db.execute(
                    "INSERT INTO batches (batch_id, transactions, operations, applied_at) "
                    "VALUES (?, ?, ?, ?)",
                    (batch_id, size, operations, time.time()),
                )
        finally:
            db.close()
        log.info(
            "bank stream: micro-batch %d applied (%d transactions, %d operations)",
            batch_id,
            size,
            operations,
        )


def read_stream_state(database: str | Path) -> dict[str, Any]:
    """The streaming job's tables as plain Python values."""
    db = sqlite3.connect(str(database), timeout=60)
    try:
        balances = {
            int(r[0]): dict(zip(_BALANCE_COLUMNS, map(int, r[1:]), strict=True))
            for r in db.execute("SELECT account, " + ", ".join(_BALANCE_COLUMNS) + " FROM balances")
        }
        summary = {r[0]: (int(r[1]), int(r[2])) for r in db.execute("SELECT * FROM summary")}
        positions = {int(r[0]): int(r[1]) for r in db.execute("SELECT * FROM positions")}
        batches = [
            (int(r[0]), int(r[1]))
            for r in db.execute("SELECT batch_id, transactions FROM batches ORDER BY batch_id")
        ]
    finally:
        db.close()
    return {"balances": balances, "summary": summary, "positions": positions, "batches": batches}


def start_bank_stream(
    spark: Any,
    coordination: str,
    database: str | Path,
    checkpoint: str | Path,
    *,
    trigger_seconds: float = 1.0,
    max_transactions_per_trigger: int | None = None,
) -> Any:
    """Start the streaming job; returns the ``StreamingQuery`` (stop it when done)."""
    from waltz_spark.datasource import register

    if trigger_seconds <= 0:
        raise ConfigError("the trigger interval must be > 0 seconds", key="trigger")
    register(spark)
    location = str(checkpoint)
    sink = BankStreamSink(database, location)
    reader = spark.readStream.format("waltz").option("coordination", coordination)
    if max_transactions_per_trigger is not None:
        reader = reader.option("maxTransactionsPerTrigger", str(max_transactions_per_trigger))
    return (
        reader.load()
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", location)
        .trigger(processingTime=f"{int(trigger_seconds * 1000)} milliseconds")
        .queryName("waltz_bank_stream")
        .start()
    )


def run_bank_stream(
    spark: Any,
    coordination: str,
    database: str | Path,
    checkpoint: str | Path,
    *,
    once: bool = False,
    duration: float | None = None,
    trigger_seconds: float = 1.0,
    max_transactions_per_trigger: int | None = None,
) -> dict[str, Any]:
    """Run the streaming job: with ``once``, until everything committed when it started
    (and whatever arrives meanwhile) is applied; else for ``duration`` seconds (None:
    until interrupted). Returns the state of the database."""
    query = start_bank_stream(
        spark,
        coordination,
        database,
        checkpoint,
        trigger_seconds=trigger_seconds,
        max_transactions_per_trigger=max_transactions_per_trigger,
    )
    try:
        if once:
            query.processAllAvailable()
        else:
            query.awaitTermination(duration)
        failure = query.exception()
        if failure is not None:
            raise failure
    finally:
        query.stop()
    return read_stream_state(database)


# -- sessions and the spark-submit entry -----------------------------------------------------


def spark_session(app: str, master: str | None = None) -> tuple[Any, bool]:
    """The active SparkSession, or a new one (``master`` None: spark-submit's or
    ``local[*]``); the flag says whether it was created here (then the caller stops it)."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app).config("spark.sql.session.timeZone", "UTC")
    if master is not None:
        builder = builder.master(master)
        if master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            builder = (
                builder.config("spark.driver.host", "127.0.0.1")
                .config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.ui.enabled", "false")
            )
    return builder.getOrCreate(), True


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m waltz_bank.spark_jobs`` / ``spark-submit .../waltz_bank/spark_jobs.py``."""
    parser = argparse.ArgumentParser(
        prog="waltz_bank.spark_jobs", description="The bank demo's pipeline jobs on Spark."
    )
    parser.add_argument("--master", help="Spark master (default: spark-submit's, or local[*])")
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("bank-report", help="balances, summaries and the daily chart")
    report.add_argument("--coordination", required=True)
    report.add_argument("--out", required=True)
    report.add_argument("--chart", help="the chart's file (default: OUT/daily_volume.svg)")
    stream = commands.add_parser("bank-stream", help="keep balances current in SQLite")
    stream.add_argument("--coordination", required=True)
    stream.add_argument("--database", required=True)
    stream.add_argument("--checkpoint", required=True)
    stream.add_argument("--once", action="store_true", help="apply what is there, then stop")
    stream.add_argument("--duration", type=float, help="seconds to run (default: forever)")
    stream.add_argument("--trigger-seconds", type=float, default=1.0)
    stream.add_argument("--max-transactions-per-trigger", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    for name in ("waltz_spark", __name__):  # __main__ under python -m or spark-submit
        logging.getLogger(name).setLevel(logging.INFO)
    spark, created = spark_session(f"waltz-{args.command}", args.master)
    try:
        if args.command == "bank-report":
            figures = bank_report(spark, args.coordination, args.out, args.chart)
        else:
            state = run_bank_stream(
                spark,
                args.coordination,
                args.database,
                args.checkpoint,
                once=args.once,
                duration=args.duration,
                trigger_seconds=args.trigger_seconds,
                max_transactions_per_trigger=args.max_transactions_per_trigger,
            )
            figures = stream_figures(state)
    finally:
        if created:
            spark.stop()
    sys.stdout.write(json.dumps(figures, sort_keys=True, default=str) + "\n")
    return 0


def stream_figures(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "accounts": len(state["balances"]),
        "total_balance": sum(b["balance"] for b in state["balances"].values()),
        "operations": {op: count for op, (count, _) in state["summary"].items()},
        "positions": state["positions"],
        "micro_batches": len(state["batches"]),
    }


if __name__ == "__main__":
    sys.exit(main())
