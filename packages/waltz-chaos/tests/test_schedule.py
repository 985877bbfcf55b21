"""The fault schedule: a pure function of the seed and the run's shape, written and
replayed as a file, and drawn under the rules that keep the cluster able to commit."""

from __future__ import annotations

from pathlib import Path

import pytest

from waltz_chaos.errors import ChaosError
from waltz_chaos.schedule import (
    NETWORK_FAULTS,
    QUORUM_FAULTS,
    QUORUM_RECOVERY,
    REPAIR_ALLOWANCE,
    STOPPING_FAULTS,
    STORAGE_FAULTS,
    WARM_UP,
    Fault,
    Roles,
    Schedule,
    generate,
    impaired_by,
    profile_of,
)

ROLES = Roles.of(3, 2, 4)


def schedule(seed: int = 1, **kw: object) -> Schedule:
    options: dict[str, object] = {"duration": 120.0, "quiet": 28.0, **kw}
    return generate(seed, ROLES, **options)  # type: ignore[arg-type]


def impaired_at(s: Schedule, t: float) -> tuple[set[str], set[str]]:
    """(storage nodes, servers) impaired at ``t`` (the generator's rule, recomputed here)."""
    storage: set[str] = set()
    servers: set[str] = set()
    for f in s.faults:
        if not f.at <= t < f.end:
            continue
        hit = set(f.targets)
        for a, b in f.links:
            # a storage node cut off from a server is impaired (the server is not)
            if {a, b} & set(ROLES.servers):
                hit |= {a, b} & set(ROLES.storage)
            if "coordination" in (a, b):
                hit |= {a, b} & set(ROLES.servers)
        if f.kind == "storage_cut_off":
            hit -= set(ROLES.servers)
        if f.kind in ("coordination_restart",):
            continue
        storage |= hit & set(ROLES.storage)
        servers |= hit & set(ROLES.servers)
    return storage, servers


def test_a_seed_draws_the_same_schedule_and_another_seed_another() -> None:
    assert schedule(7).to_json() == schedule(7).to_json()
    assert schedule(7).to_json() != schedule(8).to_json()


def test_a_schedule_file_replays_exactly(tmp_path: Path) -> None:
    original = schedule(3)
    original.save(tmp_path / "schedule.json")
    loaded = Schedule.load(tmp_path / "schedule.json")
    assert loaded.to_json() == original.to_json()
    assert loaded.faults == original.faults


def test_the_ci_run_has_thirty_faults_with_partitions() -> None:
    """What the chaos tox env runs: seed 1, 90 s (tests/system)."""
    s = generate(1, ROLES, duration=90.0, quiet=28.0)
    assert len(s.faults) >= 30
    kinds = s.kinds()
    assert kinds.get("partition", 0) + kinds.get("one_way", 0) >= 5
    assert sum(1 for f in s.faults if f.quorum) == 1


@pytest.mark.parametrize("seed", range(12))
def test_the_rules_hold_at_every_instant(seed: int) -> None:
    s = schedule(seed, duration=400.0)
    assert s.faults
    assert all(f.at >= WARM_UP and f.end <= s.duration - s.quiet for f in s.faults)
    instants = sorted({f.at for f in s.faults} | {f.end - 1e-6 for f in s.faults})
    for t in instants:
        active = [f for f in s.faults if f.at <= t < f.end]
        if any(f.quorum for f in active):
            assert len(active) == 1, f"a quorum fault with others at {t}: {active}"
            continue
        storage, servers = impaired_at(s, t)
        assert len(storage) <= 1, f"{storage} impaired at once at {t}"
        assert len(servers) < 2, f"every server impaired at {t}"
        targets = [x for f in active if f.kind in ("kill", "pause", "disk_full") for x in f.targets]
        assert len(targets) == len(set(targets)), f"two process faults on one target at {t}"
        links = [link for f in active for link in f.links]
        assert len(links) == len(set(links)), f"two faults on one link at {t}"
        assert sum(f.kind == "coordination_restart" for f in active) <= 1
    # quorum faults: every QUORUM_EVERY seconds, none too close to others
    quorum = [f for f in s.faults if f.quorum]
    assert len(quorum) >= 1
    for q in quorum:
        assert not [f for f in s.faults if not f.quorum and q.end <= f.at < q.end + QUORUM_RECOVERY]


def test_without_namespaces_or_mounts_no_network_or_disk_fault() -> None:
    s = schedule(5, network=False, disk=False)
    assert s.faults
    assert not [f for f in s.faults if f.network or f.kind == "disk_full"]
    assert {f.kind for f in s.faults} & {"kill", "pause"}


def test_a_list_of_faults_is_a_profile() -> None:
    p = profile_of("kill,partition,servers_down")
    assert set(p.weights) == {"kill", "partition"}
    assert p.quorum == ("servers_down",)
    s = schedule(2, profile_spec="kill,partition,servers_down")
    assert {f.kind for f in s.faults} == {"kill", "partition", "servers_down"}
    with pytest.raises(ChaosError, match="unknown fault profile"):
        profile_of("kill,nonsense")


def test_a_schedule_that_does_not_fit_the_cluster_is_refused(tmp_path: Path) -> None:
    s = schedule(1)
    with pytest.raises(ChaosError, match="does not have"):
        s.check_fits(Roles.of(3, 1, 4), network=True, disk=True)
    with pytest.raises(ChaosError, match="network namespaces"):
        s.check_fits(ROLES, network=False, disk=True)
    path = tmp_path / "bad.json"
    path.write_text('{"version": 99}')
    with pytest.raises(ChaosError, match="not a waltz chaos schedule"):
        Schedule.load(path)


def test_faults_describe_themselves() -> None:
    cut = Fault(1.0, "partition", 2.0, links=(("server-0", "storage-1"), ("storage-1", "server-0")))
    assert cut.describe() == "partition: server-0<->storage-1 cut"
    one_way = Fault(1.0, "one_way", 2.0, links=(("client-0", "server-1"),))
    assert one_way.describe() == "one_way: client-0->server-1 cut one way"
    assert Fault(1.0, "kill", 2.0, ("storage-2",)).describe() == "kill: storage-2"
    assert set(QUORUM_FAULTS) - {"storage_cut_off"} <= {
        f for f in QUORUM_FAULTS if f not in NETWORK_FAULTS
    }


# -- storage faults ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_storage_faults_damage_one_node_at_a_time(seed: int) -> None:
    """The storage profile: each storage fault restarts its node at its hold and counts
    REPAIR_ALLOWANCE for the repair; while it lasts no other storage node is impaired; a
    rollback only to a copy taken at an earlier stop of its node."""
    s = schedule(seed, duration=400.0, profile_spec="storage")
    damage = [f for f in s.faults if f.kind in STORAGE_FAULTS]
    assert damage and not [f for f in s.faults if f.quorum or f.network]
    for f in damage:
        assert len(f.targets) == 1 and f.targets[0] in ROLES.storage
        assert 1.0 <= f.hold <= 6.0 and f.heal_at == f.at + f.hold
        assert f.duration == pytest.approx(f.hold + REPAIR_ALLOWANCE, abs=1e-3)
        others = [
            g
            for g in s.faults
            if g is not f and g.at < f.end and f.at < g.end and impaired_by(g, ROLES)[0]
        ]
        assert {n for g in others for n in impaired_by(g, ROLES)[0]} <= set(f.targets), (f, others)
        if f.kind == "rollback_data":
            assert any(
                g.kind in STOPPING_FAULTS and f.targets[0] in g.targets and g.end <= f.at
                for g in s.faults
            ), f
    assert schedule(seed, duration=400.0).kinds().keys().isdisjoint(STORAGE_FAULTS)


def test_every_storage_fault_is_drawn_and_replayed() -> None:
    drawn = {f.kind for seed in range(4) for f in schedule(seed, profile_spec="storage").faults}
    assert set(STORAGE_FAULTS) <= drawn
    fault = Fault(9.0, "flip_sealed", 8.0, ("storage-1",), hold=3.0)
    assert Fault.from_json(fault.to_json()) == fault and fault.heal_at == 12.0
    assert Fault(9.0, "kill", 8.0, ("storage-1",)).heal_at == 17.0
    assert "hold" not in Fault(9.0, "kill", 8.0, ("storage-1",)).to_json()


def test_without_the_data_directories_no_storage_fault() -> None:
    """An attached cluster's data directories are not the run's: no storage fault is
    drawn, and a schedule holding one is refused."""
    s = schedule(1, profile_spec="storage", data=False)
    assert s.faults and not [f for f in s.faults if f.kind in STORAGE_FAULTS]
    with pytest.raises(ChaosError, match="data directories"):
        schedule(1, profile_spec="storage").check_fits(ROLES, network=True, disk=True, data=False)
