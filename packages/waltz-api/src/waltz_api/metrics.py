"""Prometheus metrics shared by every Waltz process that exports them (a server, a
storage node): one registry of its own per process (:func:`new_registry`, never the
global one, so several servers or storage nodes can run in one process, as tests do),
the latency buckets, gauges computed when scraped (:class:`ScrapeCollector`) and the
``kind`` labels of the error counters.

Needs ``prometheus-client`` (``pip install 'waltz-api[metrics]'``; waltz-server and
waltz-storage-node depend on it). The products' own families are in
``waltz_server.observability`` (ServerMetrics) and ``waltz_storage_node.metrics``
(StorageNodeMetrics); the HTTP endpoint serving them is :mod:`waltz_api.http_endpoint`.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata

from prometheus_client import CollectorRegistry, Gauge, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from waltz_api.messages import ErrorCode

log = logging.getLogger(__name__)

__all__ = [
    "ERROR_KINDS",
    "LATENCY_BUCKETS",
    "ScrapeCollector",
    "families",
    "new_registry",
    "sample_values",
    "waltz_version",
]

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
)
"""Seconds: from a fast fsync (half a millisecond) to a stalled disk."""


# Counters expose `_total` only: the `_created` twin of every series (a timestamp
# per label set) doubles what a scrape stores and no dashboard here uses it.
disable_created_metrics()  # type: ignore[no-untyped-call]


def waltz_version(distribution: str = "waltz-api") -> str:
    """The installed version of ``distribution`` (every Waltz distribution has the same
    one; ``unknown`` when not installed as a package)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def new_registry(
    *, process_metrics: bool = True, role: str = "", distribution: str = "waltz-api"
) -> CollectorRegistry:
    """A registry of its own, with the process collector (memory, CPU, open files) and
    ``waltz_build_info`` (1, labelled with the version of ``distribution``, Python and
    the process's role)."""
    registry = CollectorRegistry(auto_describe=True)
    if process_metrics:
        ProcessCollector(registry=registry)
    Gauge(
        "waltz_build_info",
        "Always 1; the labels say which Waltz runs (version, Python, role)",
        ["version", "python_version", "role"],
        registry=registry,
    ).labels(waltz_version(distribution), platform.python_version(), role).set(1)
    return registry


class ScrapeCollector(Collector):
    """Gauges computed when the registry is scraped, by ``collect_fn``.

    ``collect_fn`` returns ``(name, help, labels, samples)`` tuples, ``samples``
    being ``(label values, value)`` pairs. A failing callback is logged and
    yields nothing (a scrape never fails because of it)."""

    def __init__(
        self,
        describe: Iterable[tuple[str, str, tuple[str, ...]]],
        collect_fn: Callable[[], Iterable[tuple[str, Iterable[tuple[tuple[str, ...], float]]]]],
    ) -> None:
        self._families = {name: (help_text, labels) for name, help_text, labels in describe}
        self._collect_fn = collect_fn

    def describe(self) -> Iterator[Metric]:
        for name, (help_text, labels) in self._families.items():
            yield GaugeMetricFamily(name, help_text, labels=list(labels))

    def collect(self) -> Iterator[Metric]:
        families = {
            name: GaugeMetricFamily(name, help_text, labels=list(labels))
            for name, (help_text, labels) in self._families.items()
        }
        try:
            for name, samples in self._collect_fn():
                family = families[name]
                for label_values, value in samples:
                    family.add_metric(list(label_values), value)
        except Exception:
            log.exception("computing metrics for a scrape failed")
        yield from families.values()


# -- counters at zero -----------------------------------------------------------------------------
# A labelled counter has no series until its first event: a dashboard's rate() and an
# alert's increase() of it read "No data" until then (and an alert cannot see the first
# event, the increase from nothing). So every counter labelled by partition or kind is
# made at zero for its known labels: the kinds at start, a partition's once it is served
# (server) or hosted (storage node).

ERROR_KINDS = tuple(code.name.lower() for code in ErrorCode)
"""The ``kind`` labels of the error counters: every error code (an answer's)."""


def families(registry: CollectorRegistry) -> dict[str, str]:
    """Every ``waltz_*`` metric family of ``registry`` with its type (``counter`` names
    with their ``_total``), for docs, dashboards and alert rules."""
    found: dict[str, str] = {}
    for family in registry.collect():
        if family.name.startswith("waltz_"):
            suffix = "_total" if family.type == "counter" else ""
            found[family.name + suffix] = family.type
    return found


def sample_values(exposition: str, name: str, **labels: str) -> list[float]:
    """The values of the samples called ``name`` with these labels in a Prometheus text
    exposition (what ``/metrics`` serves): none when absent. For tests and scripts that
    read a process's metrics."""
    return [
        float(sample.value)
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]
