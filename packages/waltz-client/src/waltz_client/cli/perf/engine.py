"""``waltz perf``: load a running cluster and measure it (the original's ProducerPerf and
ConsumerPerf), with a live progress bar and a summary::

    waltz perf producers --coordination URI --transactions 20000 --size 512 --producers 4
    waltz perf producers ... --lock-pool 10 --rate 2000 --json
    waltz perf consumers --coordination URI --transactions 20000 --consumers 2
    waltz perf consumers ... --produce            # produce N while consuming: delivery latency

Every producer and consumer is a real ``waltz_client.AsyncWaltzClient`` (its own client
id and connections); they all run on one event loop in this process, so one Python
process' CPU bounds the load it can offer: run several ``waltz perf`` at once for more.

What is measured:

- producers: *commit latency* per transaction, from the call of ``submit`` until it
  resolves (the transaction is committed and this producer's feed has delivered it),
  retries per transaction (re-executions: after a lock failure, a lost connection...),
  lock failures, errors; throughput in committed transactions/s and payload MB/s
  (1 MB = 10^6 bytes of transaction data).
- consumers: transactions/s and MB/s of data fetched, summed over the consumers (each
  consumer reads all N). *Delivery latency* (producer's first ``execute`` to a consumer's
  ``apply_transaction``, wall clock) is measured only for transactions written by
  ``waltz perf`` whose data the consumer fetched: with ``--produce`` and without
  ``--no-data``; otherwise it is reported as absent, not guessed.

A producer builds each transaction on first execution as ``WPF1`` + the wall-clock time
in ns (8 bytes, big-endian) + random padding up to ``--size`` bytes (shorter than 12
bytes: random bytes only), with header 0x57504631, so consumers recognize them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from waltz_api.errors import PermissionDeniedError, ServerError, UnavailableError, WaltzError
from waltz_client import (
    AsyncWaltzClient,
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClientCallbacks,
)

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

log = logging.getLogger(__name__)

PERF_HEADER = 0x57504631
"""The header of a transaction written by ``waltz perf`` ("WPF1")."""
MAGIC = b"WPF1"
STAMP = struct.Struct(">4sQ")
"""The start of a perf transaction's data: MAGIC and the wall-clock ns of its first build."""
LOCK_NAME = "perf"
"""The lock name of ``--lock-pool`` WRITE locks (ids 0..K-1)."""
MB = 1_000_000


# -- measurements ------------------------------------------------------------------------------


def percentile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q <= 1) of an ascending, non-empty sequence."""
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def latency_summary(seconds: list[float]) -> dict[str, float] | None:
    """p50/p99/max/mean in milliseconds, or None without samples."""
    if not seconds:
        return None
    ordered = sorted(seconds)
    return {
        "p50_ms": round(1000 * percentile(ordered, 0.50), 3),
        "p99_ms": round(1000 * percentile(ordered, 0.99), 3),
        "max_ms": round(1000 * ordered[-1], 3),
        "mean_ms": round(1000 * sum(ordered) / len(ordered), 3),
        "samples": len(ordered),
    }


@dataclass
class Tally:
    """What the producers (or the consumers) did so far; updated on the event loop."""

    done: int = 0
    bytes: int = 0
    errors: int = 0
    retries: int = 0
    lock_failures: int = 0
    latencies: list[float] = field(default_factory=list)
    first_error: str | None = None
    last_activity: float = field(default_factory=time.monotonic)
    started: float | None = None
    """time.monotonic() when the measured run began (None: not yet)."""
    finished: float | None = None
    """loop.time() when a consumer had read all it should."""

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        self.touch()
        if self.first_error is None:
            self.first_error = f"{type(exc).__name__}: {exc}"
        log.debug("perf transaction failed: %s", exc)


class Meter:
    """A live progress bar on stderr (rich), or nothing when disabled or not a TTY."""

    def __init__(self, enabled: bool) -> None:
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._running: set[str] = set()
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        console = Console(stderr=True)
        if not console.is_terminal:
            return
        self._progress = Progress(
            TextColumn("[bold]{task.description:>9}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:>9} tx/s"),
            TextColumn("{task.fields[extra]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )

    def __enter__(self) -> Meter:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def add(self, name: str, total: int) -> None:
        if self._progress is not None:
            self._tasks[name] = self._progress.add_task(name, total=total, rate="", extra="")

    def update(self, name: str, tally: Tally, extra: str = "") -> None:
        if self._progress is None:
            return
        rate = ""
        if tally.started is not None:
            if name not in self._running:  # the clock starts with the measured run
                self._running.add(name)
                self._progress.reset(self._tasks[name])
            rate = f"{tally.done / max(time.monotonic() - tally.started, 1e-9):,.0f}"
        self._progress.update(
            self._tasks[name], completed=tally.done + tally.errors, rate=rate, extra=extra
        )


# -- clients ------------------------------------------------------------------------------------


Apply = Callable[[Transaction, float], Awaitable[None]]
"""What a perf client does with a delivered transaction (and the wall clock it arrived)."""


class PerfCallbacks(WaltzClientCallbacks):
    """High-water marks held back until :func:`open_client` set them (a perf client
    mounts at a position it chose and never replays the whole log), and an optional
    ``on_apply`` per delivered transaction."""

    def __init__(self) -> None:
        self.hwm: dict[int, int] = {}
        self.ready = asyncio.Event()
        self.feed_error: str | None = None
        self.on_apply: Apply | None = None

    async def client_high_water_mark(self, partition_id: int) -> int:
        await self.ready.wait()
        return self.hwm[partition_id]

    async def apply_transaction(self, transaction: Transaction) -> None:
        received = time.time()
        if self.on_apply is not None:
            await self.on_apply(transaction, received)
        self.hwm[transaction.partition_id] = transaction.transaction_id

    def uncaught_exception(
        self, partition_id: int, transaction_id: int, exception: BaseException
    ) -> None:
        self.feed_error = f"partition {partition_id}: {type(exception).__name__}: {exception}"
        log.warning("perf feed: %s (the feed restarts there)", self.feed_error)


@dataclass
class Target:
    """How to reach the cluster and which partitions to use."""

    uri: str
    transport: str
    partitions: list[int] | None
    timeout: float
    transport_options: dict[str, Any] = field(default_factory=dict)


async def open_client(
    target: Target,
    callbacks: PerfCallbacks,
    positions: Callable[[dict[int, int]], dict[int, int]],
    *,
    window: int = 100,
    prefetch: bool = False,
) -> AsyncWaltzClient:
    """Start a client whose feed of each partition starts after ``positions(hwms)[p]``
    (``hwms``: the partitions' current high-water marks); the feed waits until the
    caller sets ``callbacks.ready``."""
    config = ClientConfig(
        target.uri,
        transport=target.transport,
        transport_options=target.transport_options,
        partitions=target.partitions,
        max_concurrent_transactions=window,
        connect_timeout=target.timeout,
        request_timeout=target.timeout,
        prefetch_data=prefetch,
    )
    client = AsyncWaltzClient(callbacks, config)
    try:
        async with asyncio.timeout(target.timeout):  # not wait_for: it can lose a Ctrl-C
            await client.start()
    except TimeoutError:
        raise UnavailableError(
            f"cannot reach the cluster at {target.uri} within {target.timeout:g} s "
            "(--timeout); is it running?"
        ) from None
    try:
        hwms = {}
        for p in sorted(client.partitions):
            try:
                top, _ = await client.range_read(p, 0, max_records=0, max_bytes=1)
            except PermissionDeniedError:
                raise
            except ServerError as exc:
                raise UnavailableError(
                    f"partition {p}'s server did not answer within {target.timeout:g} s "
                    f"(--timeout); is a server running? (`waltz server list`): {exc}"
                ) from exc
            hwms[p] = top
        callbacks.hwm.update(positions(hwms))
    except BaseException:
        await client.close()
        raise
    return client


async def _close_all(clients: list[AsyncWaltzClient]) -> None:
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


async def _watch(
    tasks: list[asyncio.Task[None]],
    tallies: Sequence[Tally],
    timeout: float,
    tick: Callable[[], None],
    what: str,
    *,
    stop: Callable[[], None] = lambda: None,
) -> None:
    """Wait for ``tasks``; fail when none of ``tallies`` moved for ``timeout`` seconds.

    On the way out (Ctrl-C cancels the run, or a failure) the tasks still running are
    cancelled until they end: a cancellation can be lost (``asyncio.wait_for`` of
    Python 3.11 returns its result when the awaited future completes as it is
    cancelled), so one ``cancel()`` is not enough to stop a loop of submissions."""
    pending = set(tasks)
    try:
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.25)
            tick()
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            quiet = time.monotonic() - max(t.last_activity for t in tallies)
            if pending and quiet > timeout:
                raise UnavailableError(
                    f"no {what} for {timeout:g} s (--timeout); is the cluster up? "
                    "(`waltz cluster show`, `waltz server list`)"
                )
    finally:
        stop()  # the loops end at their next turn even if a cancellation is lost
        await cancel_until_done(pending)


async def cancel_until_done(tasks: set[asyncio.Task[Any]], *, every: float = 0.1) -> None:
    """Cancel ``tasks`` and wait for them, cancelling again every ``every`` seconds those
    that swallowed the cancellation (each is awaited; their results are dropped)."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every)
    await asyncio.gather(*tasks, return_exceptions=True)


def _quotas(partitions: list[int], n: int) -> dict[int, int]:
    """Transaction i goes to partitions[i % k]: how many each partition receives."""
    k = len(partitions)
    return {p: n // k + (1 if j < n % k else 0) for j, p in enumerate(partitions)}


# -- producers ----------------------------------------------------------------------------------


@dataclass
class ProduceSpec:
    transactions: int
    size: int
    producers: int
    window: int
    lock_pool: int
    rate: float
    seed: int | None


def _payload_maker(size: int, seed: int | None) -> Callable[[], bytes]:
    pad = random.Random(seed).randbytes(size)
    if size < STAMP.size:
        return lambda: pad
    tail = pad[STAMP.size :]
    return lambda: STAMP.pack(MAGIC, time.time_ns()) + tail


class PerfAppend(TransactionContext):
    """One perf transaction: stamped data, the perf header, maybe a WRITE lock."""

    def __init__(
        self, partition: int, lock_id: int | None, payload: Callable[[], bytes], tally: Tally
    ) -> None:
        super().__init__()
        self.partition = partition
        self.lock_id = lock_id
        self.payload = payload
        self.tally = tally
        self.data: bytes | None = None

    def partition_id(self, num_partitions: int) -> int:
        return self.partition

    async def execute(self, builder: TransactionBuilder) -> bool:
        if self.data is None:  # stamped once: latencies count from the first attempt
            self.data = self.payload()
        builder.set_header(PERF_HEADER).set_data(self.data)
        if self.lock_id is not None:
            builder.write_lock(LOCK_NAME, self.lock_id)
        return True

    def on_lock_failure(self, transaction_id: int) -> None:
        self.tally.lock_failures += 1


async def produce(
    target: Target,
    spec: ProduceSpec,
    tally: Tally,
    *,
    opened: asyncio.Event | None = None,
    start: asyncio.Event | None = None,
) -> dict[str, Any]:
    """Submit ``spec.transactions`` from ``spec.producers`` clients; the raw figures.

    ``opened`` is set once every producer is connected; producing begins when ``start``
    is set (at once when None)."""
    loop = asyncio.get_running_loop()
    rng = random.Random(spec.seed)
    payload = _payload_maker(spec.size, spec.seed)
    clients: list[AsyncWaltzClient] = []
    try:
        before: dict[int, int] = {}
        for _ in range(spec.producers):
            callbacks = PerfCallbacks()

            def keep(hwms: dict[int, int]) -> dict[int, int]:
                if not before:
                    before.update(hwms)
                return hwms

            client = await open_client(target, callbacks, keep, window=spec.window)
            callbacks.ready.set()
            clients.append(client)
        partitions = sorted(clients[0].partitions)
        if opened is not None:
            opened.set()
        if start is not None:
            await start.wait()
        counter = itertools.count()
        stopped = False

        def stop() -> None:
            nonlocal stopped
            stopped = True

        began = loop.time()
        tally.started = time.monotonic()
        tally.touch()

        async def worker(client: AsyncWaltzClient) -> None:
            while not stopped:
                i = next(counter)
                if i >= spec.transactions:
                    return
                if spec.rate > 0:
                    delay = began + i / spec.rate - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                lock_id = rng.randrange(spec.lock_pool) if spec.lock_pool else None
                context = PerfAppend(partitions[i % len(partitions)], lock_id, payload, tally)
                tally.touch()
                submitted = time.perf_counter()
                try:
                    await client.submit(context)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    tally.error(exc)
                    continue
                tally.latencies.append(time.perf_counter() - submitted)
                tally.retries += context.attempts - 1
                tally.bytes += spec.size
                tally.done += 1
                tally.touch()

        tasks = [loop.create_task(worker(client)) for client in clients for _ in range(spec.window)]
        await _watch(
            tasks, [tally], target.timeout, lambda: None, "transaction completed", stop=stop
        )
        elapsed = loop.time() - began
        after = {p: await clients[0].high_water_mark(p) for p in partitions}
    finally:
        await _close_all(clients)
    return {
        "partitions": partitions,
        "elapsed_s": elapsed,
        "high_water_marks": {"before": before, "after": after},
    }


def producer_summary(spec: ProduceSpec, tally: Tally, raw: dict[str, Any]) -> dict[str, Any]:
    elapsed = max(raw["elapsed_s"], 1e-9)
    return {
        "command": "producers",
        "transactions": tally.done,
        "requested": spec.transactions,
        "errors": tally.errors,
        "first_error": tally.first_error,
        "elapsed_s": round(elapsed, 4),
        "tx_per_s": round(tally.done / elapsed, 1),
        "mb_per_s": round(tally.bytes / MB / elapsed, 3),
        "latency": latency_summary(tally.latencies),
        "retries": tally.retries,
        "retries_per_tx": round(tally.retries / tally.done, 4) if tally.done else 0.0,
        "lock_failures": tally.lock_failures,
        "size": spec.size,
        "producers": spec.producers,
        "in_flight": spec.window,
        "lock_pool": spec.lock_pool,
        "rate": spec.rate,
        "partitions": raw["partitions"],
        "high_water_marks": _str_keys(raw["high_water_marks"]),
    }


def _str_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _str_keys(v) for k, v in value.items()}
    return value


# -- consumers ----------------------------------------------------------------------------------


@dataclass
class ConsumeSpec:
    transactions: int
    consumers: int
    fetch: bool
    prefetch: bool
    produce: ProduceSpec | None


async def consume(
    target: Target,
    spec: ConsumeSpec,
    tallies: list[Tally],
    produced: Tally,
    meter: Meter,
) -> dict[str, Any]:
    """``len(tallies)`` clients each read ``spec.transactions`` from their feeds: the last
    ones committed, or, with ``spec.produce``, the ones produced meanwhile."""
    loop = asyncio.get_running_loop()
    plan: dict[int, int] = {}
    targets: dict[int, int] = {}
    latencies: list[float] = []
    clients: list[AsyncWaltzClient] = []
    feeds: list[PerfCallbacks] = []

    def positions(hwms: dict[int, int]) -> dict[int, int]:
        if not plan:  # the first consumer decides; the others start at the same ids
            quotas = _quotas(sorted(hwms), spec.transactions)
            for p, top in hwms.items():
                if spec.produce is None and top + 1 < quotas[p]:
                    raise WaltzError(
                        f"partition {p} holds {top + 1} transaction(s), {quotas[p]} needed: "
                        "append some first (`waltz perf producers --transactions "
                        f"{spec.transactions}`) or add --produce"
                    )
                plan[p] = top if spec.produce is not None else top - quotas[p]
                targets[p] = plan[p] + quotas[p]
        return dict(plan)

    measure = spec.produce is not None
    """Delivery latency only for what this run produced: an older transaction's stamp
    tells its age, not how long its delivery took."""

    def handler(tally: Tally, finished: asyncio.Event) -> Callable[[Any, float], Awaitable[None]]:
        remaining = {p: targets[p] - plan[p] for p in targets}

        async def on_apply(transaction: Transaction, received: float) -> None:
            p = transaction.partition_id
            if transaction.transaction_id > targets[p]:
                return  # beyond what this run reads (another writer, or a later run)
            size = 0
            if spec.fetch:
                data = await transaction.fetch_data()
                size = len(data)
                if measure and transaction.header == PERF_HEADER and size >= STAMP.size:
                    magic, stamp = STAMP.unpack_from(data)
                    if magic == MAGIC:
                        latencies.append(max(0.0, received - stamp / 1e9))
            tally.done += 1
            tally.bytes += size
            tally.touch()
            remaining[p] -= 1
            if not any(remaining.values()):
                tally.finished = loop.time()
                finished.set()

        return on_apply

    async def wait(event: asyncio.Event) -> None:
        await event.wait()

    tasks: list[asyncio.Task[Any]] = []
    try:
        for tally in tallies:
            callbacks = PerfCallbacks()
            clients.append(await open_client(target, callbacks, positions, prefetch=spec.prefetch))
            feeds.append(callbacks)
            event = asyncio.Event()
            callbacks.on_apply = handler(tally, event)
            tasks.append(loop.create_task(wait(event)))
        go = asyncio.Event()
        producer: asyncio.Task[dict[str, Any]] | None = None
        if spec.produce is not None:
            opened = asyncio.Event()
            producer = loop.create_task(
                produce(target, spec.produce, produced, opened=opened, start=go)
            )
            tasks.append(producer)
            connected = loop.create_task(wait(opened))
            tasks.append(connected)
            await asyncio.wait({producer, connected}, return_when=asyncio.FIRST_COMPLETED)
            if producer.done():
                producer.result()  # raises why the producers could not start
        began, started = loop.time(), time.monotonic()
        for tally in tallies:
            tally.started = started
            tally.touch()
        produced.touch()
        for callbacks in feeds:
            callbacks.ready.set()
        go.set()

        def tick() -> None:
            if spec.produce is not None:
                meter.update("produced", produced)
            meter.update("consumed", Tally(done=sum(t.done for t in tallies), started=started))

        await _watch(tasks, [*tallies, produced], target.timeout, tick, "transaction delivered")
        ends = [t.finished for t in tallies if t.finished is not None]
        elapsed = (max(ends) if ends else loop.time()) - began
        raw_produced = producer.result() if producer is not None else None
        feed_errors = [c.feed_error for c in feeds if c.feed_error]
    finally:
        await cancel_until_done(set(tasks))
        await _close_all(clients)
    return {
        "partitions": sorted(plan),
        "elapsed_s": elapsed,
        "start": dict(plan),
        "end": dict(targets),
        "latencies": latencies,
        "produced": raw_produced,
        "feed_errors": feed_errors,
    }


def consumer_summary(
    spec: ConsumeSpec, tallies: list[Tally], produced: Tally, raw: dict[str, Any]
) -> dict[str, Any]:
    elapsed = max(raw["elapsed_s"], 1e-9)
    done = sum(t.done for t in tallies)
    size = sum(t.bytes for t in tallies)
    return {
        "command": "consumers",
        "transactions": done,
        "requested": spec.transactions,
        "consumers": spec.consumers,
        "per_consumer": [t.done for t in tallies],
        "elapsed_s": round(elapsed, 4),
        "tx_per_s": round(done / elapsed, 1),
        "mb_per_s": round(size / MB / elapsed, 3),
        "bytes": size,
        "data_fetched": spec.fetch,
        "delivery_latency": latency_summary(raw["latencies"]),
        "feed_errors": raw["feed_errors"],
        "partitions": raw["partitions"],
        "positions": _str_keys({"after": raw["start"], "until": raw["end"]}),
        "produced": (
            None
            if spec.produce is None or raw["produced"] is None
            else producer_summary(spec.produce, produced, raw["produced"])
        ),
    }
