"""Issue 27 as scripted scenarios (waltz_sim.scenario): no acknowledged transaction lost
when a replica that lost what it acknowledged rejoins, another lags, and the owner dies.

Partition 0 has replicas A, B and C (storage-0, -1, -2) and store session S, opened
at low-water mark L. C lags: its fsyncs stall, or it is paused (SIGSTOP); it stays
connected. A and B acknowledge a burst, which is committed and acknowledged to the
clients. A's storage node restarts having lost records it acknowledged (a damaged
tail its engine reports as LOST_SESSION, a wiped disk, a snapshot restored from the
session before S or from within S). A rejoins S (``plan_rejoin`` keeps up to L,
``SetLowWaterMark`` writes S's marks on it), and the owner is killed (kill -9) at the
record of that rejoin, before A caught up. Everything then heals: C's fsyncs complete
or C resumes (so C answers the next owner's recovery at once, while A is still
catching up from L), the owner restarts. The next recovery must not choose a closing
mark below an acknowledged id. The control: A restarts intact.

On the code before the fix every variant but the control loses BURST - 4 of the
acknowledged ids on every seed (the 4: what the owner had sent C before its
in-flight budget was used): the recovery counts A as a clean replica at L, so B and
C decide at C's log end and B is truncated there.

Each variant runs over several seeds (they draw the latencies and the workload around
the scripted points); the checker judges the whole run: nothing acknowledged lost,
and nothing else wrong either. Replay one with ``run_variant(VARIANTS[name], seed,
keep_trace=True).trace_text``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from waltz_sim import SeedResult, SimConfig
from waltz_sim.disk import PartitionImage
from waltz_sim.scenario import (
    CHECKPOINT,
    CLOSING_MARK,
    Scenario,
    lost_acknowledged,
    message_is,
    run_scenario,
)

PARTITION = 0
GAP = 300
"""Transactions S commits before C lags: what A has to catch up from L in the next
recovery. On real processes A lagged by thousands of records, so C answered that
recovery first; in the simulation a catch-up of a few records beats C's answer, and
the interleaving needs the same order: 300 records are two catch-up batches."""
BURST = 20
"""Acknowledged ids beyond C's log end before A goes down."""
CHECKPOINT_INTERVAL = GAP + 100
"""The roll-over variant's ``checkpoint_interval``: S is the session that the first roll-
over opens, and its burst comes before the next one."""
SEEDS = (1, 2, 3, 4)


@dataclass(frozen=True)
class Variant:
    name: str
    damage: str
    """What A's disk holds at its restart: ``lost-tail`` (its last records lost to damage,
    LOST_SESSION), ``wiped``, ``restore-earlier`` (a snapshot from the session before S),
    ``restore-within`` (a snapshot from within S), ``intact``."""
    lag: str = "fsync"
    """How C lags: ``fsync`` (its fsyncs stall: a slow fdatasync, over when the owner has
    died) or ``pause`` (SIGSTOP, resumed when the owner has died)."""
    rollover: bool = False
    """S is the first session after a roll-over (the checkpoint interval was reached)."""


VARIANTS = {
    v.name: v
    for v in (
        Variant("lost-tail", "lost-tail"),
        Variant("wiped", "wiped"),
        Variant("restore-earlier", "restore-earlier"),
        Variant("restore-within", "restore-within"),
        Variant("paused", "lost-tail", lag="pause"),
        Variant("rollover", "lost-tail", rollover=True),
        Variant("control", "intact"),
    )
}


async def interleaving(s: Scenario, v: Variant) -> None:
    p = PARTITION
    a, c = s.storage(0), s.storage(2)
    checkpoints = s.watch(message_is(CHECKPOINT, p))
    s.on_log(message_is(CLOSING_MARK, p, prefix=True), lambda r: _replicas_at(s, r), once=False)

    opened = await s.session_opened(p)
    earlier: dict[int, PartitionImage] | None = None
    if v.damage == "restore-earlier":
        await s.wait_acknowledged(p, opened.low_water_mark + 10)
        earlier = s.snapshot(a)
        owner = s.process(opened.server)
        s.crash(owner)  # the other server takes the partition over: S is a new session
        opened = await s.session_opened(p, after=opened.session_id)
        s.restart(owner)
    if v.rollover:
        await s.wait_until(lambda: checkpoints.fired, "a roll-over (checkpoint interval)", 60.0)
        rolled = checkpoints.records[0].args
        assert isinstance(rolled, tuple) and isinstance(rolled[1], int)
        opened = await s.session_opened(p, after=rolled[1])
    s.note(f"S is session {opened.session_id}, opened at L = {opened.low_water_mark}")
    await s.wait_acknowledged(p, opened.low_water_mark + GAP, timeout=60.0)
    within = s.snapshot(a) if v.damage == "restore-within" else None

    if v.lag == "pause":
        s.pause(c)
    else:
        s.stall_fsync(c)
    await s.wait_until(
        lambda: s.acknowledged(p) >= s.log_end(c, p) + BURST, "A and B acknowledging a burst"
    )
    s.note(f"burst: acknowledged up to {s.acknowledged(p)}; C holds up to {s.log_end(c, p)}")

    s.crash(a)
    if v.damage == "lost-tail":
        s.lose_tail(a, p, 3)
    elif v.damage == "wiped":
        s.wipe(a)
    elif v.damage in ("restore-earlier", "restore-within"):
        snapshot = earlier if v.damage == "restore-earlier" else within
        assert snapshot is not None
        s.restore(a, snapshot)
    hook = s.crash_owner_on_rejoin(p, a, opened.session_id)
    s.restart(a)
    await s.wait_fired(hook, f"{a.name}'s rejoin of session {opened.session_id}", 20.0)
    owner = s.process_of(hook.sources[0])
    s.expect(
        not owner.alive and s.process(opened.server) is owner,
        f"S's owner {opened.server} killed at the rejoin it logged ({hook.sources[0]})",
    )
    if v.lag == "pause":
        s.resume(c)
    else:
        s.release_fsync(c)
    await s.sleep(1.0)  # then the world heals the rest: the owner restarts


def _replicas_at(s: Scenario, record: logging.LogRecord) -> None:
    """Each replica's log end and marks when a recovery decides (why it decided so)."""
    states = []
    for node in (s.storage(0), s.storage(1), s.storage(2)):
        image = s.disk(node).partitions.get(PARTITION)
        info = None if image is None else image.written_info
        marks = "none" if info is None else f"{info.low_water_mark} of session "
        marks += "" if info is None else str(info.low_water_mark_session_id)
        states.append(f"{node.name} ends at {s.log_end(node, PARTITION)} (marks {marks})")
    acknowledged = s.acknowledged(PARTITION)
    s.note(f"{record.getMessage()}; acknowledged up to {acknowledged}: {', '.join(states)}")


def run_variant(v: Variant, seed: int, *, keep_trace: bool = False) -> SeedResult:
    config = SimConfig(
        seed=seed,
        faults="none",
        duration=20.0,
        partitions=1,
        ops_per_second=10.0,
        server_options={"checkpoint_interval": CHECKPOINT_INTERVAL} if v.rollover else {},
    )

    async def script(s: Scenario) -> None:
        await interleaving(s, v)

    return run_scenario(config, script, keep_trace=keep_trace)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_no_acknowledged_transaction_is_lost(variant: str, seed: int) -> None:
    result = run_variant(VARIANTS[variant], seed)
    assert result.error is None, result.error
    lost = lost_acknowledged(result)
    assert not result.violations, (
        f"{variant}, seed {seed}: {len(lost)} acknowledged transactions lost; "
        f"{len(result.violations)} violations: " + "; ".join(str(v) for v in result.violations[:4])
    )
