"""The storage node's health and metrics endpoint (config section ``[http]``).

``/metrics`` serves the node's :class:`~waltz_storage_node.metrics.StorageNodeMetrics`
(appended records and bytes, engine appends and their latency per partition,
fsync latency, fenced requests and sessions, disk usage and free space, each
hosted partition's marks, process memory and CPU).

``/status`` (JSON, for ``waltz console``): the node's endpoint, whether it serves, its
disk usage and each hosted partition's marks and availability.

``/livez`` answers while the node's event loop does. ``/readyz`` (and
``/health``) checks that the node is opened and caught up: it serves its
transport endpoint, no hosted partition is marked unavailable, and every
hosted partition holds at least the records its current store session
recovered to (its low-water mark). A replica still behind within a running
session is visible only to the partition's server
(``waltz_server_replica_lag_transactions``): a rolling restart waits for both.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from waltz_api import __version__
from waltz_api.errors import WaltzError
from waltz_api.http_endpoint import Check, HttpEndpoint, HttpSection
from waltz_storage_node.metrics import DiskUsage, PartitionState, StorageNodeMetrics
from waltz_storage_node.node import REQUEST_KINDS, StorageNode


def metrics_for(section: HttpSection) -> StorageNodeMetrics | None:
    """The node's metrics when the endpoint is enabled (no cost otherwise)."""
    return StorageNodeMetrics() if section.enabled else None


def disk_usage(data_dir: str | os.PathLike[str]) -> DiskUsage:
    """Bytes of the files under ``data_dir``, and its file system's free and total bytes."""
    root = Path(data_dir)
    used = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                used += os.lstat(os.path.join(directory, name)).st_size
            except FileNotFoundError:  # removed while we walked (a truncation, a remove)
                continue
    fs = shutil.disk_usage(root)
    return DiskUsage(used, fs.free, fs.total)


def partition_states(node: StorageNode) -> list[PartitionState]:
    """Each hosted partition's marks, from the engine."""
    states = []
    for partition_id, worker in sorted(node.hosted_workers().items()):
        try:
            partition = node.engine.partition(partition_id)
            info = partition.session_info()
            highest = partition.max_transaction_id()
            start = partition.log_start()
            sizes = [e.size for e in partition.local_extents()]
        except WaltzError:
            continue  # removed or closed meanwhile
        local = -1 if any(size < 0 for size in sizes) else sum(sizes)
        states.append(
            PartitionState(
                partition_id, highest, info.low_water_mark, worker.available, start, local
            )
        )
    return states


def storage_node_endpoint(
    section: HttpSection, node: StorageNode, data_dir: str | os.PathLike[str] | None = None
) -> HttpEndpoint:
    """An (unstarted) endpoint serving ``node``'s metrics and health checks
    (disk usage of ``data_dir`` when given)."""
    metrics = node.metrics if node.metrics is not None else StorageNodeMetrics()
    if node.metrics is None:
        node.metrics = metrics
        metrics.expect_requests(REQUEST_KINDS)
        for partition_id in node.hosted_workers():
            metrics.host_partition(partition_id)
    if data_dir is not None:
        directory = data_dir
        metrics.watch_storage(lambda: disk_usage(directory), lambda: partition_states(node))

    def transport() -> Check:
        if not node.serving:
            return Check(False, "the storage node is not serving")
        return Check(True, f"listening on {node.endpoint}")

    def partitions() -> Check:
        workers = node.hosted_workers()
        unavailable = sorted(p for p, w in workers.items() if not w.available)
        detail = f"{len(workers)} hosted"
        if unavailable:
            return Check(False, f"{detail}; marked unavailable: {unavailable}")
        return Check(True, detail)

    def caught_up() -> Check:
        behind = [
            f"{s.partition_id} (holds {s.max_transaction_id}, session recovered to "
            f"{s.low_water_mark})"
            for s in partition_states(node)
            if s.max_transaction_id < s.low_water_mark
        ]
        if behind:
            return Check(False, "behind its store session: " + ", ".join(behind))
        return Check(True, "every hosted partition holds its session's recovered records")

    def status() -> dict[str, Any]:
        usage = None if data_dir is None else disk_usage(data_dir)
        return {
            "role": "storage",
            "version": __version__,
            "feature_level": node.engine.feature_level,
            "max_feature_level": node.engine.max_feature_level,
            "endpoint": node.endpoint,
            "serving": node.serving,
            "disk": None
            if usage is None
            else {"used": usage.used_bytes, "free": usage.free_bytes, "size": usage.size_bytes},
            "partitions": [
                {
                    "partition": s.partition_id,
                    "max_transaction_id": s.max_transaction_id,
                    "low_water_mark": s.low_water_mark,
                    "available": s.available,
                }
                for s in partition_states(node)
            ],
        }

    return HttpEndpoint(
        metrics.registry,
        host=section.host,
        port=section.port,
        checks={"transport": transport, "partitions": partitions, "caught_up": caught_up},
        json_routes={"/status": status},
    )
