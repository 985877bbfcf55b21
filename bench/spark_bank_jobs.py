"""Benchmark of the bank pipeline jobs (``waltz_bank.spark_jobs``): the batch report and the
streaming job, on a log of bank operations.

Prints figures; never a pass/fail test. Usage::

    SPARK_LOCAL_IP=127.0.0.1 python bench/spark_bank_jobs.py [--operations 50000]
        [--accounts 1000] [--days 30] [--per-trigger 20000] [--master local[2]]

A real cluster in this process (``waltz_spark.testing.BackgroundCluster``: local
coordination, 3 fs storage nodes, ZeroMQ, the server, 2 partitions); ``--operations``
random bank operations (JSON, with a ``ts`` over ``--days`` days) appended with the real
client. Then, on ``--master``:

- ``bank_report``: balances, summaries, the daily table, positions and the chart;
- the streaming job from the start of the log with ``maxTransactionsPerTrigger``, until
  it caught up (``processAllAvailable``): micro-batches and transactions/s;

each as wall-clock seconds and operations/s, with the machine's load average (other work
on a shared machine slows every figure).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _operations(count: int, accounts: int, days: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    now = time.time_ns() // 1_000_000
    start = now - days * 86_400_000
    ops: list[dict[str, Any]] = []
    for i in range(count):
        ts = start + (now - start) * i // max(count, 1)
        roll = rng.random()
        if roll < 0.4:
            op: dict[str, Any] = {"op": "deposit", "account": rng.randrange(accounts),
                                  "amount": rng.randint(1, 100)}  # fmt: skip
        elif roll < 0.65:
            op = {
                "op": "withdraw",
                "account": rng.randrange(accounts),
                "amount": rng.randint(1, 50),
            }
        elif roll < 0.95:
            source, target = rng.sample(range(accounts), 2)
            op = {"op": "transfer", "source": source, "target": target,
                  "amount": rng.randint(1, 50)}  # fmt: skip
        else:
            op = {"op": "audit", "accounts": sorted(rng.sample(range(accounts), 3)), "total": 0}
        op.update(id=f"b-{i}", ts=ts)
        ops.append(op)
    return ops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--operations", type=int, default=50_000)
    parser.add_argument("--accounts", type=int, default=1_000)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--per-trigger", type=int, default=20_000)
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable

    from waltz_bank.spark_jobs import bank_report, run_bank_stream, spark_session
    from waltz_spark.testing import PARTITIONS, BackgroundCluster, append

    with tempfile.TemporaryDirectory(prefix="waltz-bench-bank-") as tmp:
        root = Path(tmp)
        cluster = BackgroundCluster(root / "cluster")
        cluster.start()
        spark = None
        try:
            ops = _operations(args.operations, args.accounts, args.days, seed=11)
            t0 = time.perf_counter()
            for first in range(0, len(ops), 5_000):
                chunk = ops[first : first + 5_000]
                append(cluster.uri, [(i % PARTITIONS, 0, json.dumps(op).encode())
                                     for i, op in enumerate(chunk, first)])  # fmt: skip
            wrote = time.perf_counter() - t0
            print(f"log: {len(ops):,} bank operations appended in {wrote:.1f} s "
                  f"({len(ops) / wrote:,.0f}/s, real client)")  # fmt: skip
            spark, _ = spark_session("waltz-bench-bank", args.master)
            spark.conf.set("spark.sql.shuffle.partitions", "4")
            spark.sparkContext.setLogLevel("ERROR")

            t0 = time.perf_counter()
            figures = bank_report(spark, cluster.uri, root / "report")
            took = time.perf_counter() - t0
            print(f"bank_report on {args.master}: {took:.1f} s, {len(ops) / took:,.0f} ops/s "
                  f"({figures['accounts']} accounts, {figures['days']} days)")  # fmt: skip

            t0 = time.perf_counter()
            state = run_bank_stream(
                spark,
                cluster.uri,
                root / "bank.db",
                str(root / "checkpoint"),
                once=True,
                trigger_seconds=0.5,
                max_transactions_per_trigger=args.per_trigger,
            )
            took = time.perf_counter() - t0
            batches = state["batches"]
            largest = max(n for _, n in batches)
            print(f"bank stream (maxTransactionsPerTrigger {args.per_trigger:,}): "
                  f"{len(batches)} micro-batches (largest {largest:,}) in {took:.1f} s, "
                  f"{len(ops) / took:,.0f} transactions/s")  # fmt: skip
            same = {a: b["balance"] for a, b in state["balances"].items()}
            total = sum(same.values())
            print(f"stream total balance {total:,} = report {figures['total_balance']:,}: "
                  f"{total == figures['total_balance']}")  # fmt: skip
        finally:
            if spark is not None:
                spark.stop()
            cluster.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS (driver process): {peak:.0f} MiB; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
