"""The report: outages from the acknowledgements, the longest outage per fault kind,
and the text and HTML pages (self-contained: nothing fetched)."""

from __future__ import annotations

import re

from waltz_chaos.cluster import ProcessEvent
from waltz_chaos.nemesis import FaultRecord
from waltz_chaos.report import analyse, html_report, json_report, outages, text_report
from waltz_chaos.schedule import Fault
from waltz_sim.checker import INVOKE, OK, OpEvent, Violation

START = 1000.0


def ops_every(
    step: float, until: float, partition: int, skip: tuple[float, float]
) -> list[OpEvent]:
    events = []
    t = 0.0
    n = 0
    while t < until:
        if not skip[0] <= t < skip[1]:
            n += 1
            op = f"c{partition}:{n}"
            events.append(OpEvent(INVOKE, op, "c", START + t - 0.1, partition))
            events.append(OpEvent(OK, op, "c", START + t, partition, n))
        t += step
    return events


def summary(  # type: ignore[no-untyped-def]
    violations: list[tuple[str, Violation]] | None = None, notes: list[str] | None = None
):
    kill = FaultRecord(Fault(10.0, "kill", 5.0, ("server-0",)), START + 10.0, START + 15.0)
    cut = FaultRecord(
        Fault(30.0, "partition", 2.0, links=(("client-0", "server-1"), ("server-1", "client-0"))),
        START + 30.0,
        START + 32.0,
        "partition: client-0<->server-1 cut",
    )
    skipped = FaultRecord(Fault(40.0, "disk_full", 2.0, ("storage-0",)), notes=["not injected: x"])
    ops = ops_every(0.25, 60.0, 0, (11.0, 17.0)) + ops_every(0.25, 60.0, 1, (0.0, 0.0))
    return analyse(
        title="waltz chaos seed 9",
        settings={"seed": 9},
        network="loopback",
        records=[kill, cut, skipped],
        ops=ops,
        committed={0: 200, 1: 240},
        violations=violations or [],
        events=[
            ProcessEvent(
                START + 20.0, "server-1", "exit", 2, "exit code 1; its log ends with:\nboom"
            )
        ],
        partitions={0: "bank", 1: "register"},
        start=START,
        duration=60.0,
        final_heal=START + 32.0,
        submissions_end=START + 60.0,
        replay="waltz chaos --seed 9",
        notes=notes or [],
    )


def test_outages_are_the_long_silences_of_each_partition() -> None:
    found = outages({0: [1.0, 2.0, 6.5, 7.0], 1: [0.5, 1.0]}, end=8.0, gap=2.0)
    assert [(o.partition, o.start, o.end) for o in found] == [(0, 2.0, 6.5), (1, 1.0, 8.0)]


def test_the_longest_outage_is_charged_to_the_faults_it_overlaps() -> None:
    s = summary()
    assert [(o.partition, round(o.start, 2), round(o.end, 2)) for o in s.outages] == [
        (0, 10.75, 17.0)
    ]
    longest = s.longest_outage_by_kind()
    assert round(longest["kill"][0], 2) == 6.25
    assert longest["partition"][0] == 0.0
    assert s.faults_by_kind() == {"kill": 1, "partition": 1}  # the skipped one is not counted
    assert s.acknowledgements == s.ops["ok"]
    assert 0.9 < s.availability() < 1.0


def test_the_text_report_tells_the_verdict_the_faults_and_the_exits() -> None:
    text = text_report(summary())
    assert text.startswith("waltz chaos seed 9: OK: no violation")
    assert "faults: 2" in text
    assert "server-1#2: exit code 1" in text
    assert "(not injected)" in text
    bad = text_report(
        summary([("bank", Violation("duplicate", "op c:1 committed 2 times", 3.0, 0, 7, "c:1"))])
    )
    assert "FAILED: 1 violations" in bad
    assert "[bank] [duplicate] op c:1 committed 2 times (partition 0, transaction 7, op c:1)" in bad
    # a replica that could not be read is told beside the violations, before the
    # timeline (the console prints the report up to it)
    unread = "replica storage-0 of partition 2: could not be read: CorruptionError: x"
    told = text_report(summary(notes=[unread]))
    assert 0 <= told.index(f"note: {unread}") < told.index("timeline")


def test_the_html_page_is_self_contained_and_shows_the_plot() -> None:
    page = html_report(summary([("bank", Violation("lock-safety", "x <b>", 3.0, 0, 7, "c:1"))]))
    assert page.startswith("<!DOCTYPE html>")
    assert "<svg" in page and "</svg>" in page
    assert "<polyline" in page  # the commits
    assert page.count('fill="#d62728" fill-opacity="0.13"') == 1  # the outage
    assert "kill: server-0" in page
    assert "x &lt;b&gt;" in page  # escaped
    urls = re.findall(r"(?:src|href)=\"([^\"]+)\"", page) + re.findall(r"url\(", page)
    assert urls == []
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert '"ok": false' in json_report(summary([("bank", Violation("x", "y"))]))
