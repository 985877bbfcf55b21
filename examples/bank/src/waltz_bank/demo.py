"""``python -m waltz_bank``: the bank demo, end to end, with a progress bar and a table.

Without ``--coordination`` it starts a ``waltz dev`` cluster (a child process) in
a temporary directory, runs the bank against it and stops it again.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from waltz_api.errors import WaltzError
from waltz_api.supervised import SupervisedProcess
from waltz_bank.bank import Report, Stats, run_bank
from waltz_cli.devfile import read_ready_file


@contextlib.contextmanager
def dev_cluster(
    data_dir: Path, console: Console, timeout: float = 120.0, partitions: int | None = None
) -> Iterator[dict[str, Any]]:
    """A ``waltz dev`` child process on ``data_dir`` (with ``partitions``, when given);
    yields its ready info, stops it by pid."""
    data_dir.mkdir(parents=True, exist_ok=True)
    more = [] if partitions is None else ["--partitions", str(partitions)]
    dev = SupervisedProcess(
        [sys.executable, "-m", "waltz_cli", "dev", "--data-dir", str(data_dir), *more],
        data_dir / "waltz-dev.out",
        name="waltz dev",
        new_session=True,  # a Ctrl-C reaches the demo, which stops it in order
    )
    dev.start()
    ready: dict[str, Any] = {}

    def started() -> bool:
        info = read_ready_file(data_dir)
        if info is not None and info.get("pid") == dev.pid:
            ready.update(info)
            return True
        return False

    try:
        with console.status("starting a waltz dev cluster (3 storage nodes, 1 server) ..."):
            dev.wait_ready_sync(started, timeout=timeout, interval=0.1)
        yield ready
    finally:
        dev.terminate(timeout=60, signum=signal.SIGINT)


def render(report: Report, console: Console) -> None:
    replay, stats = report.replay, report.stats
    table = Table(title="Accounts (recomputed from the log; every client's SQLite view agrees)")
    table.add_column("account", justify="right")
    table.add_column("balance", justify="right")
    table.add_column("lowest ever", justify="right")
    for account in sorted(replay.balances):
        table.add_row(str(account), str(replay.balances[account]), str(replay.lowest[account]))
    table.add_section()
    table.add_row("total", str(sum(replay.balances.values())), "")
    console.print(table)

    latencies = sorted(stats.latencies) or [0.0]
    committed = sum(stats.committed.values())
    summary = Table(show_header=False, title="Run")
    summary.add_column(justify="left")
    summary.add_column(justify="right")
    rows = [
        ("transactions in the log", str(report.high_water_mark + 1)),
        *((("  not bank operations (skipped)", str(replay.foreign)),) if replay.foreign else ()),
        ("committed this run", str(committed)),
        *((f"  {kind}", str(n)) for kind, n in sorted(stats.committed.items())),
        ("declined (insufficient funds)", str(stats.declined)),
        ("lock failures, re-executed on fresh data", str(stats.lock_failures)),
        ("deposited - withdrawn", f"{replay.deposited} - {replay.withdrawn}"),
        ("moved by transfers", str(replay.transferred)),
        ("elapsed", f"{report.elapsed:.1f} s ({committed / max(report.elapsed, 1e-9):.0f} tx/s)"),
        ("latency p50 / p99", f"{_pct(latencies, 0.5):.0f} / {_pct(latencies, 0.99):.0f} ms"),
        *_latency_rows(stats),
    ]
    for name, value in rows:
        summary.add_row(name, value)
    console.print(summary)
    if stats.retried and _pct(sorted(stats.retried), 0.5) > 2 * _pct(latencies, 0.5):
        failures, kind = stats.most_retried
        console.print(
            f"The p99 is the operations re-executed after lock failures ({len(stats.retried)} "
            f"of {len(latencies)}; one {kind} {failures} times): each retry waits until this "
            "client's view has applied the transaction that changed its accounts, and an "
            "audit's READ locks fail whenever one of its accounts changed, which the other "
            "clients keep doing. Optimistic locking at work, not a slow log: compare the "
            "first attempts' latency."
        )
    if report.ok:
        console.print(
            "[bold green]OK[/]: balances are exact (sum = deposits - withdrawals, transfers "
            "conserve money), none ever went negative, every audit held, each committed "
            "operation is in the log once, and every client's database equals the log."
        )
    else:
        for problem in report.problems:
            console.print(f"[bold red]FAILED[/]: {problem}")


def _latency_rows(stats: Stats) -> list[tuple[str, str]]:
    """p50 / p99 of the operations decided at their first attempt, and of those
    re-executed after lock failures: the second is the tail."""
    rows = []
    for name, values in (
        ("at the first attempt", stats.first_attempt),
        ("after lock failures", stats.retried),
    ):
        if values:
            ordered = sorted(values)
            shown = f"{_pct(ordered, 0.5):.0f} / {_pct(ordered, 0.99):.0f} ms"
            rows.append((f"  {name} ({len(values)})", shown))
    return rows


def _pct(values: list[float], q: float) -> float:
    return 1000 * values[min(len(values) - 1, int(q * len(values)))]


def run(args: argparse.Namespace, console: Console) -> Report:
    with contextlib.ExitStack() as stack:
        uri = args.coordination
        if uri is None:
            base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="waltz-bank-")))
            info = stack.enter_context(dev_cluster(base / "cluster", console))
            uri = info["coordination"]
            console.print(f"waltz dev cluster ready: {uri}")
            work = base / "clients"
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="waltz-bank-")))
        work.mkdir(exist_ok=True)
        total = args.clients * args.operations
        console.print(
            f"{args.clients} clients x {args.operations} random operations on "
            f"{args.accounts} accounts (deposit, withdraw, transfer, audit)"
        )
        with Progress(
            TextColumn("[bold]bank"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            task = progress.add_task("operations", total=total)
            report = run_bank(
                uri,
                str(work),
                clients=args.clients,
                operations=args.operations,
                accounts=args.accounts,
                seed=args.seed,
                history_days=args.history_days,
                progress=lambda n: progress.advance(task, n),
            )
        render(report, console)
        return report
    raise AssertionError("unreachable")  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="waltz-bank", description=__doc__)
    parser.add_argument("--coordination", help="a running cluster (default: start waltz dev)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (threads)")
    parser.add_argument("--operations", type=int, default=100, help="operations per client")
    parser.add_argument("--accounts", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--history-days",
        type=int,
        default=0,
        help="stamp the operations over the last N days (a simulated history for the "
        "daily report of `waltz spark bank-report`; default: now)",
    )
    args = parser.parse_args(argv)
    if min(args.clients, args.operations, args.accounts) < 1:
        parser.error("--clients, --operations and --accounts must be at least 1")
    if args.history_days < 0:
        parser.error("--history-days must be 0 or more")
    console = Console()
    try:
        report = run(args, console)
    except WaltzError as exc:
        console.print(f"[bold red]error[/]: {exc}")
        return 1
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
