"""Seeds that found bugs, kept: each must pass (or, for an open known issue, show
nothing but that issue's symptoms)."""

from __future__ import annotations

import pytest

from waltz_sim import SimConfig, run_seed
from waltz_sim.known_issues import KNOWN_ISSUES, explained_by
from waltz_sim.runner import mixed

# (seed, profile, what it found once)
REGRESSIONS = [
    (
        111,
        "standard",
        "the simulated coordination kept a closed client's session alive when its link came "
        "back: the session never expired, its server registration stayed, and a partition "
        "stayed assigned to a server that no longer served it (no-high-water-mark at the end)",
    ),
    (
        96,
        "standard",
        "same as 111 (a LOST client's session kept alive by a reconnection)",
    ),
    (
        16,
        "standard",
        "a server answered STALE_GENERATION for an append its store session took before the "
        "partition moved; the client took it as not appended and re-executed it, and the next "
        "owner's recovery kept the first one: committed twice (duplicate, false-failure); "
        "fixed in waltz_client (the next mount decides such an append)",
    ),
    (27, "standard", "same as 16"),
    (40, "standard", "same as 16"),
    (
        9,
        "standard",
        "an append whose store session ended before it committed was never answered: the "
        "client waited forever (undecided); fixed by the server's rewrite (every append is "
        "answered, NOT_COMMITTED when recovery left it out)",
    ),
    (14, "standard", "same as 9"),
    (
        17,
        "standard",
        "a replica that came back with records lost to damage rejoined its store session "
        "without a repair: the hole stayed (replica-behind); fixed in the server "
        "(StoreSession._repair before a rejoin)",
    ),
    (29, "standard", "same as 17"),
    (
        16,
        "chaos",
        "a replica that voted in a recovery, then died, kept catching the others up: each "
        "read from it failed and the reader was blamed, the recovery never completed "
        "(no-high-water-mark); fixed in the server (the failed usher is dropped)",
    ),
    (
        5,
        "storage",
        "issue 27: a replica whose storage lost what it acknowledged rejoined its store "
        "session, the rejoin cleared LOST_SESSION, the owner died before it caught up, and "
        "the next recovery counted it as a voter with a lagging replica and truncated the "
        "intact copy (acknowledged-lost); fixed in the server (a suspect replica never "
        "votes; the closing mark never below a voter's log end)",
    ),
    (81, "storage", "same as storage seed 5"),
    (21, "storage", "same as storage seed 5"),
    (
        23,
        "storage",
        "issue 27, the unseen lost tail: a replica's lost write (zeros where acknowledged "
        "records were) was cut at its restart as a torn write, its marks still clean; the "
        "nemesis crashed the owner, and the next recovery decided with it and a lagging "
        "replica before the intact copy (slow fsyncs) answered; fixed in the engines (the "
        "acknowledged end is kept apart from the records: a log ending below it is "
        "LOST_SESSION)",
    ),
    (
        1769,
        "storage",
        "issue 27, a restore from a snapshot taken within the session: its marks looked "
        "clean, a recovery counted it as a voter (duplicate); fixed by `waltz storage "
        "restore` marking every restored partition LOST_SESSION",
    ),
    (1906, "storage", "same as storage seed 23 (the unseen-lost-tail known issue)"),
    (
        101,
        "storage",
        "a recovery wrote the session's marks on a suspect replica before catching it up, "
        "clearing its LOST_SESSION; the owner died during the catch-up and the next "
        "recovery took it for a clean replica behind, caught it up from a peer and closed "
        "below acknowledged ids (acknowledged-lost); fixed in the server (the marks only "
        "once it holds the closing mark's prefix)",
    ),
    (
        578,
        "storage",
        "a replica that recovered into a running session after the replicas that recovered "
        "first had left (recovery forgot them) was never recorded clean in the replica "
        "states, yet wrote and acknowledged; the next recovery truncated it to the old "
        "closing mark and counted it out (acknowledged-lost); fixed in the server (a late "
        "replica records itself clean before it writes)",
    ),
    (
        1116,
        "storage",
        "not a bug of the code: a damaged rejoin's damage, scheduled before the quorum phase, "
        "landed in it beside a storage majority powered off (a damaged copy and a majority "
        "down: beyond the guarantee); the damage is now called off when the rules no longer "
        "allow it, and the quorum phase waits for no damage to come",
    ),
    (
        1,
        "none",
        "the simulated network could deliver two frames of one connection landing at the same "
        "virtual instant in heap order, not sent order: a client saw its feed jump",
    ),
]


# (seed, profile, what it found once): the configuration the seed chooses (runner.mixed)
MIXED_REGRESSIONS = [
    (
        16,
        "storage",
        "with a replaced replica (exact locks): after every server restarted, one new server "
        "kept a list of registered servers naming two dead ones and followed the dead leader, "
        "the other waited for it: no partition got an owner again (no-high-water-mark). The "
        "simulated coordination delivered a change notified while a watch's first answer "
        "travelled before that answer (the stale list last); fixed in waltz_sim.coord",
    ),
    (
        13,
        "points",
        "(plain callbacks) a damage_lagging fault's delayed crash of its storage node fired "
        "after the run's heal, which restarts nothing any more: the node stayed down through "
        "the quiet phase (replica-behind); fixed in waltz_sim.faults (a healed fault's "
        "crash is called off)",
    ),
    (
        56,
        "points",
        "(archive, the sim engine without the prefix capability) a replica that came back "
        "with records lost to damage below the archive mark was asked to delete its archived "
        "prefix when it rejoined; its engine refused, and the rejoin failed the same way "
        "every retry: the replica never rejoined (replica-behind); fixed in "
        "store_session.py (a replica that cannot delete is repaired and caught up instead)",
    ),
    (
        3,
        "points",
        "(a replaced replica) the spare's replica was removed beside it while a damage fault "
        "had cost the spare its acknowledged tail (the rules excused the spare as pristine): "
        "the next recovery waited for ever for the removed replica (no-high-water-mark); "
        "fixed in waltz_sim.membership (the spare is excused only until a damaging fault "
        "strikes it)",
    ),
]


# on the real fs engine (--storage-engine fs), each seed's mix
FS_REGRESSIONS = [
    (
        7,
        "points",
        "a node with a 4 KiB journal made a checkpoint when its rounds had filled the ring "
        "to its very end; the journal took that position (the end of the body) for the "
        "oldest live entry, so the next lap wrote over the entries since, never checkpointed: "
        "the read-back's open found the journal damaged (entry #120 not whole, later ones "
        "whole); fixed in waltz_storage_fs.journal (the end of the ring is its start)",
    ),
    (
        19,
        "standard",
        "a node with a 6 KiB journal, its writer wrapped and the checkpoint near the end of "
        "the ring: the journal said a round too large for the room left would fit at the "
        "start (live entries), so no checkpoint was made, then refused the entry as full "
        "after its records were written: the partition's log ran ahead of what it "
        "acknowledged and it refused every append (replica-behind); fixed in "
        "waltz_storage_fs.journal (a wrapped writer never wraps again)",
    ),
]


@pytest.mark.parametrize(("seed", "profile", "found"), FS_REGRESSIONS)
def test_an_fs_seed_that_found_a_bug_passes(seed: int, profile: str, found: str) -> None:
    result = run_seed(mixed(SimConfig(seed=seed, faults=profile, storage_engine="fs")))
    assert result.ok, f"seed {seed} ({found}): {result.error} {result.violations[:3]}"


@pytest.mark.parametrize(("seed", "profile", "found"), MIXED_REGRESSIONS)
def test_a_mixed_seed_that_found_a_bug_passes(seed: int, profile: str, found: str) -> None:
    result = run_seed(mixed(SimConfig(seed=seed, faults=profile)))
    assert result.ok, f"seed {seed} ({found}): {result.error} {result.violations[:3]}"


@pytest.mark.parametrize(("seed", "profile", "found"), REGRESSIONS)
def test_a_seed_that_found_a_bug_passes(seed: int, profile: str, found: str) -> None:
    result = run_seed(SimConfig(seed=seed, faults=profile), keep_trace=True)
    assert result.error is None
    assert "feed jumped" not in result.trace_text
    if result.violations:  # an open known issue's symptoms alone, or it fails
        known = explained_by(result.violations)
        assert known is not None, f"seed {seed} ({found}): {result.violations[:3]}"


def test_each_known_issue_shows_only_its_symptoms(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    """The seeds of every open issue still fail by its symptoms alone (none hidden
    behind it); one that passes is reported (the issue may be fixed)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    for known in KNOWN_ISSUES:
        for seed in known.seeds[:2]:
            result = run_seed(SimConfig(seed=seed, faults=known.faults))
            assert result.error is None
            if result.ok:
                if reporter is not None:
                    with capsys.disabled():
                        reporter.write_line(
                            f"\nknown issue {known.id}: seed {seed} passes now; if the issue is "
                            "fixed, move its seeds to REGRESSIONS and the entry out of "
                            "waltz_sim.known_issues"
                        )
                continue
            assert known.explains(result.violations), [str(v) for v in result.violations[:5]]
