"""The bank demo's core, end to end: a real ``waltz dev`` cluster (child processes: local
coordination, 3 fs storage nodes, a server, ZeroMQ), concurrent clients with their own
SQLite views, then the independent check from the log."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from waltz_bank.bank import Replay, Stats, check, run_bank
from waltz_bank.demo import dev_cluster, main

pytestmark = [pytest.mark.system, pytest.mark.timeout(150)]


def test_concurrent_clients_keep_exact_balances_that_never_go_negative(tmp_path: Path) -> None:
    work = tmp_path / "clients"
    work.mkdir()
    with dev_cluster(tmp_path / "cluster", Console(quiet=True)) as info:
        done: list[int] = []
        report = run_bank(
            info["coordination"], str(work), clients=4, operations=25, accounts=4,
            progress=done.append,
        )  # fmt: skip
    assert report.problems == []
    replay, stats = report.replay, report.stats
    assert len(done) == 4 * 25
    assert sum(stats.committed.values()) + stats.declined == 4 * 25
    assert report.high_water_mark + 1 == sum(stats.committed.values())
    assert sum(replay.balances.values()) == replay.deposited - replay.withdrawn
    assert min(replay.lowest.values()) >= 0
    assert stats.committed.get("withdraw", 0) + stats.committed.get("transfer", 0) > 0
    expected = {a: (b, replay.lowest[a]) for a, b in replay.balances.items()}
    assert len(report.views) == 4
    assert all(view == expected for view in report.views)  # every SQLite view is the log


def test_records_that_are_not_the_banks_are_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """README and docs/dev-cluster.md, literally: ``waltz client append`` a ``hello``
    record, then the bank on that cluster: it skips the record (a warning) and runs."""
    work = tmp_path / "clients"
    work.mkdir()
    with dev_cluster(tmp_path / "cluster", Console(quiet=True)) as info:
        appended = subprocess.run(
            [sys.executable, "-m", "waltz_cli", "client", "append",
             "--coordination", info["coordination"], "--partition", "0", "--data", "hello"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert appended.returncode == 0, appended.stderr
        with caplog.at_level(logging.WARNING, logger="waltz_bank.bank"):
            report = run_bank(
                info["coordination"], str(work), clients=2, operations=10, accounts=3, timeout=60
            )
    assert report.problems == []
    assert report.replay.foreign == 1
    assert report.high_water_mark + 1 == 1 + sum(report.stats.committed.values())
    skipped = [r for r in caplog.records if "is not a bank operation" in r.getMessage()]
    assert skipped and all("transaction 0 of partition 0" in r.getMessage() for r in skipped)
    assert "b'hello'" in skipped[0].getMessage()


@pytest.mark.parametrize("partitions", [2, 4])
def test_the_bank_is_right_on_any_partition_count(
    partitions: int, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The bank lives on partition 0: a record on every partition (another application's)
    changes nothing but the one on partition 0 being skipped, with one warning (not one
    per client and the check), and the check reads that partition alone (before: every
    partition, against partition 0's high-water mark: "read 5 transactions, the log has
    2")."""
    work = tmp_path / "clients"
    for run in ("1", "2"):
        (work / run).mkdir(parents=True)
    with dev_cluster(tmp_path / "cluster", Console(quiet=True), partitions=partitions) as info:
        uri = info["coordination"]
        for partition in range(partitions):
            appended = subprocess.run(
                [sys.executable, "-m", "waltz_cli", "client", "append", "--coordination", uri,
                 "--partition", str(partition), "--data", f"hello {partition}"],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert appended.returncode == 0, appended.stderr
        with caplog.at_level(logging.WARNING, logger="waltz_bank.bank"):
            first = run_bank(uri, str(work / "1"), clients=3, operations=10, accounts=3)
            second = run_bank(uri, str(work / "2"), clients=3, operations=10, accounts=3)
    for report in (first, second):
        assert report.problems == []
        assert report.replay.foreign == 1
    assert first.high_water_mark + 1 == 1 + sum(first.stats.committed.values())
    assert second.high_water_mark == first.high_water_mark + sum(second.stats.committed.values())
    skipped = [r.getMessage() for r in caplog.records if "not a bank operation" in r.getMessage()]
    # one warning per run (each run's clients and check meet the record)
    assert len(skipped) == 2, skipped
    assert all("transaction 0 of partition 0" in m and "b'hello 0'" in m for m in skipped)


def test_the_check_catches_an_overdraft_lost_money_and_a_diverging_view() -> None:
    replay = Replay()
    replay.apply(None)  # a record that is not a bank operation: counted, skipped
    for op in [
        {"id": "r-1", "op": "deposit", "account": 1, "amount": 50},
        {"id": "r-2", "op": "withdraw", "account": 1, "amount": 80},
        {"id": "r-3", "op": "audit", "accounts": [1], "total": 50},
    ]:
        replay.apply(op)
    stats = Stats(run="r", committed_ids={"r-1", "r-2", "r-3"})
    problems = check(replay, 3, stats, [{1: (-30, -30)}, {1: (0, 0)}])
    assert any("went negative" in p for p in problems)
    assert any("audit r-3" in p for p in problems)
    assert any("client 1's database differs" in p for p in problems)
    replay.balances[1] += 5  # money appearing from nowhere
    assert any("not conserved" in p for p in check(replay, 3, stats, []))
    assert any("log has 5" in p for p in check(replay, 4, stats, []))
    assert replay.foreign == 1


def test_the_demo_command_runs_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--clients", "2", "--operations", "10", "--accounts", "3"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "total" in out
    assert "at the first attempt" in out  # the latency of first attempts, apart


def test_an_operation_carries_its_build_time_in_utc_milliseconds(tmp_path: Path) -> None:
    import json
    import time

    from waltz_bank.bank import Accounts, Operation
    from waltz_client.api import TransactionBuilder

    accounts = Accounts(str(tmp_path / "view.db"))
    try:
        before = time.time_ns() // 1_000_000
        builder = TransactionBuilder(0, -1)
        op = {"id": "t-1", "op": "deposit", "account": 3, "amount": 5}
        assert Operation(accounts, op).execute(builder)
        stamped = json.loads(builder.data)
        assert before <= stamped["ts"] <= time.time_ns() // 1_000_000
        assert "ts" not in op  # the context's operation is not changed
        given = TransactionBuilder(0, -1)  # a simulated time is kept
        assert Operation(accounts, {**op, "ts": 86_400_000}).execute(given)
        assert json.loads(given.data)["ts"] == 86_400_000
    finally:
        accounts.close()
