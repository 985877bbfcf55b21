"""Coordination plugins side by side: CAS throughput, counters, watch notification latency.

Every coordination plugin installed (found through the plugin registry) is
measured in one run, against a real service the script starts itself:

- ``memory``: the in-process reference (no I/O; the ceiling);
- ``zk``: a real standalone ZooKeeper 3.8 (waltz_conformance.servers.zookeeper);
- ``etcd``: a real 3-member etcd cluster (waltz_conformance.servers.etcd), when installed;
- ``local``: a file in a temp dir, when installed.

Figures (never pass/fail; the machine is shared, so each is the best of a
few repeats where noted):

1. CAS, one client: sequential ``set(expected_version=v)`` chaining the
   returned version: operations/s and per-operation latency p50/p99.
2. CAS pipelined: one client, 16 keys, one CAS chain per key running
   concurrently (no conflicts): CAS/s, showing how far a client pipelines.
3. CAS under contention: 4 clients run read-modify-CAS loops on one key for
   a fixed number of successful updates: successful CAS/s and conflict rate.
4. Counters: ``increment`` from 4 concurrent clients: increments/s.
5. Watch notification latency: one client watches a key, another writes it;
   time from just before the write until the watcher's callback sees that
   version: p50/p99 over sequential writes.

    .venv/bin/python bench/coordination.py [--quick] [--plugins memory,zk]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from waltz_api.cluster import coordination_from_uri
from waltz_api.contracts.coordination import Coordination, Versioned
from waltz_api.errors import BadVersionError
from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry

UriFactory = Callable[[str], str]


# -- services ----------------------------------------------------------------------------


@contextlib.contextmanager
def memory_service() -> Iterator[UriFactory]:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    yield lambda root: f"memory://{name}{root}"


@contextlib.contextmanager
def zookeeper_service() -> Iterator[UriFactory]:
    from waltz_conformance.servers.zookeeper import ZooKeeperServer

    with ZooKeeperServer() as server:
        yield server.uri


@contextlib.contextmanager
def etcd_service() -> Iterator[UriFactory]:
    from waltz_conformance.servers.etcd import EtcdCluster

    with tempfile.TemporaryDirectory(prefix="waltz-bench-etcd-") as tmp:
        cluster = EtcdCluster(Path(tmp), size=3)
        cluster.start()
        try:
            yield cluster.uri
        finally:
            cluster.stop()


@contextlib.contextmanager
def local_service() -> Iterator[UriFactory]:
    with tempfile.TemporaryDirectory(prefix="waltz-bench-local-") as tmp:
        yield lambda root: f"local://{tmp}?root={root}"


SERVICES: dict[str, Callable[[], AbstractContextManager[UriFactory]]] = {
    "memory": memory_service,
    "zk": zookeeper_service,
    "etcd": etcd_service,
    "local": local_service,
}


# -- measurements ----------------------------------------------------------------------------


@dataclass
class Figures:
    plugin: str
    cas_ops: float = 0.0
    cas_p50_ms: float = 0.0
    cas_p99_ms: float = 0.0
    pipelined_ops: float = 0.0
    contended_ops: float = 0.0
    conflict_rate: float = 0.0
    increments: float = 0.0
    watch_p50_ms: float = 0.0
    watch_p99_ms: float = 0.0
    notes: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


@contextlib.asynccontextmanager
async def clients(uri: str, count: int) -> AsyncIterator[list[Coordination]]:
    made: list[Coordination] = []
    try:
        for _ in range(count):
            client = coordination_from_uri(uri)
            made.append(client)
            await client.start()
        yield made
    finally:
        for client in made:
            with contextlib.suppress(Exception):
                await client.close()


async def bench_cas_single(client: Coordination, ops: int) -> tuple[float, list[float]]:
    version = await client.create("/cas-single", b"0")
    latencies: list[float] = []
    started = time.perf_counter()
    for i in range(ops):
        t0 = time.perf_counter()
        version = await client.set("/cas-single", str(i).encode(), expected_version=version)
        latencies.append(time.perf_counter() - t0)
    return ops / (time.perf_counter() - started), latencies


async def bench_cas_pipelined(client: Coordination, keys: int, per_key: int) -> float:
    async def chain(key: int) -> None:
        path = f"/cas-pipelined/{key}"
        version = await client.create(path, b"0")
        for i in range(per_key):
            version = await client.set(path, str(i).encode(), expected_version=version)

    started = time.perf_counter()
    await asyncio.gather(*(chain(k) for k in range(keys)))
    return keys * per_key / (time.perf_counter() - started)


async def bench_cas_contended(group: list[Coordination], updates: int) -> tuple[float, float]:
    await group[0].create("/cas-contended", b"0")
    remaining = [updates]
    conflicts = [0]

    async def worker(client: Coordination) -> None:
        while remaining[0] > 0:
            current = await client.get("/cas-contended")
            assert current is not None
            try:
                await client.set(
                    "/cas-contended",
                    str(int(current.value) + 1).encode(),
                    expected_version=current.version,
                )
                remaining[0] -= 1
            except BadVersionError:
                conflicts[0] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in group))
    elapsed = time.perf_counter() - started
    final = await group[0].get("/cas-contended")
    assert final is not None
    done = int(final.value)
    return done / elapsed, conflicts[0] / max(1, conflicts[0] + done)


async def bench_increments(group: list[Coordination], per_client: int) -> float:
    async def worker(client: Coordination) -> list[int]:
        return [await client.increment("/counter") for _ in range(per_client)]

    started = time.perf_counter()
    results = await asyncio.gather(*(worker(c) for c in group))
    elapsed = time.perf_counter() - started
    values = [v for r in results for v in r]
    assert len(set(values)) == len(values), "a counter value was handed out twice"
    return len(values) / elapsed


async def bench_watch_latency(
    watcher: Coordination, writer: Coordination, writes: int
) -> list[float]:
    await writer.create("/watched", b"start")
    seen: dict[int, float] = {}
    arrived = asyncio.Event()

    def on_change(value: Versioned | None) -> None:
        if value is not None:
            seen[value.version] = time.perf_counter()
            arrived.set()

    watch = await watcher.watch("/watched", on_change)
    latencies: list[float] = []
    try:
        await asyncio.wait_for(arrived.wait(), 30)
        for i in range(writes):
            arrived.clear()
            t0 = time.perf_counter()
            version = await writer.set("/watched", str(i).encode())
            deadline = time.monotonic() + 30
            while version not in seen:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no notification of version {version} within 30s")
                arrived.clear()
                if version in seen:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(arrived.wait(), 1)
            latencies.append(seen[version] - t0)
    finally:
        watch.cancel()
    return latencies


async def measure(plugin: str, make_uri: UriFactory, quick: bool) -> Figures:
    figures = Figures(plugin)
    scale = 1 if quick else 4
    root = f"/bench-{uuid.uuid4().hex[:8]}"
    uri = make_uri(root)
    async with clients(uri, 4) as group:
        best = 0.0
        all_latencies: list[float] = []
        for repeat in range(3):
            sub = make_uri(f"{root}-cas{repeat}")
            async with clients(sub, 1) as (single,):
                ops, latencies = await bench_cas_single(single, 250 * scale)
            best = max(best, ops)
            all_latencies.extend(latencies)
        figures.cas_ops = best
        figures.cas_p50_ms = percentile(all_latencies, 0.5) * 1000
        figures.cas_p99_ms = percentile(all_latencies, 0.99) * 1000
        figures.pipelined_ops = await bench_cas_pipelined(group[2], 16, 25 * scale)
        figures.contended_ops, figures.conflict_rate = await bench_cas_contended(group, 150 * scale)
        figures.increments = await bench_increments(group, 60 * scale)
        watch_latencies = await bench_watch_latency(group[0], group[1], 100 * scale)
        figures.watch_p50_ms = percentile(watch_latencies, 0.5) * 1000
        figures.watch_p99_ms = percentile(watch_latencies, 0.99) * 1000
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Fewer operations.")
    parser.add_argument(
        "--plugins", default="", help="Comma-separated plugin names (default: every installed)."
    )
    args = parser.parse_args()
    installed = get_registry().names(PluginKind.COORDINATION)
    wanted = [p for p in args.plugins.split(",") if p] or installed
    results: list[Figures] = []
    with ExitStack() as stack:
        for plugin in wanted:
            if plugin not in installed:
                print(f"{plugin}: not installed (installed: {', '.join(installed)})")
                continue
            service = SERVICES.get(plugin)
            if service is None:
                print(f"{plugin}: no service recipe in this script; add one to SERVICES")
                continue
            try:
                make_uri = stack.enter_context(service())
            except Exception as exc:  # a benchmark reports and moves on
                print(f"{plugin}: could not start its service: {type(exc).__name__}: {exc}")
                continue
            print(f"measuring {plugin} ...", flush=True)
            try:
                results.append(asyncio.run(measure(plugin, make_uri, args.quick)))
            except Exception as exc:
                print(f"{plugin}: failed: {type(exc).__name__}: {exc}")
    header = (
        f"{'plugin':<8} {'CAS/s':>8} {'CAS p50':>9} {'CAS p99':>9} {'16-key CAS/s':>13} "
        f"{'4-way CAS/s':>12} "
        f"{'conflicts':>10} {'incr/s':>8} {'watch p50':>10} {'watch p99':>10}"
    )
    print()
    print(header)
    print("-" * len(header))
    for f in results:
        print(
            f"{f.plugin:<8} {f.cas_ops:>8.0f} {f.cas_p50_ms:>7.2f}ms {f.cas_p99_ms:>7.2f}ms "
            f"{f.pipelined_ops:>13.0f} {f.contended_ops:>12.0f} {f.conflict_rate:>9.0%} "
            f"{f.increments:>8.0f} "
            f"{f.watch_p50_ms:>8.2f}ms {f.watch_p99_ms:>8.2f}ms"
        )
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"\npeak RSS of this process: {peak_kib / 1024:.0f} MiB")
    if results:
        best = max(results, key=lambda f: f.cas_ops)
        print(
            f"fastest single-client CAS: {best.plugin} ({best.cas_ops:.0f}/s); "
            f"median watch p50 across plugins: "
            f"{statistics.median(f.watch_p50_ms for f in results):.2f} ms"
        )


if __name__ == "__main__":
    main()
