"""What one console refresh costs at scale: the views over a cluster of N partitions.

Builds the inputs a console holds for a cluster of ``--partitions`` partitions (3
replicas each, ``--servers`` servers, 5 storage nodes, 2 clients per partition): the
metadata, every server's ``/status`` document and ``/metrics`` text (a commit latency
histogram per partition), every storage node's ``/status``. Then times, per refresh:
parsing the ``/metrics`` texts (only the families the console reads), parsing the
``/status`` JSON, building the snapshot and deriving events, one page of the
partitions table, recording the charts' points and drawing a partition's charts;
beside them, in the same run, ``json.loads`` of the same status documents (the floor
of reading them at all). Never pass/fail.

    .venv/bin/python bench/console.py [--partitions 1000] [--servers 3] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

from waltz_api.cluster import (
    ClusterConfig,
    PartitionAssignment,
    PartitionStoreMetadata,
    ReplicaAssignments,
    ServerInfo,
)
from waltz_console.collector import parse_metrics
from waltz_console.events import derive_events
from waltz_console.history import History
from waltz_console.views import MetaState, Probes, Trackers, build, page

BOUNDS = ("0.0005", "0.001", "0.002", "0.005", "0.01", "0.02", "0.05", "0.1", "0.2", "0.5",
          "1.0", "2.0", "5.0", "+Inf")  # fmt: skip


def inputs(
    partitions: int, servers: int, tick: int
) -> tuple[MetaState, dict[str, str], dict[str, str]]:
    nodes = [f"10.0.0.{i}:7000" for i in range(1, 6)]
    storage: dict[str, list[int]] = {n: [] for n in nodes}
    for p in range(partitions):
        for i in range(3):
            storage[nodes[(p + i) % len(nodes)]].append(p)
    meta = MetaState(
        uri="zk://10.0.0.2:2181/waltz",
        config=ClusterConfig(uuid.UUID(int=1), partitions, 3),
        assignments=ReplicaAssignments(3, {n: tuple(ps) for n, ps in storage.items()}),
        servers={s: ServerInfo(s, f"tcp://10.0.1.{s}:5600") for s in range(1, servers + 1)},
        owners={
            p: PartitionAssignment(p, 1 + p % servers, f"tcp://10.0.1.{1 + p % servers}:5600", 3)
            for p in range(partitions)
        },
        store={p: PartitionStoreMetadata(p, 3, 7) for p in range(partitions)},
    )
    status_texts: dict[str, str] = {}
    metrics_texts: dict[str, str] = {}
    for s in range(1, servers + 1):
        rows = []
        lines = ["# HELP waltz_server_commit_latency_seconds x"]
        for p in range(s - 1, partitions, servers):
            hwm = 1000 * p + tick * 50
            rows.append(
                {
                    "partition": p, "generation": 3, "ready": True, "state": "writable",
                    "high_water_mark": hwm, "session_id": 7, "low_water_mark": 100,
                    "replicas": [nodes[(p + i) % 5] for i in range(3)],
                    "writable_replicas": [nodes[(p + i) % 5] for i in range(3)],
                    "acknowledged": {nodes[(p + i) % 5]: hwm - i for i in range(3)},
                    "sessions_started": 1, "appends": hwm, "lock_failures": tick,
                    "recoveries": 1,
                    "clients": [{"client": f"client:{c}", "position": hwm - c} for c in (1, 2)],
                }
            )  # fmt: skip
            for i, le in enumerate(BOUNDS):
                count = (tick + 1) * 10 * min(i + 1, 8)
                lines.append(
                    f'waltz_server_commit_latency_seconds_bucket{{le="{le}",partition="{p}"}} '
                    f"{count}.0"
                )
            lines.append(f'waltz_server_commit_latency_seconds_count{{partition="{p}"}} 1.0')
            lines.append(f'waltz_server_appended_transactions_total{{partition="{p}"}} 1.0')
            lines.append(f'waltz_server_high_water_mark{{partition="{p}"}} {hwm}.0')
        url = f"http://10.0.1.{s}:9500"
        status_texts[url] = json.dumps(
            {"role": "server", "server_id": s, "endpoint": f"tcp://10.0.1.{s}:5600",
             "leader": s == 1, "connected_clients": 10, "partitions": rows}
        )  # fmt: skip
        metrics_texts[url] = "\n".join(lines)
    for i, node in enumerate(nodes):
        url = f"http://10.0.0.{i + 1}:9501"
        status_texts[url] = json.dumps(
            {"role": "storage", "endpoint": f"tcp://{node}", "serving": True,
             "disk": {"used": 1, "free": 2, "size": 3},
             "partitions": [{"partition": p, "max_transaction_id": 1000 * p, "low_water_mark": 1,
                             "available": True} for p in storage[node]]}
        )  # fmt: skip
        metrics_texts[url] = 'waltz_storage_fsync_latency_seconds_bucket{le="+Inf"} 4.0\n'
    return meta, status_texts, metrics_texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--partitions", type=int, default=1000)
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    ticks = [inputs(args.partitions, args.servers, t) for t in range(args.repeats + 1)]
    metrics_bytes = sum(len(t) for t in ticks[0][2].values())
    print(
        f"console refresh: {args.partitions} partitions, {args.servers} servers, 5 storage "
        f"nodes; /metrics texts {metrics_bytes / 1e6:.1f} MB per refresh"
    )
    trackers = Trackers()
    previous = None
    timings: dict[str, list[float]] = {
        "json.loads of the /status documents (floor)": [],
        "parse the /status documents": [],
        "parse the /metrics texts (wanted families)": [],
        "build the snapshot and derive events": [],
        "one page of 50 partitions": [],
        "record the charts' points (every 5 s)": [],
        "a partition's charts (its page, each refresh)": [],
    }
    history = History(step=1.0)  # a tick is a second here
    for tick, (meta, statuses, metrics_texts) in enumerate(ticks):
        started = time.perf_counter()
        for text in statuses.values():
            json.loads(text)
        floor = time.perf_counter() - started
        started = time.perf_counter()
        probes = Probes(status={u: json.loads(t) for u, t in statuses.items()})
        parsed_status = time.perf_counter() - started
        started = time.perf_counter()
        probes.metrics = {u: parse_metrics(t) for u, t in metrics_texts.items()}
        parsed_metrics = time.perf_counter() - started
        started = time.perf_counter()
        snapshot = build(meta, probes, trackers, float(tick))
        derive_events(previous, snapshot)
        built = time.perf_counter() - started
        started = time.perf_counter()
        page(snapshot.partitions, offset=950, limit=50, query="", fields=("partition",))
        paged = time.perf_counter() - started
        started = time.perf_counter()
        history.record(float(tick), snapshot)
        recorded = time.perf_counter() - started
        started = time.perf_counter()
        history.charts(args.partitions - 1, float(tick))
        charted = time.perf_counter() - started
        previous = snapshot
        if tick == 0:
            continue  # the first has no rates yet
        for name, value in zip(
            timings,
            (floor, parsed_status, parsed_metrics, built, paged, recorded, charted),
            strict=True,
        ):
            timings[name].append(value)
    total = 0.0
    for name, values in timings.items():
        if name.endswith("(floor)"):
            print(f"  {name:<46} median {statistics.median(values) * 1000:8.2f} ms")
            continue
        total += statistics.median(values)
        print(
            f"  {name:<46} median {statistics.median(values) * 1000:8.2f} ms   "
            f"best {min(values) * 1000:8.2f} ms"
        )
    print(f"  {'a whole refresh (sum of the medians)':<46} median {total * 1000:8.2f} ms")
    p = previous.partition(args.partitions - 1) if previous else None
    assert p is not None and p["commit_rate"] and p["commit_p99_ms"] is not None


if __name__ == "__main__":
    main()
