"""The charts' history and geometry: pure."""

from __future__ import annotations

import math
from typing import Any

import pytest

from waltz_console.history import HEIGHT, PAD, WIDTH, History, Series, chart
from waltz_console.views import Snapshot


def _snapshot(rate: float, p99: float | None, lag: int | None, feed: int | None) -> Snapshot:
    row: dict[str, Any] = {
        "partition": 0,
        "commit_rate": rate,
        "commit_p50_ms": None if p99 is None else p99 / 2,
        "commit_p99_ms": p99,
        "replicas": [{"node": "n1", "lag": lag}, {"node": "n2", "lag": 0 if lag else None}],
    }
    clients = [] if feed is None else [{"partition": 0, "client": "c", "lag": feed}]
    cluster = {
        "cluster_key": "k",
        "commit_rate": rate,
        "commit_p50_ms": row["commit_p50_ms"],
        "commit_p99_ms": p99,
    }
    return Snapshot(cluster, [], [], [row], clients)


def test_a_point_every_step_for_the_cluster_and_each_partition() -> None:
    history = History(step=5.0, points=4)
    assert history.record(100.0, _snapshot(10.0, 4.0, 3, 7))
    assert not history.record(103.0, _snapshot(99.0, 4.0, 3, 7))  # within the step
    for at in (105.0, 110.0, 115.0, 120.0):
        assert history.record(at, _snapshot(at - 100.0, None, None, 2))
    # 4 points kept: the oldest went
    assert list(history.cluster.times) == [105.0, 110.0, 115.0, 120.0]
    assert list(history.partitions[0].columns["commit_rate"]) == [5.0, 10.0, 15.0, 20.0]
    assert math.isnan(history.partitions[0].columns["commit_p99_ms"][-1])
    assert list(history.cluster.columns["feed_lag"]) == [2.0] * 4
    # no cluster read yet: nothing recorded
    empty = Snapshot({"cluster_key": None}, [], [], [], [])
    assert not History().record(0.0, empty)


def test_the_chart_geometry() -> None:
    series = Series(10)
    for at, p50, p99 in ((40.0, 1.0, 3.0), (45.0, None, None), (50.0, 2.0, 7.5), (55.0, 2.0, 6.0)):
        series.add(at, {"commit_p50_ms": p50, "commit_p99_ms": p99})
    series.add(0.0 + 1, {"commit_p50_ms": 9.0})  # out of the span: not drawn
    drawn = chart(
        "latency", "Commit latency", "ms", series,
        [("commit_p50_ms", "p50"), ("commit_p99_ms", "p99")], now=60.0, span=30.0,
    )  # fmt: skip
    assert drawn["y_max"] == 10.0 and drawn["y_label"] == "10 ms"
    assert drawn["points"] == 6
    p50, p99 = drawn["lines"]
    assert p50["last"] == 2.0 and p99["last"] == 6.0
    # split where the value is not known: one lone point, then a line of two
    assert p99["segments"] == [
        f"{WIDTH * (1 - 20 / 30):.1f},{PAD + (HEIGHT - 2 * PAD) * 0.7:.1f}",
        f"{WIDTH * (1 - 10 / 30):.1f},{PAD + (HEIGHT - 2 * PAD) * 0.25:.1f} "
        f"{WIDTH * (1 - 5 / 30):.1f},{PAD + (HEIGHT - 2 * PAD) * 0.4:.1f}",
    ]
    nothing = chart("rate", "Commit rate", "tx/s", None, [("commit_rate", "rate")], now=1, span=1)
    assert nothing["points"] == 0 and nothing["lines"][0] == {
        "name": "rate",
        "segments": [],
        "last": None,
    }


@pytest.mark.parametrize(
    ("largest", "scale"), [(0.0, 1.0), (0.3, 0.5), (7.5, 10.0), (1200.0, 2000.0), (2.0, 2.0)]
)
def test_the_scale_is_a_round_number(largest: float, scale: float) -> None:
    series = Series()
    series.add(10.0, {"commit_rate": largest})
    assert chart("r", "r", "", series, [("commit_rate", "r")], now=10, span=60)["y_max"] == scale


def test_the_charts_cover_what_the_console_knows() -> None:
    """A console that started a minute ago draws that minute (at least), not a line in
    the last tenth of a 10-minute chart; then up to 10 minutes."""
    history = History(step=5.0, points=120)
    for at in range(0, 601, 5):
        history.record(1000.0 + at, _snapshot(1.0, 2.0, 0, 0))
        if at == 30:
            early = history.charts(None, 1030.0)[0]
            assert (early["span"], early["x_label"]) == (60.0, "60 s ago")
        if at == 200:
            middle = history.charts(None, 1200.0)[0]
            assert (middle["span"], middle["x_label"]) == (200.0, "3 min ago")
            # the first point at the left edge
            assert middle["lines"][0]["segments"][0].startswith("0.0,")
    late = history.charts(None, 1600.0)[0]
    assert (late["span"], late["x_label"]) == (595.0, "10 min ago")  # 120 points kept
