"""Cluster manager and observability figures (never pass/fail).

On a real standalone ZooKeeper started by the script:

1. Assignment computation: :func:`compute_assignment` for N partitions and S
   servers (the leader runs it on every membership change): ms per call.
2. Start-up: S cluster managers start at once on N partitions: seconds until
   every partition is held by exactly one of them.
3. Fail-over: one server's session is expired (for real, as when its process
   dies and ZooKeeper times it out; the timeout itself is not counted): seconds
   until its partitions are held by the others, and how many moved.

And the observability hot path:

4. Metric updates: microseconds per ``ServerMetrics.committed`` and per
   ``StorageNodeMetrics.appended`` (called once per commit / engine append).
5. A ``GET /metrics`` scrape over HTTP (64 partitions' series): ms p50/p99.

    .venv/bin/python bench/cluster_manager.py [--partitions 64] [--servers 3]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import time
import uuid

from waltz_api.cluster import ServerInfo
from waltz_api.contracts.coordination import Coordination
from waltz_conformance.servers.zookeeper import ZooKeeperServer
from waltz_coord_zk import ZooKeeperCoordination
from waltz_coord_zk.conformance import harness as conformance_harness
from waltz_server.cluster_admin import ClusterAdmin
from waltz_server.observability import HttpEndpoint, ServerMetrics, http_get, new_registry
from waltz_server.server.cluster_manager import ClusterManager, compute_assignment
from waltz_storage_node.metrics import StorageNodeMetrics


def bench_compute(partitions: int, servers: int, repeats: int) -> None:
    live = [ServerInfo(i, f"tcp://s{i}") for i in range(1, servers + 1)]
    current = compute_assignment(partitions, live[:-1], {})  # one server just joined
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        compute_assignment(partitions, live, current)
        best = min(best, time.perf_counter() - started)
    print(f"compute_assignment  {partitions} partitions, {servers} servers: {best * 1e3:.2f} ms")


async def bench_cluster(server: ZooKeeperServer, partitions: int, servers: int) -> None:
    root = f"/bench-cm/{uuid.uuid4().hex[:8]}"

    def new() -> Coordination:
        return ZooKeeperCoordination(server.connect_string, root, session_timeout=4.0)

    admin_client = new()
    await admin_client.start()
    admin = ClusterAdmin(admin_client)
    await admin.create_cluster(
        num_partitions=partitions, num_replicas=1, storage_nodes=["127.0.0.1:7001"]
    )
    managers = [ClusterManager(new, f"tcp://127.0.0.1/{i}") for i in range(servers)]

    def held() -> int:
        owners: dict[int, int] = {}
        for m in managers:
            for p in m.owned:
                owners[p] = owners.get(p, 0) + 1
        return len(owners) if all(n == 1 for n in owners.values()) else -1

    async def wait_all(deadline: float = 120) -> float:
        started = time.perf_counter()
        while held() != partitions or not all(m.registered for m in managers):
            if time.perf_counter() - started > deadline:
                raise TimeoutError("the cluster did not converge")
            await asyncio.sleep(0.005)
        return time.perf_counter() - started

    try:
        started = time.perf_counter()
        await asyncio.gather(*(m.start() for m in managers))
        await wait_all()
        print(
            f"start-up            {servers} servers, {partitions} partitions: every partition "
            f"held after {time.perf_counter() - started:.2f} s"
        )
        victim = managers[-1]
        moved = len(victim.owned)
        before = await admin.partition_assignments()
        client = victim.coordination
        assert client is not None
        harness = conformance_harness({"server": server, "session_timeout": 4.0})
        expired_at = time.perf_counter()
        await harness.expire_session(client)
        # The victim comes back (new id) and gets a share again; time the first moment all
        # partitions are held again by live servers, excluding the victim's return.
        others = managers[:-1]
        while True:
            owners = [p for m in others for p in m.owned]
            if len(owners) == partitions and len(set(owners)) == partitions:
                break
            if victim.registrations == 2 and held() == partitions:
                break
            if time.perf_counter() - expired_at > 120:
                raise TimeoutError("fail-over did not complete")
            await asyncio.sleep(0.005)
        failover = time.perf_counter() - expired_at
        while victim.registrations < 2 or len(victim.owned) < partitions // servers:
            if time.perf_counter() - expired_at > 120:
                raise TimeoutError("the returning server got no share")
            await asyncio.sleep(0.005)
        await wait_all()
        rebalanced = time.perf_counter() - expired_at
        after = await admin.partition_assignments()
        bumps = sum(a.generation - b.generation for a, b in zip(after, before, strict=True))
        print(
            f"fail-over           {moved} partitions of the expired server held by others "
            f"{failover:.2f} s after expiry; it is back with a fair share after "
            f"{rebalanced:.2f} s; {bumps} generation bumps in all"
        )
    finally:
        for m in managers:
            await m.stop()
        await admin_client.close()


def bench_metric_updates(count: int) -> None:
    server = ServerMetrics(new_registry(process_metrics=False))
    storage = StorageNodeMetrics(new_registry(process_metrics=False))
    started = time.perf_counter()
    for i in range(count):
        server.committed(i & 7, 1, 0.001)
    per_commit = (time.perf_counter() - started) / count
    started = time.perf_counter()
    for i in range(count):
        storage.appended(i & 7, 10, 1000, 0.001)
    per_append = (time.perf_counter() - started) / count
    print(
        f"metric updates      ServerMetrics.committed {per_commit * 1e6:.2f} us, "
        f"StorageNodeMetrics.appended {per_append * 1e6:.2f} us"
    )


async def bench_scrape(scrapes: int) -> None:
    metrics = ServerMetrics()
    for p in range(64):
        metrics.committed(p, 100, 0.002)
        metrics.set_high_water_mark(p, 1000)
        for r in range(3):
            metrics.set_replica_lag(p, f"127.0.0.1:70{r:02d}", 0)
    latencies: list[float] = []
    async with HttpEndpoint(metrics.registry) as http:
        for _ in range(scrapes):
            started = time.perf_counter()
            body = (await http_get(f"{http.url}/metrics")).body
            latencies.append(time.perf_counter() - started)
    latencies.sort()
    p50 = statistics.median(latencies) * 1e3
    p99 = latencies[int(len(latencies) * 0.99) - 1] * 1e3
    print(f"GET /metrics        {len(body)} bytes: p50 {p50:.2f} ms, p99 {p99:.2f} ms")


async def run(args: argparse.Namespace) -> None:
    bench_compute(args.partitions, args.servers, 20)
    bench_compute(1024, 16, 5)
    bench_metric_updates(args.updates)
    await bench_scrape(args.scrapes)
    with ZooKeeperServer() as server:
        await bench_cluster(server, args.partitions, args.servers)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS            {peak:.0f} MiB (this process)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=64)
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--updates", type=int, default=100_000)
    parser.add_argument("--scrapes", type=int, default=200)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
