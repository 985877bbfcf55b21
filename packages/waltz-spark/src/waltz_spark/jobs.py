"""Pipeline jobs on the Waltz log, for the bank demo (examples/bank).

The bank's log holds one JSON operation per transaction (``waltz_bank.bank``):
``deposit {account, amount}``, ``withdraw {account, amount}``, ``transfer {source,
target, amount}`` and ``audit {accounts, total}``. :func:`bank_report` reads the
whole log with the ``waltz`` data source and writes, as Parquet:

- ``balances/``: one row per account (``account``, ``balance``, ``deposited``,
  ``withdrawn``, ``transferred_in``, ``transferred_out``, ``operations``);
- ``summary/``: one row per operation kind (``op``, ``count``, ``amount``);
- ``positions/``: the log position covered (``high_water_mark`` per partition).

Transactions that are not bank operations are skipped.

The operations carry no timestamp, so the summary is per operation kind over the log
(not per day). Run with ``waltz spark bank-report --coordination URI --out DIR``,
or call :func:`bank_report` from a ``spark-submit`` script on any cluster.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

OP_SCHEMA = (
    "op string, account long, source long, target long, amount long, "
    "accounts array<long>, total long"
)


def bank_report(spark: Any, coordination: str, out: str | Path) -> dict[str, Any]:
    """Compute the bank's balances and summary from the log; returns the figures."""
    from pyspark.sql import functions as F

    from waltz_spark.datasource import register

    register(spark)
    raw = spark.read.format("waltz").option("coordination", coordination).load()
    ops = raw.select(
        "partition",
        "transaction_id",
        F.from_json(F.col("data").cast("string"), OP_SCHEMA).alias("op"),
    ).select("partition", "transaction_id", "op.*")
    ops = ops.where("op IN ('deposit', 'withdraw', 'transfer', 'audit')")  # bank operations
    ops = ops.cache()
    zero = F.lit(0).cast("long")
    movements = (
        (
            ops.where("op = 'deposit'").select(
                F.col("account"),
                F.col("amount").alias("change"),
                F.col("amount").alias("deposited"),
                zero.alias("withdrawn"),
                zero.alias("transferred_in"),
                zero.alias("transferred_out"),
            )
        )
        .unionByName(
            ops.where("op = 'withdraw'").select(
                F.col("account"),
                (-F.col("amount")).alias("change"),
                zero.alias("deposited"),
                F.col("amount").alias("withdrawn"),
                zero.alias("transferred_in"),
                zero.alias("transferred_out"),
            )
        )
        .unionByName(
            ops.where("op = 'transfer'").select(
                F.col("source").alias("account"),
                (-F.col("amount")).alias("change"),
                zero.alias("deposited"),
                zero.alias("withdrawn"),
                zero.alias("transferred_in"),
                F.col("amount").alias("transferred_out"),
            )
        )
        .unionByName(
            ops.where("op = 'transfer'").select(
                F.col("target").alias("account"),
                F.col("amount").alias("change"),
                zero.alias("deposited"),
                zero.alias("withdrawn"),
                F.col("amount").alias("transferred_in"),
                zero.alias("transferred_out"),
            )
        )
    )
    balances = movements.groupBy("account").agg(
        F.sum("change").alias("balance"),
        F.sum("deposited").alias("deposited"),
        F.sum("withdrawn").alias("withdrawn"),
        F.sum("transferred_in").alias("transferred_in"),
        F.sum("transferred_out").alias("transferred_out"),
        F.count("*").alias("operations"),
    )
    summary = ops.groupBy("op").agg(
        F.count("*").alias("count"), F.coalesce(F.sum("amount"), zero).alias("amount")
    )
    marks = ops.groupBy("partition").agg(F.max("transaction_id").alias("high_water_mark"))
    target = Path(out)
    balances.orderBy("account").write.mode("overwrite").parquet(str(target / "balances"))
    summary.orderBy("op").write.mode("overwrite").parquet(str(target / "summary"))
    marks.write.mode("overwrite").parquet(str(target / "positions"))
    figures = {
        "accounts": balances.count(),
        "total_balance": balances.agg(F.sum("balance")).collect()[0][0] or 0,
        "operations": {row["op"]: row["count"] for row in summary.collect()},
    }
    ops.unpersist()
    log.info("bank report written to %s: %s", target, figures)
    return figures
