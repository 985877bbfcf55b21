"""The bank pipeline jobs (``waltz spark bank-report`` / ``bank-stream``) and the streaming
read limit, with a real local Spark session against a real cluster written by the real
bank (examples/bank)."""

from __future__ import annotations

import datetime as dt
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from waltz_api.errors import ConfigError
from waltz_bank.bank import DAY_MS, run_bank
from waltz_bank.spark_jobs import BankStreamSink, read_stream_state, render_daily_chart
from waltz_cli import main as waltz
from waltz_spark import LogReader
from waltz_spark.datasource import Settings, WaltzStreamReader, admit
from waltz_spark.testing import BackgroundCluster, append

pytestmark = [pytest.mark.timeout(300), pytest.mark.system, pytest.mark.slow]

OLD_OPS = [  # written before operations had a timestamp
    {"id": "old-1", "op": "deposit", "account": 1, "amount": 500},
    {"id": "old-2", "op": "deposit", "account": 2, "amount": 300},
    {"id": "old-3", "op": "transfer", "source": 1, "target": 3, "amount": 50},
]


def parquet(path: Path) -> list[dict[str, Any]]:
    """A Parquet output's rows (read with pyarrow: no Spark job)."""
    rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    return rows


def json_line(output: str) -> dict[str, Any]:
    """The figures a command prints as one JSON line (other lines: logging)."""
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert len(lines) == 1, output
    figures: dict[str, Any] = json.loads(lines[0])
    return figures


def bank_log(uri: str) -> list[tuple[int, int, dict[str, Any] | None]]:
    """(partition, transaction id, the bank operation or None) of the whole log."""
    out: list[tuple[int, int, dict[str, Any] | None]] = []
    with LogReader(uri) as reader:
        marks = reader.high_water_marks(range(reader.num_partitions()))
        for p, top in marks.items():
            for chunk in reader.read(p, 0, top + 1):
                for r in chunk:
                    try:
                        op = json.loads(r.data)
                    except ValueError:
                        op = None
                    ok = isinstance(op, dict) and op.get("op") in (
                        "deposit",
                        "withdraw",
                        "transfer",
                        "audit",
                    )
                    out.append((p, r.transaction_id, op if ok else None))
    return out


def expected_from(log: list[tuple[int, int, dict[str, Any] | None]]) -> dict[str, Any]:
    balances: dict[int, int] = {}
    summary: dict[str, tuple[int, int]] = {}
    daily: dict[dt.date | None, dict[str, Any]] = {}

    def add(account: int, delta: int) -> None:
        balances[account] = balances.get(account, 0) + delta

    for _, _, op in log:
        if op is None:
            continue
        kind, amount = op["op"], int(op.get("amount", 0))
        count, total = summary.get(kind, (0, 0))
        summary[kind] = (count + 1, total + amount)
        ts = op.get("ts")
        day = None if ts is None else dt.date(1970, 1, 1) + dt.timedelta(days=ts // DAY_MS)
        d = daily.setdefault(day, {"operations": 0, "amounts": {}, "accounts": set()})
        d["operations"] += 1
        d["amounts"][kind] = d["amounts"].get(kind, 0) + amount
        if kind == "deposit":
            add(op["account"], amount)
            d["accounts"].add(op["account"])
        elif kind == "withdraw":
            add(op["account"], -amount)
            d["accounts"].add(op["account"])
        elif kind == "transfer":
            add(op["source"], -amount)
            add(op["target"], amount)
            d["accounts"].update((op["source"], op["target"]))
    return {"balances": balances, "summary": summary, "daily": daily}


@pytest.fixture(scope="module")
def bank(cluster: BackgroundCluster, tmp_path_factory: pytest.TempPathFactory) -> BackgroundCluster:
    """The real bank over three simulated days, old operations without ``ts`` and a
    transaction that is not a bank operation."""
    append(cluster.uri, [(0, 0, json.dumps(op).encode()) for op in OLD_OPS])
    work = tmp_path_factory.mktemp("bank")
    report = run_bank(cluster.uri, str(work), clients=2, operations=30, accounts=5,
                      history_days=3)  # fmt: skip
    assert report.problems == []
    append(cluster.uri, [(1, 0, b"not a bank operation")])  # (the bank reads only JSON)
    return cluster


def test_admit_is_bounded_fair_and_progresses() -> None:
    base = {"0": 9, "1": -1, "2": 4}
    marks = {"0": 10, "1": 100, "2": 200}
    end = admit(base, marks, 30)
    taken = {p: end[p] - base[p] for p in base}
    assert taken == {"0": 1, "1": 14, "2": 15} and sum(taken.values()) == 30
    assert admit(base, marks, 1000) == marks  # everything fits
    assert admit(base, {"0": 9, "1": -1, "2": 4}, 5) == base  # nothing new
    one = admit(base, marks, 1)  # a limit below the partition count still moves on
    assert sum(one[p] - base[p] for p in base) == 1


def test_the_stream_reader_never_admits_more_than_the_limit(bank: BackgroundCluster) -> None:
    settings = Settings.of({"coordination": bank.uri})
    with pytest.raises(ConfigError, match="maxTransactionsPerTrigger"):
        WaltzStreamReader(settings, "earliest", 0)
    reader = WaltzStreamReader(settings, "earliest", 7)
    try:
        start = reader.initialOffset()
        seen: list[tuple[int, int]] = []
        for _ in range(200):
            end = reader.latestOffset()
            if end == start:
                break
            splits = reader.partitions(start, end)
            batch = [
                (p, t)
                for s in splits
                for b in reader.read(s)
                for p, t in zip(b.column(0).to_pylist(), b.column(1).to_pylist(), strict=True)
            ]
            assert 1 <= len(batch) <= 7
            seen.extend(batch)
            start = end
    finally:
        reader.stop()
    assert sorted(seen) == sorted((p, t) for p, t, _ in bank_log(bank.uri))


def test_bank_report_command(spark: Any, bank: BackgroundCluster, tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = CliRunner().invoke(
        waltz, ["spark", "bank-report", "--coordination", bank.uri, "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    figures = json_line(result.output)
    log = bank_log(bank.uri)
    expected = expected_from(log)

    balances = {r["account"]: r for r in parquet(out / "balances")}
    assert {a: r["balance"] for a, r in balances.items()} == expected["balances"]
    assert figures["total_balance"] == sum(expected["balances"].values())
    assert figures["accounts"] == len(expected["balances"])
    assert figures["operations"] == {op: n for op, (n, _) in expected["summary"].items()}
    summary = {r["op"]: (r["count"], r["amount"]) for r in parquet(out / "summary")}
    assert summary == expected["summary"]

    daily = {r["day"]: r for r in parquet(out / "daily")}
    assert set(daily) == set(expected["daily"])
    assert None in daily and daily[None]["operations"] == len(OLD_OPS)  # old records
    assert len([d for d in daily if d is not None]) >= 3  # the simulated history
    for day, want in expected["daily"].items():
        row, amounts = daily[day], want["amounts"]
        assert row["operations"] == want["operations"]
        assert row["deposited"] == amounts.get("deposit", 0)
        assert row["withdrawn"] == amounts.get("withdraw", 0)
        assert row["transferred"] == amounts.get("transfer", 0)
        assert row["net_flow"] == row["deposited"] - row["withdrawn"]
        assert row["volume"] == row["deposited"] + row["withdrawn"] + row["transferred"]
        assert row["accounts"] == len(want["accounts"])
        kinds = ("deposits", "withdrawals", "transfers", "audits")
        assert sum(row[k] for k in kinds) == row["operations"]
    assert sum(r["net_flow"] for r in daily.values()) == sum(expected["balances"].values())
    positions = {r["partition"]: r["high_water_mark"] for r in parquet(out / "positions")}
    assert positions == {p: max(t for q, t, _ in log if q == p) for p in (0, 1)}

    chart = out / "daily_volume.svg"
    assert figures["chart"] == str(chart)
    root = ET.parse(chart).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    bars = [e for e in root.iter("{http://www.w3.org/2000/svg}rect") if e.get("class")]
    dated = [r for d, r in daily.items() if d is not None]
    assert len(bars) == 3 * len(dated)
    heights = {e.get("class"): 0.0 for e in bars}
    for e in bars:
        heights[e.get("class")] += float(e.get("height", "0"))
    assert heights["deposited"] > 0  # drawn to scale, not empty
    total = {name: sum(r[name] for r in dated) for name in ("deposited", "transferred")}
    ratio = heights["deposited"] / heights["transferred"]
    assert ratio == pytest.approx(total["deposited"] / total["transferred"], rel=0.05)


def test_the_chart_without_dated_operations(tmp_path: Path) -> None:
    path = render_daily_chart([{"day": None, "deposited": 5, "withdrawn": 0, "transferred": 0}],
                              tmp_path / "c.svg")  # fmt: skip
    root = ET.parse(path).getroot()
    assert "no dated operations" in "".join(root.itertext())
    year = [{"day": dt.date(2026, 1, 1) + dt.timedelta(days=d), "deposited": d, "withdrawn": 1,
             "transferred": 2} for d in range(365)]  # fmt: skip
    big = ET.parse(render_daily_chart(year, tmp_path / "year.svg")).getroot()
    assert int(big.get("width", "0")) <= 1800  # a year stays a readable picture
    svg = "{http://www.w3.org/2000/svg}"
    labels = [t for t in big.iter(f"{svg}text") if "2026-" in (t.text or "")]
    assert 0 < len(labels) <= 40 and labels[0].text == "2026-01-01"
    assert len([e for e in big.iter(f"{svg}rect") if e.get("class")]) == 3 * 365


def test_bank_stream_is_exactly_once_across_a_restart(
    spark: Any, bank: BackgroundCluster, tmp_path: Path
) -> None:
    database, checkpoint = tmp_path / "bank.db", str(tmp_path / "checkpoint")
    command = ["spark", "bank-stream", "--coordination", bank.uri, "--database", str(database),
               "--checkpoint", checkpoint, "--once", "--trigger-seconds", "0.2",
               "--max-transactions-per-trigger", "40"]  # fmt: skip

    def check() -> dict[str, Any]:
        state = read_stream_state(database)
        log = bank_log(bank.uri)
        expected = expected_from(log)
        assert {a: b["balance"] for a, b in state["balances"].items()} == expected["balances"]
        assert state["summary"] == expected["summary"]
        assert state["positions"] == {p: max(t for q, t, _ in log if q == p) for p in (0, 1)}
        # every transaction in exactly one micro-batch, none above the limit
        assert sum(n for _, n in state["batches"]) == len(log)
        assert all(1 <= n <= 40 for _, n in state["batches"])
        return state

    first = CliRunner().invoke(waltz, command)
    assert first.exit_code == 0, first.output
    before = check()
    assert len(before["batches"]) >= 2  # the limit split the backlog
    more: list[dict[str, Any]] = [
        {"id": f"late-{i}", "op": "deposit", "account": 7, "amount": 10 + i, "ts": 0}
        for i in range(25)
    ]
    append(bank.uri, [(i % 2, 0, json.dumps(op).encode()) for i, op in enumerate(more)])
    second = CliRunner().invoke(waltz, command)  # restarted from the checkpoint
    assert second.exit_code == 0, second.output
    after = check()
    assert after["balances"][7]["balance"] == sum(op["amount"] for op in more)
    ids = [b for b, _ in after["batches"]]
    assert ids == list(range(len(ids))) and len(ids) > len(before["batches"])
    assert json_line(second.output)["micro_batches"] == len(ids)

    # a micro-batch Spark re-runs after a crash is not applied twice
    sink = BankStreamSink(database, checkpoint)
    last = spark.read.format("waltz").option("coordination", bank.uri).load().limit(5)
    sink(last, ids[-1])
    assert read_stream_state(database) == after
    # the database belongs to its checkpoint
    with pytest.raises(ConfigError, match="checkpoint"):
        BankStreamSink(database, str(tmp_path / "another"))
    other = tmp_path / "other.db"
    BankStreamSink(other, str(tmp_path / "lost")).__call__(last, 0)
    with pytest.raises(ConfigError, match="lost or replaced"):
        BankStreamSink(other, str(tmp_path / "lost"))


def test_row_key_locks_make_a_retried_write_append_nothing(
    spark: Any, bank: BackgroundCluster
) -> None:
    """The idempotent write of docs/spark.md: a WRITE lock per row key, checked against
    the mark read before the job; the same rows written again (a retried task) are
    rejected instead of appended."""
    from pyspark.sql import functions as F

    with LogReader(bank.uri) as log:
        mark = log.high_water_mark(0)
    lock = F.struct(
        F.lit("row").alias("name"), F.xxhash64("key").alias("id"), F.lit("write").alias("mode")
    )
    rows = spark.createDataFrame(
        [(f"k{i}", f"payload-{i}") for i in range(12)], "key string, payload string"
    )
    keyed = rows.select(
        F.lit(0).alias("partition"),
        F.lit(4242).alias("header"),
        F.col("payload").alias("data"),
        F.array(lock).alias("locks"),
        F.lit(mark).alias("client_high_water_mark"),
    ).coalesce(2)

    def write() -> None:
        keyed.write.format("waltz").option("coordination", bank.uri).option(
            "onLockFailure", "ignore"
        ).mode("append").save()

    write()
    write()  # the retry: every row's key lock changed after the mark
    with LogReader(bank.uri) as log:
        top = log.high_water_mark(0)
        written = [r.data for chunk in log.read(0, mark + 1, top + 1) for r in chunk
                   if r.header == 4242]  # fmt: skip
    assert sorted(written) == sorted(f"payload-{i}".encode() for i in range(12))


def test_the_spark_submit_entry(
    spark: Any, bank: BackgroundCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``waltz_spark/jobs.py`` as spark-submit runs it (here in process, on the active
    session): the stream from a new checkpoint, once, prints its figures."""
    from waltz_bank.spark_jobs import main

    argv = ["bank-stream", "--coordination", bank.uri, "--database", str(tmp_path / "s.db"),
            "--checkpoint", str(tmp_path / "ckpt"), "--once"]  # fmt: skip
    assert main(argv) == 0
    figures = json_line(capsys.readouterr().out)
    expected = expected_from(bank_log(bank.uri))
    assert figures["total_balance"] == sum(expected["balances"].values())
    assert figures["operations"] == {op: n for op, (n, _) in expected["summary"].items()}
    with pytest.raises(SystemExit):
        main(["bank-report", "--coordination", bank.uri])  # --out is required
