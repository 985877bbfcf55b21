"""The run's report: what was done, what the cluster did, and what the checker found.

:func:`analyse` turns the fault records, the clients' acknowledgements and the
checker's verdicts into a :class:`Summary`: faults by kind, ops by outcome,
acknowledgements, commits per second, the *outages* (a partition without a commit for
more than :data:`OUTAGE_GAP` seconds while its clients submitted), and per fault kind
the longest outage that overlapped a fault of that kind. :func:`text_report` and
:func:`html_report` render it; the HTML page is self-contained (inline SVG and CSS,
no script, nothing fetched): the commits over time with the outages shaded and the
faults drawn below them, one lane per kind, and every table of the text report.
"""

from __future__ import annotations

import html
import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from waltz_chaos.cluster import ProcessEvent
from waltz_chaos.nemesis import FaultRecord
from waltz_chaos.schedule import STORAGE_FAULTS
from waltz_sim.checker import OK, OpEvent, Violation

OUTAGE_GAP = 2.0
"""Seconds without a commit on a partition that count as an outage."""


@dataclass(frozen=True)
class Outage:
    partition: int
    start: float
    end: float
    """Seconds since the workload started."""

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class FaultLine:
    kind: str
    description: str
    start: float
    end: float | None
    notes: tuple[str, ...] = ()


@dataclass
class Summary:
    """Everything the reports show (times in seconds since the workload started)."""

    title: str
    settings: dict[str, Any]
    network: str
    faults: list[FaultLine]
    ops: dict[str, int]
    acknowledgements: int
    commits: dict[int, int]
    violations: list[tuple[str, Violation]]
    """(workload, violation)."""
    exits: list[ProcessEvent]
    outages: list[Outage]
    partitions: dict[int, str]
    """partition -> workload."""
    commit_times: dict[int, list[float]]
    duration: float
    final_heal: float
    submissions_end: float
    replay: str
    notes: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.violations

    def faults_by_kind(self) -> dict[str, int]:
        return dict(sorted(Counter(f.kind for f in self.faults if f.end is not None).items()))

    def longest_outage_by_kind(self) -> dict[str, tuple[float, str]]:
        """kind -> (the longest outage overlapping a fault of that kind, that fault)."""
        result: dict[str, tuple[float, str]] = {}
        for fault in self.faults:
            if fault.end is None:
                continue
            longest = max(
                (o.length for o in self.outages if o.start < fault.end and o.end > fault.start),
                default=0.0,
            )
            if fault.kind not in result or longest > result[fault.kind][0]:
                result[fault.kind] = (longest, fault.description)
        return dict(sorted(result.items()))

    def availability(self) -> float:
        span = max(self.submissions_end, 1e-9) * max(len(self.partitions), 1)
        down = sum(o.length for o in self.outages)
        return max(0.0, 1.0 - down / span)

    def first_commit_after_heal(self) -> float | None:
        """Seconds from the final heal to the first commit after it, on every partition."""
        waits = []
        for times in self.commit_times.values():
            after = [t for t in times if t >= self.final_heal]
            if not after:
                return None
            waits.append(after[0] - self.final_heal)
        return max(waits, default=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "ok": self.ok,
            "settings": self.settings,
            "network": self.network,
            "duration": self.duration,
            "wall_seconds": round(self.wall_seconds, 1),
            "faults": len([f for f in self.faults if f.end is not None]),
            "faults_by_kind": self.faults_by_kind(),
            "ops": self.ops,
            "acknowledgements": self.acknowledgements,
            "commits": sum(self.commits.values()),
            "violations": [
                {"workload": w, "invariant": v.invariant, "text": str(v)}
                for w, v in self.violations
            ],
            "unexpected_exits": [
                {"time": round(e.time, 3), "member": e.member, "detail": e.detail}
                for e in self.exits
            ],
            "outages": len(self.outages),
            "longest_outage_by_kind": {
                k: round(v[0], 2) for k, v in self.longest_outage_by_kind().items()
            },
            "availability": round(self.availability(), 4),
            "first_commit_after_heal": self.first_commit_after_heal(),
            "storage_faults": [
                {
                    "fault": f.description,
                    "injected": round(f.start, 2),
                    "healed": None if f.end is None else round(f.end, 2),
                    "notes": list(f.notes),
                }
                for f in self.faults
                if f.kind in STORAGE_FAULTS
            ],
            "replay": self.replay,
            "notes": self.notes,
        }


def outages(
    commit_times: dict[int, list[float]], end: float, gap: float = OUTAGE_GAP
) -> list[Outage]:
    """Per partition, the stretches longer than ``gap`` without a commit in [0, end]."""
    found: list[Outage] = []
    for partition, times in sorted(commit_times.items()):
        previous = 0.0
        for t in [*sorted(times), end]:
            if t - previous > gap:
                found.append(Outage(partition, previous, min(t, end)))
            previous = max(previous, t)
    return found


def analyse(
    *,
    title: str,
    settings: dict[str, Any],
    network: str,
    records: Sequence[FaultRecord],
    ops: Iterable[OpEvent],
    committed: dict[int, int],
    violations: list[tuple[str, Violation]],
    events: Iterable[ProcessEvent],
    partitions: dict[int, str],
    start: float,
    duration: float,
    final_heal: float,
    submissions_end: float,
    replay: str,
    notes: list[str],
) -> Summary:
    ops = list(ops)
    outcomes = Counter(op.kind for op in ops if op.kind != "invoke")
    invoked = {op.op_id for op in ops if op.kind == "invoke"}
    ended = {op.op_id for op in ops if op.kind != "invoke"}
    if invoked - ended:
        outcomes["pending"] = len(invoked - ended)
    commit_times: dict[int, list[float]] = {p: [] for p in partitions}
    for op in ops:
        if op.kind == OK:
            commit_times.setdefault(op.partition, []).append(op.time - start)
    lines = [
        FaultLine(
            r.kind,
            r.description,
            r.injected_at - start if r.injected_at is not None else r.fault.at,
            None if r.healed_at is None else r.healed_at - start,
            tuple(r.notes),
        )
        for r in records
    ]
    end = submissions_end - start
    return Summary(
        title=title,
        settings=settings,
        network=network,
        faults=lines,
        ops=dict(sorted(outcomes.items())),
        acknowledgements=outcomes.get(OK, 0),
        commits=committed,
        violations=violations,
        exits=[
            ProcessEvent(e.time - start, e.member, e.what, e.incarnation, e.detail)
            for e in events
            if e.what == "exit"
        ],
        outages=outages(commit_times, end),
        partitions=partitions,
        commit_times=commit_times,
        duration=duration,
        final_heal=final_heal - start,
        submissions_end=end,
        replay=replay,
        notes=notes,
    )


# -- text -----------------------------------------------------------------------------------------


def text_report(summary: Summary) -> str:
    s = summary
    out: list[str] = []
    verdict = "OK: no violation" if s.ok else f"FAILED: {len(s.violations)} violations"
    out.append(f"{s.title}: {verdict}")
    out.append(f"  network: {s.network}")
    out.append(f"  replay: {s.replay}")
    out.append("")
    total = len([f for f in s.faults if f.end is not None])
    out.append(f"faults: {total}")
    for kind, count in s.faults_by_kind().items():
        out.append(f"  {kind:26} {count}")
    out.append("")
    out.append(
        f"ops: {sum(s.ops.values())} ({', '.join(f'{k} {v}' for k, v in s.ops.items())}); "
        f"acknowledgements {s.acknowledgements}; commits {sum(s.commits.values())} "
        f"({', '.join(f'p{p} {n}' for p, n in sorted(s.commits.items()))})"
    )
    after = s.first_commit_after_heal()
    out.append(
        f"availability {s.availability():.1%} of partition-time; {len(s.outages)} outages "
        f"(no commit for more than {OUTAGE_GAP:.0f} s); commits resumed on every partition "
        + ("never" if after is None else f"{after:.1f} s")
        + " after the final heal"
    )
    out.append("longest outage by fault kind (s):")
    for kind, (length, description) in s.longest_outage_by_kind().items():
        out.append(f"  {kind:26} {length:6.1f}   {description}")
    out.append("")
    if s.exits:
        out.append(f"processes that exited on their own: {len(s.exits)}")
        for event in s.exits:
            first = event.detail.splitlines()[0] if event.detail else ""
            out.append(f"  {event.time:7.1f}s {event.member}#{event.incarnation}: {first}")
        out.append("")
    if s.violations:
        out.append("violations:")
        for workload, violation in s.violations:
            when = "" if violation.time is None else f"{violation.time:7.1f}s "
            out.append(f"  {when}[{workload}] {violation}")
        out.append("")
    if s.notes:  # before the timeline: the console prints the report up to it
        out.extend(f"note: {note}" for note in s.notes)
        out.append("")
    out.append("timeline (seconds since the workload started):")
    for fault in sorted(s.faults, key=lambda f: f.start):
        end = "(not injected)" if fault.end is None else f"-> {fault.end:7.1f}"
        notes = f"  [{'; '.join(fault.notes)}]" if fault.notes else ""
        out.append(f"  {fault.start:7.1f} {end}  {fault.description}{notes}")
    out.append("")
    out.append("outages:")
    for outage in s.outages:
        out.append(
            f"  partition {outage.partition} ({s.partitions.get(outage.partition, '?')}): "
            f"{outage.start:.1f} -> {outage.end:.1f} ({outage.length:.1f} s)"
        )
    return "\n".join(out) + "\n"


# -- HTML -----------------------------------------------------------------------------------------

_COLOURS = {
    "kill": "#d62728",
    "storage_majority_down": "#8c1010",
    "servers_down": "#8c1010",
    "pause": "#ff7f0e",
    "storage_majority_paused": "#a65000",
    "coordination_restart": "#9467bd",
    "long_coordination_outage": "#5b3a85",
    "session_expiry": "#c5b0d5",
    "disk_full": "#8c564b",
    "partition": "#1f77b4",
    "one_way": "#17becf",
    "isolate": "#0b3d66",
    "storage_cut_off": "#0b3d66",
    "slow_link": "#bcbd22",
    "lossy_link": "#2ca02c",
    "corrupt_segment": "#e377c2",
    "truncate_segment": "#b5478f",
    "rollback_data": "#7b4173",
    "wipe_data": "#4a1a45",
    "flip_sealed": "#f7b6d2",
}
_WORKLOAD_COLOURS = ["#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"]


def _lanes(s: Summary) -> list[tuple[str, list[FaultLine]]]:
    """One lane per fault kind, split into rows where its faults overlap."""
    lanes: list[tuple[str, list[FaultLine]]] = []
    for kind in s.faults_by_kind():
        rows: list[list[FaultLine]] = []
        for fault in sorted(
            (f for f in s.faults if f.kind == kind and f.end is not None), key=lambda f: f.start
        ):
            for row in rows:
                last = row[-1]
                if last.end is not None and last.end <= fault.start:
                    row.append(fault)
                    break
            else:
                rows.append([fault])
        lanes += [(kind if i == 0 else "", row) for i, row in enumerate(rows)]
    return lanes


def _label(fault: FaultLine) -> str:
    """The fault's targets, short (``storage-1`` -> ``s1``)."""
    text = fault.description.split(": ", 1)[-1].split(" (")[0]
    for long, short in (
        ("storage-", "s"),
        ("server-", "v"),
        ("client-", "c"),
        ("coordination", "coord"),
    ):
        text = text.replace(long, short)
    return text


def _plot(s: Summary) -> str:
    width, left, right = 1100, 170, 20
    top, plot_h = 20, 220
    lanes = _lanes(s) or [("(no faults)", [])]
    lane_h = 16
    lanes_top = top + plot_h + 44
    height = lanes_top + lane_h * len(lanes) + 20
    span = max(s.submissions_end, s.duration, 1.0)

    def x(t: float) -> float:
        return left + (width - left - right) * max(0.0, min(t, span)) / span

    workloads = sorted(set(s.partitions.values()))
    seconds = math.ceil(span)
    series: dict[str, list[int]] = {w: [0] * (seconds + 1) for w in workloads}
    for partition, times in s.commit_times.items():
        workload = s.partitions.get(partition, "?")
        for t in times:
            if 0 <= t <= span and workload in series:
                series[workload][int(t)] += 1
    peak = max([1, *(max(v) for v in series.values())])
    y_max = max(5, math.ceil(peak / 5.0) * 5)

    def y(v: float) -> float:
        return top + plot_h - plot_h * v / y_max

    bottom = lanes_top + lane_h * len(lanes)
    parts: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="commits over time and faults" '
        'font-family="system-ui, sans-serif">',
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{plot_h}" '
        'fill="#fafafa" stroke="#ccc"/>',
    ]
    # outages, shaded, one band per partition
    partitions = sorted(s.partitions)
    band = plot_h / max(len(partitions), 1)
    for outage in s.outages:
        row = partitions.index(outage.partition) if outage.partition in partitions else 0
        parts.append(
            f'<rect x="{x(outage.start):.1f}" y="{top + row * band:.1f}" '
            f'width="{max(1.0, x(outage.end) - x(outage.start)):.1f}" height="{band:.1f}" '
            f'fill="#d62728" fill-opacity="0.13"><title>partition {outage.partition}: no commit '
            f"from {outage.start:.1f} to {outage.end:.1f} s ({outage.length:.1f} s)</title></rect>"
        )
    for row, partition in enumerate(partitions):
        parts.append(
            f'<text x="{left + 3}" y="{top + row * band + 11:.1f}" font-size="9" fill="#999">'
            f"p{partition}</text>"
        )
    # grid and axes
    step = _tick_step(span)
    t = 0.0
    while t <= span + 1e-9:
        parts.append(
            f'<line x1="{x(t):.1f}" y1="{top}" x2="{x(t):.1f}" y2="{bottom}" stroke="#e4e4e4"/>'
        )
        parts.append(
            f'<text x="{x(t):.1f}" y="{top + plot_h + 16}" font-size="11" text-anchor="middle">'
            f"{_clock(t)}</text>"
        )
        t += step
    for v in range(0, y_max + 1, max(1, y_max // 5)):
        parts.append(
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">{v}</text>'
        )
        parts.append(
            f'<line x1="{left}" y1="{y(v):.1f}" x2="{width - right}" y2="{y(v):.1f}" '
            'stroke="#eee"/>'
        )
    parts.append(
        f'<text x="{left - 40}" y="{top + plot_h / 2:.0f}" font-size="12" text-anchor="middle" '
        f'transform="rotate(-90 {left - 40} {top + plot_h / 2:.0f})">commits per second</text>'
    )
    # the commit series
    for index, workload in enumerate(workloads):
        colour = _WORKLOAD_COLOURS[index % len(_WORKLOAD_COLOURS)]
        points = " ".join(
            f"{x(sec):.1f},{y(v):.1f} {x(sec + 1):.1f},{y(v):.1f}"
            for sec, v in enumerate(series[workload])
        )
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="1.6">'
            f"<title>{html.escape(workload)}</title></polyline>"
        )
        parts.append(
            f'<rect x="{width - right - 110}" y="{top + 8 + 16 * index}" width="14" height="3" '
            f'fill="{colour}"/><text x="{width - right - 92}" y="{top + 13 + 16 * index}" '
            f'font-size="11">{html.escape(workload)}</text>'
        )
    # the final heal and the end of submissions
    for when, label in ((s.final_heal, "final heal"), (s.submissions_end, "submissions end")):
        parts.append(
            f'<line x1="{x(when):.1f}" y1="{top}" x2="{x(when):.1f}" y2="{bottom}" '
            f'stroke="#333" stroke-dasharray="4 3"><title>{label} at {when:.1f} s</title></line>'
        )
        parts.append(
            f'<text x="{x(when) - 3:.1f}" y="{top + plot_h + 30}" font-size="10" '
            f'text-anchor="end">{label}</text>'
        )
    # fault lanes
    parts.append(
        f'<text x="{left - 6}" y="{lanes_top - 8}" font-size="12" font-weight="bold" '
        'text-anchor="end">faults</text>'
    )
    for row, (kind, faults) in enumerate(lanes):
        ly = lanes_top + row * lane_h
        if kind:
            parts.append(
                f'<line x1="{left}" y1="{ly}" x2="{width - right}" y2="{ly}" stroke="#ddd"/>'
            )
            parts.append(
                f'<text x="{left - 6}" y="{ly + 12}" font-size="11" text-anchor="end">'
                f"{html.escape(kind)}</text>"
            )
        for fault in faults:
            assert fault.end is not None
            colour = _COLOURS.get(fault.kind, "#7f7f7f")
            x0, x1 = x(fault.start), x(fault.end)
            parts.append(
                f'<rect x="{x0:.1f}" y="{ly + 2}" width="{max(2.0, x1 - x0):.1f}" '
                f'height="{lane_h - 4}" rx="2" fill="{colour}" fill-opacity="0.85">'
                f"<title>{html.escape(fault.description)}: {fault.start:.1f} to "
                f"{fault.end:.1f} s</title></rect>"
            )
            label = _label(fault)
            if (x1 - x0) > 6.0 * len(label) + 4:
                parts.append(
                    f'<text x="{x0 + 3:.1f}" y="{ly + 11}" font-size="9" fill="#fff">'
                    f"{html.escape(label)}</text>"
                )
    parts.append("</svg>")
    return "\n".join(parts)


def _tick_step(span: float) -> float:
    for step in (5, 10, 15, 30, 60, 120, 300, 600, 900, 1800):
        if span / step <= 14:
            return float(step)
    return 3600.0


def _clock(t: float) -> str:
    whole = round(t)
    return f"{whole // 60}:{whole % 60:02d}" if whole >= 60 else f"{whole}s"


def _table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], numeric: Sequence[int] = ()
) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="{"num" if i in numeric else ""}">{html.escape(str(c))}</td>'
            for i, c in enumerate(row)
        )
        body.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


_CSS = """
body {
  font-family: system-ui, -apple-system, "Segoe UI", sans-serif;
  margin: 24px;
  color: #222;
  max-width: 1160px;
}
h1 {
  font-size: 22px;
  margin-bottom: 4px;
}
h2 {
  font-size: 17px;
  margin-top: 28px;
  border-bottom: 1px solid #ddd;
  padding-bottom: 3px;
}
.verdict {
  font-size: 18px;
  font-weight: bold;
  padding: 8px 12px;
  border-radius: 4px;
  display: inline-block;
}
.ok {
  background: #e6f4ea;
  color: #1e6b34;
}
.bad {
  background: #fde7e9;
  color: #a4262c;
}
.facts {
  display: flex;
  flex-wrap: wrap;
  gap: 10px;
  margin: 12px 0;
}
.facts div {
  background: #f5f7fa;
  border: 1px solid #e1e5ea;
  border-radius: 4px;
  padding: 6px 12px;
}
.facts dt {
  font-size: 11px;
  color: #666;
}
.facts dd {
  margin: 0;
  font-size: 18px;
  font-weight: 600;
}
.hint {
  color: #555;
  font-size: 13px;
}
.plot {
  overflow-x: auto;
}
table {
  border-collapse: collapse;
  font-size: 13px;
  margin: 6px 0;
}
th, td {
  border: 1px solid #ddd;
  padding: 3px 8px;
  text-align: left;
  vertical-align: top;
}
th {
  background: #f3f3f3;
}
td.num {
  text-align: right;
  font-variant-numeric: tabular-nums;
}
"""


def html_report(summary: Summary) -> str:
    s = summary
    verdict = (
        '<p class="verdict ok">OK: no violation</p>'
        if s.ok
        else f'<p class="verdict bad">FAILED: {len(s.violations)} violations</p>'
    )
    after = s.first_commit_after_heal()
    facts = [
        ("faults", len([f for f in s.faults if f.end is not None])),
        ("ops", sum(s.ops.values())),
        ("acknowledgements", s.acknowledgements),
        ("commits", sum(s.commits.values())),
        ("violations", len(s.violations)),
        ("availability", f"{s.availability():.1%}"),
        ("commits resumed after the final heal", "never" if after is None else f"{after:.1f} s"),
        ("wall time", f"{s.wall_seconds:.0f} s"),
    ]
    sections = [
        verdict,
        '<dl class="facts">'
        + "".join(
            f"<div><dt>{html.escape(k)}</dt><dd>{html.escape(str(v))}</dd></div>" for k, v in facts
        )
        + "</dl>",
        "<h2>Commits over time, and the faults</h2>",
        '<p class="hint">Lines: commits per second acknowledged to the clients, per workload. '
        f"Shaded: a partition without a commit for more than {OUTAGE_GAP:.0f} s (one band per "
        "partition). Below: each fault from its injection to its heal (hover for details).</p>",
        f'<div class="plot">{_plot(s)}</div>',
    ]
    if s.violations:
        sections.append("<h2>Violations</h2>")
        sections.append(
            _table(
                ["time (s)", "workload", "invariant", "partition", "transaction", "op", "what"],
                (
                    (
                        "" if v.time is None else f"{v.time:.1f}",
                        w,
                        v.invariant,
                        "" if v.partition is None else v.partition,
                        "" if v.transaction_id is None else v.transaction_id,
                        v.op_id or "",
                        v.message,
                    )
                    for w, v in s.violations
                ),
                numeric=(0, 3, 4),
            )
        )
    if s.exits:
        sections.append("<h2>Processes that exited on their own</h2>")
        sections.append(
            _table(
                ["time (s)", "process", "what"],
                ((f"{e.time:.1f}", f"{e.member}#{e.incarnation}", e.detail) for e in s.exits),
                numeric=(0,),
            )
        )
    sections.append("<h2>Faults by kind</h2>")
    longest = s.longest_outage_by_kind()
    sections.append(
        _table(
            ["fault", "count", "longest outage overlapping it (s)", "that fault"],
            (
                (
                    kind,
                    count,
                    f"{longest.get(kind, (0.0, ''))[0]:.1f}",
                    longest.get(kind, (0.0, ""))[1],
                )
                for kind, count in s.faults_by_kind().items()
            ),
            numeric=(1, 2),
        )
    )
    sections.append("<h2>Ops</h2>")
    sections.append(_table(["outcome", "ops"], s.ops.items(), numeric=(1,)))
    sections.append("<h2>Timeline</h2>")
    sections.append(
        _table(
            ["injected (s)", "healed (s)", "fault", "notes"],
            (
                (
                    f"{f.start:.1f}",
                    "-" if f.end is None else f"{f.end:.1f}",
                    f.description,
                    "; ".join(f.notes),
                )
                for f in sorted(s.faults, key=lambda f: f.start)
            ),
            numeric=(0, 1),
        )
    )
    sections.append("<h2>Outages</h2>")
    sections.append(
        _table(
            ["partition", "workload", "from (s)", "to (s)", "length (s)"],
            (
                (
                    o.partition,
                    s.partitions.get(o.partition, "?"),
                    f"{o.start:.1f}",
                    f"{o.end:.1f}",
                    f"{o.length:.1f}",
                )
                for o in s.outages
            ),
            numeric=(0, 2, 3, 4),
        )
    )
    sections.append("<h2>Run</h2>")
    settings = {**s.settings, "network": s.network, "replay": s.replay}
    sections.append(_table(["setting", "value"], settings.items()))
    if s.notes:
        sections.append(
            "<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in s.notes) + "</ul>"
        )
    body = "\n".join(sections)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{html.escape(s.title)}</title>
<style>
{_CSS}</style></head>
<body>
<h1>{html.escape(s.title)}</h1>
<p class="hint">network: {html.escape(s.network)}<br>
replay: <code>{html.escape(s.replay)}</code></p>
{body}
</body></html>
"""


def json_report(summary: Summary) -> str:
    return json.dumps(summary.to_json(), indent=1) + "\n"


__all__ = [
    "OUTAGE_GAP",
    "Outage",
    "Summary",
    "analyse",
    "html_report",
    "json_report",
    "outages",
    "text_report",
]
