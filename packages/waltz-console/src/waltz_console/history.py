"""The recent past the console draws as charts: the cluster's and each partition's commit
rate, commit latency p50/p99, replica lag and feed lag, one point every ``step``
seconds for the last ``points`` of them. Pure: the collector records each refresh's
snapshot with the time; :func:`chart` turns a series into the geometry of an SVG line
chart (the page only creates the elements, as text: it draws nothing itself and loads
no charting library).

Memory: five float arrays of ``points`` values a partition (about 5 KiB at the
default 120 points; 5 MiB for 1,000 partitions).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from waltz_api.errors import ConfigError
from waltz_console.views import Snapshot

STEP = 5.0
"""Seconds between two points."""
POINTS = 120
"""Points kept (10 minutes at the default step)."""
FIELDS = ("commit_rate", "commit_p50_ms", "commit_p99_ms", "replica_lag", "feed_lag")
WIDTH, HEIGHT = 300.0, 90.0
"""The charts' coordinates (the SVG view box; the page scales it)."""
PAD = 4.0
"""Room above the highest value and below the lowest (a line at 0 or at the top stays
visible)."""
SHORTEST_SPAN = 60.0
"""The charts of a console that started a moment ago cover this much (then up to
``step * points`` seconds: the console knows nothing from before it started)."""
CHARTS: tuple[tuple[str, str, str, tuple[tuple[str, str], ...], str], ...] = (
    ("commit-rate", "Commit rate", "tx/s", (("commit_rate", "rate"),),
     "Not known: the owner's status gives it."),
    ("commit-latency", "Commit latency", "ms", (("commit_p50_ms", "p50"), ("commit_p99_ms", "p99")),
     "No commit in these minutes (or the server's /metrics is not read)."),
    ("replica-lag", "Replica lag (most behind)", "tx", (("replica_lag", "lag"),),
     "Not known: the owner's status gives it."),
    ("feed-lag", "Feed lag (client most behind)", "tx", (("feed_lag", "lag"),),
     "No client was connected in these minutes."),
)  # fmt: skip
"""Each chart: its key, title, unit, lines (a field and its name) and what it says
when it has nothing to draw."""


class Series:
    """Points of :data:`FIELDS` at times (NaN: not known then), the newest last."""

    __slots__ = ("capacity", "columns", "times")

    def __init__(self, capacity: int = POINTS) -> None:
        self.capacity = capacity
        self.times = array("d")
        self.columns = {name: array("d") for name in FIELDS}

    def add(self, at: float, values: Mapping[str, float | None]) -> None:
        self.times.append(at)
        for name, column in self.columns.items():
            value = values.get(name)
            column.append(math.nan if value is None else float(value))
        if len(self.times) > self.capacity:
            del self.times[0]
            for column in self.columns.values():
                del column[0]


def _largest(values: Iterable[Any]) -> float | None:
    found = [v for v in values if v is not None]
    return max(found) if found else None


def partition_values(
    row: Mapping[str, Any], clients: Sequence[Mapping[str, Any]]
) -> dict[str, float | None]:
    """One partition's point from its snapshot row and its clients."""
    return {
        "commit_rate": row["commit_rate"],
        "commit_p50_ms": row["commit_p50_ms"],
        "commit_p99_ms": row["commit_p99_ms"],
        "replica_lag": _largest(r["lag"] for r in row["replicas"]),
        "feed_lag": _largest(c["lag"] for c in clients),
    }


class History:
    """The cluster's series and each partition's, recorded from snapshots."""

    def __init__(self, step: float = STEP, points: int = POINTS) -> None:
        if step <= 0 or points < 2:
            raise ConfigError(
                f"a chart needs a step above 0 and 2 points or more, got {step}, {points}"
            )
        self.step = step
        self.points = points
        self.cluster = Series(points)
        self.partitions: dict[int, Series] = {}
        self._last: float | None = None

    def record(self, at: float, snapshot: Snapshot) -> bool:
        """Add a point for the cluster and each partition when ``step`` seconds passed
        since the last one (``at``: the wall clock); whether it did."""
        if snapshot.cluster.get("cluster_key") is None:
            return False
        if self._last is not None and at - self._last < self.step:
            return False
        self._last = at
        clients: dict[int, list[dict[str, Any]]] = {}
        for client in snapshot.clients:
            clients.setdefault(client["partition"], []).append(client)
        values = {}
        for row in snapshot.partitions:
            pid = row["partition"]
            values[pid] = partition_values(row, clients.get(pid, []))
            series = self.partitions.get(pid)
            if series is None:
                series = self.partitions[pid] = Series(self.points)
            series.add(at, values[pid])
        for pid in [p for p in self.partitions if p not in values]:
            del self.partitions[pid]
        cluster = snapshot.cluster
        self.cluster.add(
            at,
            {
                "commit_rate": cluster["commit_rate"],
                "commit_p50_ms": cluster.get("commit_p50_ms"),
                "commit_p99_ms": cluster.get("commit_p99_ms"),
                "replica_lag": _largest(v["replica_lag"] for v in values.values()),
                "feed_lag": _largest(v["feed_lag"] for v in values.values()),
            },
        )
        return True

    def charts(self, partition: int | None, now: float) -> list[dict[str, Any]]:
        """The four charts of the cluster (``partition`` None) or of a partition."""
        series = self.cluster if partition is None else self.partitions.get(partition)
        known = now - self.cluster.times[0] if self.cluster.times else 0.0
        span = min(self.step * self.points, max(SHORTEST_SPAN, known))
        drawn = []
        for key, title, unit, lines, empty in CHARTS:
            found = chart(key, title, unit, series, lines, now=now, span=span)
            found["empty"] = empty
            drawn.append(found)
        return drawn


def _nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5 or 5 times a power of ten at or above ``value``."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for factor in (1.0, 2.0, 2.5, 5.0, 10.0):
        if value <= factor * power * (1 + 1e-9):
            return factor * power
    return 10.0 * power


def _number(value: float) -> str:
    return f"{value:g}" if abs(value) < 1e6 else f"{value:.3g}"


def chart(
    key: str,
    title: str,
    unit: str,
    series: Series | None,
    lines: Sequence[tuple[str, str]],
    *,
    now: float,
    span: float,
) -> dict[str, Any]:
    """The geometry of one line chart over the ``span`` seconds before ``now``: for each
    line its ``segments`` (SVG ``points`` strings in a WIDTH x HEIGHT box, split where
    a value is not known), its ``last`` value, and the scale's ``y_max``; ``points``:
    how many known values the chart draws."""
    drawn: list[dict[str, Any]] = []
    known: list[float] = []
    columns: list[tuple[str, str, list[tuple[float, float]]]] = []
    for field, name in lines:
        values: list[tuple[float, float]] = []
        if series is not None:
            for at, value in zip(series.times, series.columns[field], strict=True):
                if now - at <= span and not math.isnan(value):
                    values.append((at, value))
                elif now - at <= span:
                    values.append((at, math.nan))
        known += [v for _, v in values if not math.isnan(v)]
        columns.append((field, name, values))
    y_max = _nice_ceiling(max(known, default=0.0))
    for _field, name, values in columns:
        segments: list[str] = []
        current: list[str] = []
        for at, value in values:
            if math.isnan(value):
                if current:
                    segments.append(" ".join(current))
                current = []
                continue
            x = WIDTH * (1.0 - (now - at) / span)
            y = PAD + (HEIGHT - 2 * PAD) * (1.0 - value / y_max)
            current.append(f"{x:.1f},{y:.1f}")
        if current:
            segments.append(" ".join(current))
        last = next((v for _, v in reversed(values) if not math.isnan(v)), None)
        drawn.append({"name": name, "segments": segments, "last": last})
    return {
        "key": key,
        "title": title,
        "unit": unit,
        "width": WIDTH,
        "height": HEIGHT,
        "y_max": y_max,
        "y_label": f"{_number(y_max)} {unit}",
        "span": span,
        "x_label": f"{span / 60:.0f} min ago" if span >= 90 else f"{span:.0f} s ago",
        "points": len(known),
        "lines": drawn,
    }
