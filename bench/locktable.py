"""Lock tables: checks per second, latency, memory, and the false-positive rate of hwm-array.

1. Throughput of the append path's lock work: ``check`` then, when it passes,
   ``record`` at the next id; 2 WRITE locks per request drawn from 10,000
   distinct locks; clients 0-100 transactions behind. For ``hwm-array``
   (default size 30000), ``exact`` and the ``memory`` reference, each resolved
   by plugin name. Best and median of several repeats (the machine is shared),
   per-request latency percentiles, and the table's memory after recording
   100,000 distinct locks (tracemalloc).
2. The false-positive rate of ``hwm-array`` against its size and the number of
   distinct locks: on one random workload, ``exact`` decides (it is the
   truth) and ``hwm-array`` is asked the same question; a false positive is a
   request ``exact`` lets through and ``hwm-array`` rejects. Both record every
   request ``exact`` accepts. Never pass/fail.

    .venv/bin/python bench/locktable.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from waltz_api.contracts import LockTable
from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry
from waltz_api.types import LockRequest

TableFactory = Callable[[int, Mapping[str, Any]], LockTable]


def factory(name: str) -> TableFactory:
    table: TableFactory = get_registry().get(PluginKind.LOCK_TABLE, name).factory
    return table


def workload(
    seed: int, requests: int, distinct_locks: int, max_lag: int
) -> tuple[list[LockRequest], list[int]]:
    """``requests`` requests of 2 WRITE locks, and each one's client lag."""
    rng = random.Random(seed)
    hashes = [rng.getrandbits(64) for _ in range(distinct_locks)]
    pick = rng.randrange
    reqs = [
        LockRequest(write=(hashes[pick(distinct_locks)], hashes[pick(distinct_locks)]))
        for _ in range(requests)
    ]
    lags = [pick(max_lag + 1) for _ in range(requests)]
    return reqs, lags


def append_path(table: LockTable, reqs: Sequence[LockRequest], lags: Sequence[int]) -> float:
    """Run check (+ record when it passes) over ``reqs``; the elapsed seconds."""
    check, record = table.check, table.record
    hwm = 0
    start = time.perf_counter()
    for request, lag in zip(reqs, lags, strict=True):
        if check(request, hwm - lag) is None:
            hwm += 1
            record(request, hwm)
    return time.perf_counter() - start


def latencies_ns(table: LockTable, reqs: Sequence[LockRequest], lags: Sequence[int]) -> list[int]:
    """Per-request check+record time (includes ~50 ns of timer overhead)."""
    check, record, clock = table.check, table.record, time.perf_counter_ns
    hwm = 0
    out: list[int] = []
    for request, lag in zip(reqs, lags, strict=True):
        t0 = clock()
        if check(request, hwm - lag) is None:
            hwm += 1
            record(request, hwm)
        out.append(clock() - t0)
    return out


def table_memory(make: TableFactory, distinct_locks: int) -> int:
    """Bytes held by a table after recording ``distinct_locks`` locks (2 per request)."""
    rng = random.Random(99)
    reqs = [
        LockRequest(write=(rng.getrandbits(64), rng.getrandbits(64)))
        for _ in range(distinct_locks // 2)
    ]
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        table = make(0, {})
        for txid, request in enumerate(reqs, start=1):
            table.record(request, txid)
        size = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    del table
    return size


def throughput(args: argparse.Namespace) -> None:
    reqs, lags = workload(1, args.requests, 10_000, 100)
    print(
        f"1. check+record, 2 WRITE locks/request, 10,000 distinct locks, clients 0-100 behind; "
        f"{args.requests:,} requests x {args.repeats} repeats"
    )
    print(
        f"  {'table':<18}{'requests/s best':>16}{'median':>12}{'locks/s best':>14}"
        f"{'p50 ns':>9}{'p99 ns':>9}{'memory@100k locks':>19}"
    )
    for name in ("hwm-array", "exact", "memory"):
        make = factory(name)
        rates = []
        for _ in range(args.repeats):
            table = make(0, {})
            rates.append(len(reqs) / append_path(table, reqs, lags))
        lat = sorted(latencies_ns(make(0, {}), reqs, lags))
        p50 = lat[len(lat) // 2]
        p99 = lat[int(len(lat) * 0.99)]
        memory = table_memory(make, 100_000)
        best = max(rates)
        print(
            f"  {name:<18}{best:>16,.0f}{statistics.median(rates):>12,.0f}{2 * best:>14,.0f}"
            f"{p50:>9,}{p99:>9,}{memory / 1024:>16,.0f} KiB"
        )


def false_positives(
    size: int, distinct_locks: int, requests: int, max_lag: int, seed: int
) -> tuple[float, float, int]:
    """(false-positive rate, true-conflict rate, requests exact accepted) of hwm-array."""
    warmup = requests // 2
    reqs, lags = workload(seed, warmup + requests, distinct_locks, max_lag)
    approx = factory("hwm-array")(0, {"size": size})
    exact = factory("exact")(0, {})
    hwm = 0
    accepted = conflicts = wrong = 0
    for i, (request, lag) in enumerate(zip(reqs, lags, strict=True)):
        client = hwm - lag
        truth = exact.check(request, client)
        estimate = approx.check(request, client)
        if truth is not None and estimate is None:
            raise AssertionError(f"false negative at request {i}: {request}")
        counted = i >= warmup
        if truth is None:
            if counted:
                accepted += 1
                wrong += estimate is not None
            hwm += 1
            exact.record(request, hwm)
            approx.record(request, hwm)
        elif counted:
            conflicts += 1
    return wrong / max(accepted, 1), conflicts / requests, accepted


def false_positive_tables(args: argparse.Namespace) -> None:
    sizes = [1_000, 10_000, 30_000, 100_000]
    distinct = [1_000, 10_000, 100_000]
    for max_lag in args.lags:
        print(
            f"\n2. hwm-array false positives (needless rejections / requests exact accepts); "
            f"2 WRITE locks/request, clients 0-{max_lag} behind, "
            f"{args.fp_requests:,} requests after {args.fp_requests // 2:,} warm-up"
        )
        header = "".join(f"{f'{d:,} locks':>16}" for d in distinct)
        print(f"  {'slots':>9}{header}")
        true_rates: dict[int, float] = {}
        for size in sizes:
            cells = []
            for d in distinct:
                rate, conflict_rate, _ = false_positives(size, d, args.fp_requests, max_lag, 7)
                true_rates[d] = conflict_rate
                cells.append(f"{rate:>15.4%} ")
            print(f"  {size:>9,}{''.join(cells)}")
        real = "".join(f"{true_rates[d]:>15.2%} " for d in distinct)
        print(f"  {'conflicts':>9}{real}  <- requests exact rejects (real conflicts)")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fp-requests", type=int, default=100_000)
    parser.add_argument(
        "--lags", type=lambda s: [int(v) for v in s.split(",")], default=[100, 1000]
    )
    parser.add_argument("--quick", action="store_true", help="smaller runs")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeats, args.fp_requests = 50_000, 2, 20_000
    throughput(args)
    false_positive_tables(args)


if __name__ == "__main__":
    main()
