"""``waltz perf producers|consumers``: load a running cluster and measure it.

The commands are here; the work (real ``waltz_client`` clients) is in
:mod:`waltz_client.cli.perf.engine`, imported when a perf command runs so that other
``waltz`` commands do not pay for the client library.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import click

from waltz_api.errors import ConfigError, WaltzError
from waltz_cli.coordination import start_coordination
from waltz_cli.deadline import timeout_option
from waltz_cli.transport import parse_transport_options, transport_options
from waltz_client.cli.client import _coordination_option, _quiet_client_library

if TYPE_CHECKING:
    from types import ModuleType

    from waltz_client.cli.perf.engine import Meter

LOCK_NAME = "perf"
"""The lock name of ``--lock-pool`` WRITE locks (ids 0..K-1); the engine uses the same."""


def _engine() -> ModuleType:
    try:
        from waltz_client.cli.perf import engine
    except ImportError as exc:  # pragma: no cover - the workspace installs waltz-client
        raise WaltzError(f"`waltz perf` needs the waltz-client package ({exc})") from exc
    return engine


# -- the command line ---------------------------------------------------------------------------


def parse_partitions(value: str) -> list[int] | None:
    """``all`` (None), or ids and ranges: ``0,2,5-7``."""
    text = value.strip().lower()
    if text in {"", "all"}:
        return None
    ids: set[int] = set()
    try:
        for part in text.split(","):
            low, sep, high = part.strip().partition("-")
            first, last = int(low), int(high) if sep else int(low)
            if first < 0 or last < first:
                raise ValueError(part)
            ids.update(range(first, last + 1))
    except ValueError:
        raise ConfigError(
            f"--partitions takes `all` or ids and ranges like 0,2,5-7; got {value!r}",
            key="partitions",
        ) from None
    return sorted(ids)


def _common_options(f: Callable[..., Any]) -> Callable[..., Any]:
    options: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
        _coordination_option,
        transport_options,
        click.option(
            "--partitions",
            "partitions",
            default="all",
            show_default=True,
            help="Partitions to use: `all`, or ids and ranges like 0,2,5-7. Transaction i "
            "goes to the (i mod k)-th of the k partitions.",
        ),
        timeout_option(
            "Seconds to reach the cluster, and the longest the run may go without "
            "progress before it fails (exit code 4)."
        ),
        click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON."),
        click.option(
            "--no-progress",
            is_flag=True,
            help="No progress bar (there is none anyway when stderr is not a terminal).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _produce_options(prefix: str = "") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        options = [
            click.option(
                "--size",
                type=click.IntRange(min=0, max=64 * 1024 * 1024),
                default=512,
                show_default=True,
                help=f"{prefix}Bytes of data per transaction.",
            ),
            click.option(
                "--in-flight",
                type=click.IntRange(min=1, max=10_000),
                default=32,
                show_default=True,
                help=f"{prefix}Concurrent submissions per producer.",
            ),
            click.option(
                "--lock-pool",
                type=click.IntRange(min=0),
                default=0,
                show_default=True,
                help=f"{prefix}Each transaction takes a WRITE lock on ({LOCK_NAME!r}, a random "
                "id out of K); concurrent transactions on one id fail their lock check and "
                "retry. 0: no locks.",
            ),
            click.option(
                "--rate",
                type=click.FloatRange(min=0),
                default=0.0,
                show_default=True,
                help=f"{prefix}Target transactions/s, all producers together (0: as fast as "
                "possible).",
            ),
            click.option(
                "--seed", type=int, default=None, help=f"{prefix}Seed of the lock ids and the data."
            ),
        ]
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


@click.group("perf")
def perf_group() -> None:
    """Load a running cluster and measure it (progress bar on stderr, summary on stdout)."""


INTERRUPT_GRACE = 15.0
"""After Ctrl-C, how long the run may take to stop cleanly (cancel the submissions,
close the clients) before the process exits anyway."""


def _run_with_meter(
    work: Callable[[Meter], Awaitable[dict[str, Any]]],
    progress: bool,
    tallies: list[Any],
    what: str,
    uri: str | None = None,
) -> Any:
    """Run ``work``; on Ctrl-C say how far it got (``tallies``) and exit 130.

    Ctrl-C cancels the run (again every second: a cancellation can be lost), and if it
    has not stopped within ``INTERRUPT_GRACE`` seconds (a machine so loaded that closing
    the clients takes that long) the process says how far it got and exits anyway."""
    engine = _engine()
    interrupted = threading.Event()

    def report() -> str:
        done = sum(t.done for t in tallies)
        starts = [t.started for t in tallies if t.started is not None]
        elapsed = time.monotonic() - min(starts) if starts else 0.0
        rate = f", {done / elapsed:,.0f} tx/s" if elapsed > 0 else ""
        return f"interrupted: {done:,} transactions {what} in {elapsed:.2f} s{rate}"

    def give_up() -> None:
        sys.stderr.write(report() + "\n")
        sys.stderr.flush()
        os._exit(130)

    async def main() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None

        def cancel_again() -> None:
            if not me.done():
                me.cancel()
                loop.call_later(1.0, cancel_again)

        def on_sigint() -> None:
            if interrupted.is_set():
                return
            interrupted.set()
            watchdog = threading.Timer(INTERRUPT_GRACE, give_up)
            watchdog.daemon = True
            watchdog.start()
            cancel_again()

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            if uri is not None:
                # the coordination service answers (a refusal, a missing local location
                # or silence end the run here, within --timeout), before any client starts
                await (await start_coordination(uri)).close()
            with engine.Meter(progress) as meter:
                return await work(meter)
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    try:
        with _quiet_client_library():
            return asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        if not interrupted.is_set() and not isinstance(sys.exc_info()[1], KeyboardInterrupt):
            raise
        click.echo(report(), err=True)
        raise SystemExit(130) from None


def _finish(summary: dict[str, Any], as_json: bool, render: Callable[[], None]) -> None:
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        render()
    produced = summary.get("produced") or summary
    if produced.get("errors"):
        raise WaltzError(
            f"{produced['errors']} of {produced['requested']} transactions failed "
            f"(first: {produced['first_error']})"
        )


def _ms(latency: dict[str, float] | None, key: str) -> str:
    return "-" if latency is None else f"{latency[key]:,.1f} ms"


def _rows_producers(summary: dict[str, Any]) -> Iterator[tuple[str, str]]:
    latency = summary["latency"]
    yield "transactions committed", f"{summary['transactions']:,} of {summary['requested']:,}"
    yield "elapsed", f"{summary['elapsed_s']:,.2f} s"
    yield "throughput", f"{summary['tx_per_s']:,.0f} tx/s"
    yield "data", f"{summary['mb_per_s']:,.3f} MB/s ({summary['size']} B each)"
    yield "commit latency p50", _ms(latency, "p50_ms")
    yield "commit latency p99", _ms(latency, "p99_ms")
    yield "commit latency max", _ms(latency, "max_ms")
    yield "retries per transaction", f"{summary['retries_per_tx']:.3f}"
    yield "lock failures", f"{summary['lock_failures']:,}"
    yield "errors", f"{summary['errors']:,}"
    hwms = summary["high_water_marks"]
    yield (
        "high-water marks",
        ", ".join(f"p{p}: {hwms['before'][p]} -> {hwms['after'][p]}" for p in hwms["after"]),
    )
    yield (
        "setup",
        f"{summary['producers']} producers x {summary['in_flight']} in flight, "
        f"lock pool {summary['lock_pool'] or 'none'}, rate {summary['rate'] or 'max'}",
    )


def _rows_consumers(summary: dict[str, Any]) -> Iterator[tuple[str, str]]:
    latency = summary["delivery_latency"]
    yield (
        "transactions delivered",
        f"{summary['transactions']:,} ({summary['consumers']} consumers x "
        f"{summary['requested']:,})",
    )
    yield "elapsed", f"{summary['elapsed_s']:,.2f} s"
    yield "throughput", f"{summary['tx_per_s']:,.0f} tx/s (all consumers)"
    data = f"{summary['mb_per_s']:,.3f} MB/s" if summary["data_fetched"] else "not fetched"
    yield "data", data
    if latency is None:
        yield "delivery latency", "not measured (needs --produce, data fetched, --size >= 12)"
    else:
        yield "delivery latency p50", _ms(latency, "p50_ms")
        yield "delivery latency p99", _ms(latency, "p99_ms")
        yield "delivery latency max", _ms(latency, "max_ms")
    produced = summary["produced"]
    if produced is not None:
        yield (
            "produced",
            f"{produced['transactions']:,} at {produced['tx_per_s']:,.0f} tx/s, commit "
            f"latency p99 {_ms(produced['latency'], 'p99_ms')}, {produced['errors']} errors",
        )
    if summary["feed_errors"]:
        yield "feed errors (retried)", summary["feed_errors"][0]
    positions = summary["positions"]
    yield (
        "read",
        ", ".join(
            f"p{p}: {int(positions['after'][p]) + 1}..{positions['until'][p]}"
            for p in positions["until"]
        ),
    )


def _render(title: str, rows: Iterator[tuple[str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


@perf_group.command("producers")
@_common_options
@click.option(
    "--transactions",
    "-n",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="Transactions to commit, all producers together.",
)
@click.option(
    "--producers",
    type=click.IntRange(min=1, max=1000),
    default=4,
    show_default=True,
    help="Concurrent producers (each a client with its own connections).",
)
@_produce_options()
def producers_command(  # noqa: PLR0917 - click passes options by name
    uri: str,
    transport: str,
    transport_options: tuple[str, ...],
    partitions: str,
    timeout: float,
    as_json: bool,
    no_progress: bool,
    transactions: int,
    producers: int,
    size: int,
    in_flight: int,
    lock_pool: int,
    rate: float,
    seed: int | None,
) -> None:
    """P producers submit N transactions in total and measure them.

    \b
    Reported (a table, or --json):
    - transactions/s committed, and MB/s of transaction data (1 MB = 10^6 bytes);
    - commit latency p50/p99/max: from the call of submit() until it resolves
      (committed, and delivered by the producer's own feed);
    - retries per transaction (re-executions after a lock failure or a lost
      connection), lock failures, errors; the high-water marks before and after.

    Each producer is a waltz_client client with its own connections; all run on one
    event loop in this process (run several `waltz perf` for more load). The clock
    starts once every producer is connected. A transaction's data is b"WPF1", its
    first build's wall-clock time in ns and random bytes (header 0x57504631), which
    `waltz perf consumers` recognizes."""
    perf = _engine()
    target = perf.Target(
        uri,
        transport,
        parse_partitions(partitions),
        timeout,
        parse_transport_options(transport_options),
    )
    spec = perf.ProduceSpec(transactions, size, producers, in_flight, lock_pool, rate, seed)
    tally = perf.Tally()

    async def work(meter: Meter) -> dict[str, Any]:
        meter.add("produced", transactions)

        async def ticking() -> None:
            while True:
                meter.update("produced", tally, f"{tally.lock_failures:,} lock failures")
                await asyncio.sleep(0.2)

        ticker = asyncio.get_running_loop().create_task(ticking())
        try:
            raw: dict[str, Any] = await perf.produce(target, spec, tally)
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
        meter.update("produced", tally, f"{tally.lock_failures:,} lock failures")
        return raw

    raw = _run_with_meter(work, not no_progress, [tally], "committed", uri)
    summary = perf.producer_summary(spec, tally, raw)
    _finish(summary, as_json, lambda: _render("waltz perf producers", _rows_producers(summary)))


@perf_group.command("consumers")
@_common_options
@click.option(
    "--transactions",
    "-n",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="Transactions each consumer reads: the last N committed, or with --produce "
    "N produced during the run.",
)
@click.option(
    "--consumers",
    type=click.IntRange(min=1, max=1000),
    default=1,
    show_default=True,
    help="Concurrent consumers (each a client reading all N).",
)
@click.option("--no-data", is_flag=True, help="Headers only: do not fetch the transactions' data.")
@click.option(
    "--no-prefetch",
    is_flag=True,
    help="Fetch each transaction's data when it is applied, one at a time (default: "
    "the client prefetches the data of feed items arriving together).",
)
@click.option(
    "--produce",
    is_flag=True,
    help="Produce the N transactions during the run (and measure delivery latency).",
)
@click.option(
    "--producers",
    type=click.IntRange(min=1, max=1000),
    default=1,
    show_default=True,
    help="With --produce: concurrent producers.",
)
@_produce_options("With --produce: ")
def consumers_command(  # noqa: PLR0917 - click passes options by name
    uri: str,
    transport: str,
    transport_options: tuple[str, ...],
    partitions: str,
    timeout: float,
    as_json: bool,
    no_progress: bool,
    transactions: int,
    consumers: int,
    no_data: bool,
    no_prefetch: bool,
    produce: bool,
    producers: int,
    size: int,
    in_flight: int,
    lock_pool: int,
    rate: float,
    seed: int | None,
) -> None:
    """C consumers each read N transactions from their feeds and fetch their data.

    \b
    Without --produce: the last N committed (split over the partitions like the
    producers split them). With --produce: the consumers mount at the end of the
    log, then producers write N transactions while they read.
    \b
    Reported (a table, or --json):
    - transactions/s and MB/s of data fetched, all consumers together (each reads
      all N: C x N deliveries);
    - delivery latency p50/p99/max, only with --produce and data fetched: from a
      producer's first build of the transaction to a consumer's apply_transaction
      (after its data arrived), same host and clock. Without --produce it is not
      reported: an old transaction's timestamp tells its age, not its delivery."""
    perf = _engine()
    target = perf.Target(
        uri,
        transport,
        parse_partitions(partitions),
        timeout,
        parse_transport_options(transport_options),
    )
    produce_spec = (
        perf.ProduceSpec(transactions, size, producers, in_flight, lock_pool, rate, seed)
        if produce
        else None
    )
    spec = perf.ConsumeSpec(
        transactions, consumers, not no_data, not no_data and not no_prefetch, produce_spec
    )
    tallies = [perf.Tally() for _ in range(consumers)]
    produced = perf.Tally()

    async def work(meter: Meter) -> dict[str, Any]:
        if produce:
            meter.add("produced", transactions)
        meter.add("consumed", transactions * consumers)
        result: dict[str, Any] = await perf.consume(target, spec, tallies, produced, meter)
        return result

    raw = _run_with_meter(work, not no_progress, tallies, "delivered", uri)
    summary = perf.consumer_summary(spec, tallies, produced, raw)
    _finish(summary, as_json, lambda: _render("waltz perf consumers", _rows_consumers(summary)))
