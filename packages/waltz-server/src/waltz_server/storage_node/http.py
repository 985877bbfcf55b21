"""The storage node's health and metrics endpoint (config section ``[http]``).

``/metrics`` serves the node's :class:`~waltz_server.observability.StorageNodeMetrics`
(appended records and bytes, engine appends, fsync latency, fenced requests
and sessions, process memory and CPU); ``/health`` checks that the node
serves its transport endpoint and that no hosted partition is marked
unavailable.
"""

from __future__ import annotations

from waltz_server.observability import Check, HttpEndpoint, StorageNodeMetrics
from waltz_server.storage_node.config import HttpSection
from waltz_server.storage_node.node import StorageNode


def metrics_for(section: HttpSection) -> StorageNodeMetrics | None:
    """The node's metrics when the endpoint is enabled (no cost otherwise)."""
    return StorageNodeMetrics() if section.enabled else None


def storage_node_endpoint(section: HttpSection, node: StorageNode) -> HttpEndpoint:
    """An (unstarted) endpoint serving ``node``'s metrics and health checks."""
    metrics = node.metrics if node.metrics is not None else StorageNodeMetrics()
    node.metrics = metrics

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

    return HttpEndpoint(
        metrics.registry,
        host=section.host,
        port=section.port,
        checks={"transport": transport, "partitions": partitions},
    )
