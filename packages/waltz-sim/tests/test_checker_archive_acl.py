"""The checker with an archive (replicas that deleted what is archived) and with an ACL
(who may write where), on hand-made histories; and the simulated object store."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_support import idle_process, in_world
from test_checker import BANK, clean_log, history, kinds, ops_for, snapshot

from waltz_api.errors import ArchiveError
from waltz_sim.checker import FAIL, INVOKE, OpEvent, check
from waltz_sim.world import SimConfig, World

# -- the archive -----------------------------------------------------------------------------


def test_replicas_that_deleted_what_is_archived_hold_the_log_with_the_archive() -> None:
    log = clean_log()
    pruned = snapshot(log, storage_0=log[2:], storage_1=log[2:], storage_2=log[1:])
    # without the archive, the pruned prefix is lost
    assert "dense-ids" in kinds(check(history(log), pruned, BANK))
    pruned.partitions[0].archived = log[:2]
    assert check(history(log), pruned, BANK).violations == []


def test_an_archived_id_on_no_replica_is_held_by_the_archive_alone() -> None:
    log = clean_log()
    pruned = snapshot(log, storage_0=log[2:], storage_1=log[2:], storage_2=log[2:])
    pruned.partitions[0].archived = log[:1]  # 1 is neither archived nor on a replica
    found = check(history(log), pruned, BANK).violations
    assert {v.invariant for v in found} >= {"dense-ids", "committed-lost"}
    assert any("after the archive's end 0" in v.message for v in found)


def test_a_replica_that_differs_from_the_archive_is_a_fork() -> None:
    log = clean_log()
    other = replace(log[1], checksum=log[1].checksum ^ 1)
    forked = snapshot(log, storage_0=[other, log[2]], storage_1=log[2:], storage_2=log[2:])
    forked.partitions[0].archived = log[:2]
    assert kinds(check(history(log), forked, BANK)) == {"replica-fork"}


def test_an_unreadable_archive_is_reported() -> None:
    log = clean_log()
    broken = snapshot(log)
    broken.partitions[0].archive_error = "ArchiveError: object missing"
    assert kinds(check(history(log), broken, BANK)) == {"archive-unreadable"}


# -- the ACL -----------------------------------------------------------------------------------


def test_a_refused_client_never_commits() -> None:
    log = clean_log()
    # c0 committed everything on partition 0: fine unless the ACL refuses it there
    assert check(history(log, refused=frozenset({("c0", 1)})), snapshot(log), BANK).violations == []
    found = check(history(log, refused=frozenset({("c0", 0)})), snapshot(log), BANK).violations
    assert {v.invariant for v in found} == {"acl-refused-committed"}
    assert len(found) == 3 and found[0].client == "c0"


def test_an_allowed_client_is_never_refused() -> None:
    log = clean_log()
    refusal = [
        OpEvent(INVOKE, "c0:9", "c0", 40.0, 0, detail="deposit"),
        OpEvent(FAIL, "c0:9", "c0", 40.5, 0, detail="refused: lacks the write permission"),
    ]
    ops = [*ops_for(log), *refusal]
    allowed = history(log, ops=ops, refused=frozenset({("c0", 1)}))
    assert kinds(check(allowed, snapshot(log), BANK)) == {"acl-wrongly-refused"}
    denied = history(log, ops=ops, refused=frozenset({("c0", 0)}))
    assert "acl-wrongly-refused" not in kinds(check(denied, snapshot(log), BANK))
    # without an ACL nothing is judged
    assert check(history(log, ops=ops), snapshot(log), BANK).violations == []


# -- the simulated object store ------------------------------------------------------------------


def test_the_object_store_fails_calls_and_loses_answers_as_told() -> None:
    from waltz_sim.archive import SimArchiveStore, register

    async def scenario(world: World) -> None:
        register()
        process = idle_process(world, "server-0")

        async def inside() -> None:
            store = SimArchiveStore(f"simarchive://{world.name}/archive")
            path = store.path("partition-0", "x.json")
            await store.call(lambda: store.write_bytes(path, b"one"), 2.0)
            assert await store.call(lambda: store.read_bytes(path), 2.0) == b"one"
            assert store.list(store.path("partition-0")) == ["x.json"]
            backing = world.object_store
            backing.lost_answers = 1  # it lands, the caller hears a failure
            other = store.path("partition-0", "y.json")
            with pytest.raises(ArchiveError, match="answer was lost"):
                await store.call(lambda: store.write_bytes(other, b"two"), 2.0)
            assert store.exists(other)
            backing.refuse_until = world.loop.time() + 1.0
            with pytest.raises(ArchiveError, match="503"):
                await store.call(lambda: store.read_bytes(path), 2.0)
            backing.refuse_until = 0.0
            backing.extra = 3.0  # slower than the deadline
            with pytest.raises(TimeoutError):
                await store.call(lambda: store.read_bytes(path), 2.0)
            assert store.new_token() != store.new_token()

        assert process.incarnation is not None
        task = world.loop.create_task(inside(), context=process.incarnation.context.copy())
        await task

    in_world(scenario, SimConfig(archive="on"))
