"""Protocol-timed faults: every registered protocol point is hit over a few seeds of the
``points`` profile, strikes happen at them, and a point that is not registered is an
error (so a typo never silently disables a strike)."""

from __future__ import annotations

import pytest

from waltz_api import faultpoints
from waltz_sim import SimConfig, run_seed
from waltz_sim.points import coverage_table
from waltz_sim.runner import mixed

SEEDS = range(16)
FS_SEEDS = range(7)  # seed 6 hits storage.journal_direct_written (a small journal)


def test_every_protocol_point_is_hit_and_struck_over_the_points_seeds(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    # as CI runs them: each seed's mix (a quarter archive: the archive's points), and
    # on the real fs engine (its node journal's points: tox -e sim runs both ranges)
    results = [run_seed(mixed(SimConfig(seed=seed, faults="points"))) for seed in SEEDS]
    results += [
        run_seed(mixed(SimConfig(seed=seed, faults="points", storage_engine="fs")))
        for seed in FS_SEEDS
    ]
    for result in results:
        assert result.ok, (result.seed, result.violations[:3], result.error)
    table = coverage_table([r.point_hits for r in results])
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        with capsys.disabled():  # the coverage table on the terminal
            reporter.write_line("\n" + "\n".join(table))
    assert table[-1] == "every point was hit", table[-1]
    strikes = [line for r in results for line in r.fault_log if " at " in line.split(" for ")[0]]
    struck = {line.split(" at ", 1)[1].split(" for ")[0] for line in strikes}
    assert len(strikes) >= len(SEEDS), strikes
    assert len(struck) >= 3, struck  # strikes land at several different points


def test_an_unregistered_point_is_an_error() -> None:
    from waltz_sim.loop import SimLoop
    from waltz_sim.points import PointStriker
    from waltz_sim.runner import arm
    from waltz_sim.world import World

    loop = SimLoop()
    try:
        world = World(SimConfig(seed=1), loop)
        striker = arm(world)
        with faultpoints.installed(world.on_point), pytest.raises(KeyError, match="registered"):
            faultpoints.point("no.such.point")
        assert isinstance(world.points, PointStriker) and world.points is striker
    finally:
        loop.close()


def test_points_cost_nothing_outside_a_simulation() -> None:
    faultpoints.point("replica.rejoined", replica="x")  # no handler: nothing happens
    with (
        faultpoints.installed(lambda name, detail: None),
        pytest.raises(Exception, match="one"),
        faultpoints.installed(lambda name, detail: None),
    ):
        pass
