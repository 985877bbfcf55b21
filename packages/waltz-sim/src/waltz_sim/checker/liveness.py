"""The liveness invariants: every submission is answered in time, the cluster commits
after faults heal and commits at a reasonable rate when nothing is wrong.

From the moment the last fault healed (``History.healed_at``), and in each fault-free
period before it (``History.quiet``) long enough for the bound:

- ``undecided``: a submission without an answer although its deadline passed; in a
  drained run (``History.drained``: the run waited for every open submission before its
  end), any submission without an answer at the end;
- ``late-decision``: an answer after the deadline;
- ``no-commit-after-heal``: nothing committed within the bound after the heal.

And over the fault-free windows of ``History.baseline`` together (the warm-up and the
settled quiet end, or a whole run without faults):

- ``throughput``: ops committed at less than ``LivenessBounds.throughput_floor`` of the
  rate the clients start them (``History.offered_rate``): a cluster that turns work
  away with nothing wrong (a lock check too strict, a stall) commits far below a clean
  run.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from waltz_sim.checker.model import FAIL, OK, History, LivenessBounds, OpEvent, Violation


@dataclass
class OpLife:
    """An op's invocation and end (each None until seen)."""

    op_id: str
    invoke: OpEvent | None = None
    end: OpEvent | None = None


def check_liveness(
    history: History, ops: dict[str, OpLife], bounds: LivenessBounds, out: list[Violation]
) -> float | None:
    """Adds the violations to ``out``; returns the baseline's throughput (a share of the
    offered rate), None when there is no baseline to judge."""
    healed = history.healed_at if history.healed_at is not None else history.start_time
    deadline = bounds.decision_deadline
    end = history.end_time
    first_ok_after: float | None = None
    submitted_after = False
    for op in ops.values():
        invoke = op.invoke
        if invoke is None:
            continue
        due = max(invoke.time, healed) + deadline
        if op.end is None:
            if history.drained:
                out.append(
                    Violation(
                        "undecided",
                        f"op {op.op_id} ({invoke.detail}) invoked at "
                        f"{invoke.time - history.start_time:.3f} has no answer at the end of "
                        f"the run ({end - invoke.time:.1f} s later), although the run waited "
                        "for every open submission to be answered (committed or not) before "
                        "its end",
                        invoke.time,
                        partition=invoke.partition,
                        op_id=op.op_id,
                        client=invoke.client,
                    )
                )
            elif due <= end:
                out.append(
                    Violation(
                        "undecided",
                        f"op {op.op_id} ({invoke.detail}) invoked at "
                        f"{invoke.time - history.start_time:.3f} has no answer "
                        f"{end - max(invoke.time, healed):.1f} s after "
                        f"{'the heal' if healed > invoke.time else 'its invocation'} "
                        f"(deadline {deadline} s)",
                        invoke.time,
                        partition=invoke.partition,
                        op_id=op.op_id,
                        client=invoke.client,
                    )
                )
            continue
        if op.end.kind in (OK, FAIL) and op.end.time > due:
            out.append(
                Violation(
                    "late-decision",
                    f"op {op.op_id} was decided ({op.end.kind}) "
                    f"{op.end.time - max(invoke.time, healed):.1f} s after "
                    f"{'the heal' if healed > invoke.time else 'its invocation'} "
                    f"(deadline {deadline} s)",
                    op.end.time,
                    partition=invoke.partition,
                    op_id=op.op_id,
                    client=invoke.client,
                )
            )
        if (
            op.end.kind == OK
            and op.end.time >= healed
            and (first_ok_after is None or op.end.time < first_ok_after)
        ):
            first_ok_after = op.end.time
        if invoke.time >= healed or op.end.time >= healed:
            submitted_after = True
    _check_quiet_periods(history, ops, bounds, out)
    throughput = _check_throughput(history, ops, bounds, out)
    if history.healed_at is None or not submitted_after:
        return throughput
    if first_ok_after is None:
        if end - healed >= bounds.commit_bound:
            out.append(
                Violation(
                    "no-commit-after-heal",
                    f"nothing committed in the {end - healed:.1f} s after the last fault healed",
                    healed,
                )
            )
    elif first_ok_after - healed > bounds.commit_bound:
        out.append(
            Violation(
                "no-commit-after-heal",
                f"the first commit after the heal came {first_ok_after - healed:.1f} s after it "
                f"(bound {bounds.commit_bound} s)",
                first_ok_after,
            )
        )
    return throughput


def _check_quiet_periods(
    history: History, ops: dict[str, OpLife], bounds: LivenessBounds, out: list[Violation]
) -> None:
    """The liveness bounds in the fault-free periods before the last heal."""
    last = history.healed_at if history.healed_at is not None else history.end_time
    periods = sorted((start, min(end, last)) for start, end in history.quiet if start < last)
    deadline = bounds.decision_deadline
    for op in ops.values():
        invoke = op.invoke
        if invoke is None:
            continue
        for start, end in periods:
            if end <= invoke.time:
                continue
            begin = max(invoke.time, start)
            if op.end is not None and op.end.time <= begin:
                break  # decided before this period began
            due = begin + deadline
            if due > end:
                continue  # a fault came before its deadline: not held to it here
            since = (
                f"the heal at {start - history.start_time:.1f}"
                if begin > invoke.time
                else ("its invocation")
            )
            if op.end is None:
                out.append(
                    Violation(
                        "undecided",
                        f"op {op.op_id} ({invoke.detail}) invoked at "
                        f"{invoke.time - history.start_time:.3f} has no answer {deadline} s after "
                        f"{since}, in a fault-free period",
                        invoke.time,
                        partition=invoke.partition,
                        op_id=op.op_id,
                        client=invoke.client,
                    )
                )
            elif op.end.kind in (OK, FAIL) and op.end.time > due:
                out.append(
                    Violation(
                        "late-decision",
                        f"op {op.op_id} was decided ({op.end.kind}) "
                        f"{op.end.time - begin:.1f} s after {since} (deadline {deadline} s), in "
                        "a fault-free period",
                        op.end.time,
                        partition=invoke.partition,
                        op_id=op.op_id,
                        client=invoke.client,
                    )
                )
            break
    bound = bounds.commit_bound
    for start, end in periods:
        if end - start < bound:
            continue
        in_flight = any(
            op.invoke is not None
            and op.invoke.time < start + bound
            and (op.end is None or op.end.time >= start)
            for op in ops.values()
        )
        if not in_flight:
            continue
        commits = [
            op.end.time
            for op in ops.values()
            if op.end is not None and op.end.kind == OK and start <= op.end.time < end
        ]
        first = min(commits, default=None)
        if first is None or first - start > bound:
            late = (
                "nothing committed"
                if first is None
                else f"the first commit came {first - start:.1f} s into"
            )
            out.append(
                Violation(
                    "no-commit-after-heal",
                    f"{late} in the fault-free period from "
                    f"{start - history.start_time:.1f} to {end - history.start_time:.1f} "
                    f"(bound {bound} s)",
                    start if first is None else first,
                )
            )


def _check_throughput(
    history: History, ops: dict[str, OpLife], bounds: LivenessBounds, out: list[Violation]
) -> float | None:
    """Over the fault-free windows of the baseline together, ops commit at the floor's
    share of the offered rate at least; returns that share."""
    offered = history.offered_rate
    share = bounds.throughput_floor
    windows = sorted(history.baseline)
    span = sum(end - start for start, end in windows)
    if not offered or span < bounds.throughput_window:
        return None
    commits = sorted(op.end.time for op in ops.values() if op.end is not None and op.end.kind == OK)
    committed = sum(
        bisect.bisect_left(commits, end) - bisect.bisect_left(commits, start)
        for start, end in windows
    )
    rate = committed / span
    if rate < share * offered:  # share 0: never
        where = ", ".join(
            f"{start - history.start_time:.1f} to {end - history.start_time:.1f} s"
            for start, end in windows
        )
        out.append(
            Violation(
                "throughput",
                f"{committed} ops committed in the {span:.1f} s without faults ({where}): "
                f"{rate:.2f} per second, below the floor of {share * offered:.2f} "
                f"({share:.0%} of the {offered:g} ops per second the clients start); with "
                "nothing wrong the cluster turned work away (lock checks failing, appends "
                "stalling)",
                windows[0][0],
            )
        )
    return rate / offered


__all__ = ["OpLife", "check_liveness"]
