"""The replication core of a store session, exactly (no I/O, no loop)."""

from __future__ import annotations

import random

import pytest

from waltz_api import wire
from waltz_api.errors import WaltzError
from waltz_api.types import LOST_SESSION, NO_SESSION, Record, ReqId, SessionInfo
from waltz_server.server.replication import (
    CatchUp,
    Committed,
    Replication,
    ReplicationLimits,
    Send,
    plan_rejoin,
)

A, B, C = "a:1", "b:1", "c:1"


def core(low_water_mark: int = -1, **limits: int) -> Replication:
    return Replication(
        replicas=(A, B, C), low_water_mark=low_water_mark, limits=ReplicationLimits(**limits)
    )


def add(replication: Replication, count: int, size: int = 10) -> list[Record]:
    records = []
    for i in range(count):
        data = bytes([i % 251]) * size
        records.append(replication.append(ReqId(1, 1, 0, i), 0, data, wire.checksum(data)))
    return records


def send(replication: Replication, node: str) -> Send:
    action = replication.next_send(node)
    assert isinstance(action, Send), action
    return action


def ids(records: tuple[Record, ...] | list[Record]) -> list[int]:
    return [r.transaction_id for r in records]


def test_ids_continue_the_opening_mark_and_room_is_bounded() -> None:
    replication = core(low_water_mark=41, max_pending_records=3)
    assert replication.next_transaction_id == 42
    assert ids(add(replication, 3)) == [42, 43, 44]
    assert replication.pending == 3 and not replication.has_room()
    by_bytes = core(max_window_bytes=25)
    add(by_bytes, 2)
    assert by_bytes.has_room()
    add(by_bytes, 1)
    assert by_bytes.window_bytes == 30 and not by_bytes.has_room()


def test_a_record_commits_once_a_quorum_acknowledged_it() -> None:
    replication = core()
    for node in (A, B, C):
        assert replication.join(node, -1) is None
    add(replication, 5)
    to_a, to_b = send(replication, A), send(replication, B)
    assert ids(to_a.records) == ids(to_b.records) == [0, 1, 2, 3, 4]
    assert replication.on_appended(A, 4) is None  # one of three
    committed = replication.on_appended(B, 4)
    assert isinstance(committed, Committed)
    assert committed.high_water_mark == 4 and ids(committed.records) == [0, 1, 2, 3, 4]
    assert replication.high_water_mark == 4
    # the third acknowledgement commits nothing new
    send(replication, C)
    assert replication.on_appended(C, 4) is None


def test_batches_respect_record_and_byte_limits_and_the_inflight_budget() -> None:
    replication = core(max_batch_records=3, max_batch_bytes=25, max_inflight_batches=2)
    replication.join(A, -1)
    add(replication, 10)
    first, second = send(replication, A), send(replication, A)
    assert ids(first.records) == [0, 1] and ids(second.records) == [2, 3]  # 25 bytes
    assert replication.next_send(A) is None  # two batches in flight
    replication.on_appended(A, 1)
    assert ids(send(replication, A).records) == [4, 5]
    big = core(max_batch_records=3)
    big.join(A, -1)
    add(big, 4, size=1)
    assert ids(send(big, A).records) == [0, 1, 2]
    # an oversized record still goes, alone
    huge = core(max_batch_bytes=5)
    huge.join(A, -1)
    add(huge, 2, size=50)
    assert ids(send(huge, A).records) == [0]


def test_the_byte_limits_are_inclusive() -> None:
    # a batch takes records up to exactly max_batch_bytes
    batches = core(max_batch_bytes=30)
    batches.join(A, -1)
    add(batches, 4)
    assert ids(send(batches, A).records) == [0, 1, 2]
    one_byte_short = core(max_batch_bytes=29)
    one_byte_short.join(A, -1)
    add(one_byte_short, 4)
    assert ids(send(one_byte_short, A).records) == [0, 1]
    # a window exactly at its byte budget (committed records kept for c, which lacks
    # them) with nothing pending still takes an append; one pending over the budget
    # does not
    window = core(max_window_bytes=30)
    for node in (A, B, C):
        window.join(node, -1)
    add(window, 3)
    for node in (A, B):
        send(window, node)
        window.on_appended(node, 2)
    assert window.high_water_mark == 2 and window.window_start == 0
    assert window.pending == 0 and window.window_bytes == 30 and window.has_room()
    # a read from memory: at least one record, then up to exactly max_bytes
    assert ids(window.read_window(0, 3, 20) or []) == [0, 1]
    assert ids(window.read_window(0, 3, 29) or []) == [0, 1]
    assert ids(window.read_window(1, 3, 5) or []) == [1]
    assert ids(window.read_window(0, 2, 1 << 20) or []) == [0, 1]
    # ... counted from the window's start, which follows the opening mark
    later = core(low_water_mark=41)
    add(later, 4)
    assert later.window_start == 42 and later.read_window(41, 2, 1 << 20) is None
    assert ids(later.read_window(43, 2, 1 << 20) or []) == [43, 44]
    assert ids(later.read_window(44, 9, 1 << 20) or []) == [44, 45]
    add(window, 1)
    assert window.pending == 1 and not window.has_room()
    # records pending at exactly the budget: no room
    full = core(max_window_bytes=30)
    add(full, 3)
    assert full.pending == 3 and full.window_bytes == 30 and not full.has_room()


def test_a_batch_or_a_read_stops_at_the_first_record_over_the_limit() -> None:
    # sizes 10, 50, 10: the third fits the limit once the second is left out, but a
    # batch and a read are dense runs of ids, so both stop at the second
    replication = core(max_batch_bytes=30)
    replication.join(A, -1)
    for size in (10, 50, 10):
        data = b"x" * size
        replication.append(ReqId(1, 1, 0, size), 0, data, wire.checksum(data))
    assert ids(replication.read_window(0, 3, 30) or []) == [0]
    assert ids(send(replication, A).records) == [0]
    assert ids(send(replication, A).records) == [1]


def test_late_answers_for_a_replica_that_left_are_ignored() -> None:
    replication = core()
    for node in (A, B):
        replication.join(node, -1)
    add(replication, 2)
    send(replication, A)
    replication.leave(A)
    # nothing is sent to it; its acknowledgement and a catch-up read arriving after it
    # left change nothing
    assert replication.next_send(A) is None
    assert replication.on_appended(A, 1) is None
    records = [Record(i, ReqId(1, 1, 0, i), 0, b"x", 0) for i in (0, 1)]
    assert replication.caught_up_read(A, records) is None
    left = replication.progress(A)
    assert left is not None and left.acked == left.sent == -1 and not left.writing
    # nor do answers for a replica that never joined, or an empty read
    assert replication.next_send(C) is None
    assert replication.on_appended(C, 1) is None
    assert replication.caught_up_read(C, records) is None
    assert replication.caught_up_read(B, []) is None
    assert replication.high_water_mark == -1


def test_a_replica_that_leaves_keeps_its_acknowledgements_and_the_others_commit() -> None:
    replication = core()
    for node in (A, B, C):
        replication.join(node, -1)
    add(replication, 4)
    for node in (A, B, C):
        send(replication, node)
    assert replication.on_appended(C, 3) is None
    replication.leave(C)
    assert replication.writers == [A, B] and replication.next_send(C) is None
    # c's durable acknowledgement still counts with a's
    committed = replication.on_appended(A, 3)
    assert committed is not None and committed.high_water_mark == 3
    # a replica that left with batches in flight forgets them: on rejoin it is sent
    # again from the mark it holds
    add(replication, 3)
    send(replication, B)  # in flight to b, never acknowledged
    replication.leave(B)
    replication.join(B, 3)
    assert ids(send(replication, B).records) == [4, 5, 6]
    with pytest.raises(WaltzError, match="acknowledged up to 9"):
        replication.on_appended(B, 9)
    with pytest.raises(WaltzError, match="assigned ids only up to 6"):
        replication.join(C, 7)
    with pytest.raises(WaltzError, match="not a replica"):
        replication.join("d:1", 0)


def test_the_high_water_mark_never_goes_back() -> None:
    replication = core()
    for node in (A, B):
        replication.join(node, -1)
    add(replication, 3)
    send(replication, A)
    send(replication, B)
    replication.on_appended(A, 2)
    assert replication.on_appended(B, 2) is not None
    # b comes back with less than it had (its storage changed): nothing is uncommitted
    replication.leave(B)
    assert replication.join(B, 0) is None
    assert replication.high_water_mark == 2


def test_the_window_keeps_what_a_writer_lacks_and_a_lagging_one_catches_up_from_storage() -> None:
    replication = core(max_window_bytes=45, catch_up_batch=2)
    for node in (A, B, C):
        replication.join(node, -1)
    add(replication, 4)
    send(replication, A)
    send(replication, B)
    replication.on_appended(A, 3)
    replication.on_appended(B, 3)
    # committed, but c has none of it: kept while the window is under budget
    assert replication.window_start == 0
    assert ids(replication.read_window(1, 2, 1 << 20) or []) == [1, 2]
    add(replication, 2)  # 60 bytes: over budget
    send(replication, A)
    replication.on_appended(A, 5)  # at the next acknowledgement, committed records go
    assert replication.window_start == 2 and replication.window_bytes == 40
    assert replication.read_window(1, 1, 100) is None
    # c lacks records no longer in memory: it reads them from a writer holding them
    assert replication.next_send(C) == CatchUp(0, 2, (A, B))
    assert replication.caught_up_read(C, [Record(1, ReqId(1, 1, 0, 1), 0, b"", 0)]) is None
    records = [Record(i, ReqId(1, 1, 0, i), 0, b"x", 0) for i in (0, 1)]
    sent = replication.caught_up_read(C, records)
    assert sent is not None and ids(sent.records) == [0, 1]
    assert replication.next_send(C) is not None  # from the window now, pipelined
    replication.on_appended(C, 1)
    # while c is away, the window keeps only what the writers lack
    replication.leave(C)
    assert replication.window_start == 4
    replication.join(C, 1)
    assert replication.next_send(C) == CatchUp(2, 2, (A, B))


def test_a_catch_up_reads_only_the_records_below_the_window() -> None:
    # c joins holding up to 1; a tiny byte budget drops committed records it lacks
    replication = core(max_window_bytes=10)
    replication.join(A, -1)
    replication.join(B, -1)
    add(replication, 6)
    replication.join(C, 1)
    send(replication, A)
    send(replication, B)
    replication.on_appended(A, 5)
    replication.on_appended(B, 5)
    assert replication.high_water_mark == 5 and replication.window_start == 5
    # 2..4 from a writer's storage (fewer than catch_up_batch), then 5 from memory
    assert replication.next_send(C) == CatchUp(2, 3, (A, B))


def test_catch_up_waits_when_no_writer_holds_the_records() -> None:
    replication = core(max_window_bytes=10)
    replication.join(A, -1)
    replication.join(B, -1)
    add(replication, 3)
    send(replication, A)
    send(replication, B)
    replication.on_appended(A, 2)
    replication.on_appended(B, 2)
    replication.leave(A)
    replication.leave(B)
    replication.join(C, -1)
    assert replication.next_send(C) is None  # a and b left: nobody to read from
    replication.join(A, 2)
    assert replication.next_send(C) == CatchUp(0, 3, (A,))


def test_random_operations_keep_the_commit_rule() -> None:
    """Under random appends, sends, acknowledgements, leaves and rejoins: the
    high-water mark only grows, every committed record was acknowledged by a quorum
    when it was committed, commits come in order and exactly once."""
    for seed in range(40):
        rng = random.Random(seed)
        replication = core(
            max_batch_records=rng.randint(1, 4),
            max_inflight_batches=rng.randint(1, 3),
            max_window_bytes=rng.choice((20, 1000)),
            catch_up_batch=rng.randint(1, 3),
        )
        held: dict[str, int] = {}  # what each replica's storage holds (a prefix)
        inflight: dict[str, list[int]] = {n: [] for n in (A, B, C)}
        for node in (A, B, C):
            replication.join(node, -1)
            held[node] = -1
        delivered: list[int] = []
        for _ in range(400):
            op = rng.random()
            node = rng.choice((A, B, C))
            progress = replication.progress(node)
            assert progress is not None
            if op < 0.3 and replication.has_room():
                add(replication, rng.randint(1, 3))
            elif op < 0.6 and progress.writing:
                action = replication.next_send(node)
                if isinstance(action, CatchUp):
                    source = rng.choice(action.sources)
                    assert held[source] >= action.start
                    end = min(action.start + action.count - 1, held[source])
                    records = [
                        Record(i, ReqId(1, 1, 0, i), 0, b"", 0)
                        for i in range(action.start, end + 1)
                    ]
                    action = replication.caught_up_read(node, records)
                if isinstance(action, Send):
                    inflight[node].append(action.last_transaction_id)
            elif op < 0.9 and inflight[node]:
                last = inflight[node].pop(0)
                held[node] = last
                committed = replication.on_appended(node, last)
                if committed is not None:
                    mark = committed.high_water_mark
                    assert sum(1 for h in held.values() if h >= mark) >= 2
                    delivered.extend(ids(committed.records))
            elif progress.writing:
                replication.leave(node)
                inflight[node] = []  # the storage may still hold them; rejoin decides
                replication.join(node, held[node])
        assert delivered == list(range(len(delivered)))
        assert replication.high_water_mark == len(delivered) - 1


def info(session_id: int, low_water_mark: int, marks_session: int | None = None) -> SessionInfo:
    """Session info whose marks ``marks_session`` wrote (default: the fence's session)."""
    written = session_id if marks_session is None else marks_session
    return SessionInfo(session_id, low_water_mark, low_water_mark, written)


@pytest.mark.parametrize(
    ("storage", "max_id", "expected"),
    [
        # the storage that acknowledged: keep what it acknowledged, cut the in-flight rest
        (info(7, 20), 35, (30, False, 30)),
        (info(7, 20), 30, (None, False, 30)),
        # it holds less than it acknowledged: the storage changed (a restore)
        (info(7, 20), 25, (20, True, 20)),
        # an older session's storage (restored from a backup): its own low-water mark
        (info(5, 12), 40, (12, True, 12)),
        (info(5, 12), 9, (None, True, 9)),
        # wiped
        (SessionInfo(), -1, (None, True, -1)),
        # the fence of this session with another session's low-water mark
        (info(7, 15), 33, (15, True, 15)),
        # ... even when that mark equals this session's: a restore of a backup taken
        # after this session raised the fence and before it wrote its marks
        (info(7, 20, marks_session=6), 33, (20, True, 20)),
        # the engine found it lost acknowledged records
        (info(7, 20, marks_session=LOST_SESSION), 33, (20, True, 20)),
        # an engine that does not keep the marks' session: judged by the fence
        (info(7, 20, marks_session=NO_SESSION), 35, (30, False, 30)),
    ],
)
def test_plan_rejoin(
    storage: SessionInfo, max_id: int, expected: tuple[int | None, bool, int]
) -> None:
    plan = plan_rejoin(
        session_id=7, low_water_mark=20, acked=30, storage=storage, max_transaction_id=max_id
    )
    assert (plan.truncate_to, plan.suspect, plan.mark) == expected


def test_a_rejoin_that_lost_acknowledged_records_is_suspect_until_caught_up() -> None:
    """Issue 27: its earlier acknowledgements stop counting, and it is due to be marked
    clean only once it holds everything that was committed when it rejoined."""
    replication = Replication(replicas=["a", "b", "c"], low_water_mark=-1)
    for node in ("a", "b", "c"):
        replication.join(node, -1)
    for i in range(10):
        replication.append(ReqId(1, 1, 0, i), 0, b"x", 0)
    for node in ("a", "b"):
        send = replication.next_send(node)
        assert isinstance(send, Send)
        replication.on_appended(node, send.last_transaction_id)
    assert replication.high_water_mark == 9
    replication.leave("a")
    # a comes back with nothing (a wiped disk): it joins at -1 as a suspect
    replication.join("a", -1, suspect=True)
    assert replication.suspects == ["a"]
    assert replication.clean_due("a") is None
    # its old acknowledgement no longer counts: with c behind, new records wait for it
    replication.append(ReqId(1, 1, 0, 10), 0, b"x", 0)
    send = replication.next_send("b")
    assert isinstance(send, Send)
    assert replication.on_appended("b", send.last_transaction_id) is None
    assert replication.high_water_mark == 9
    send = replication.next_send("a")
    assert isinstance(send, Send) and send.records[0].transaction_id == 0
    last = send.last_transaction_id
    replication.on_appended("a", last)
    if last < 9:
        assert replication.clean_due("a") is None
    while replication.clean_due("a") is None:
        send = replication.next_send("a")
        assert isinstance(send, Send)
        replication.on_appended("a", send.last_transaction_id)
    assert replication.clean_due("a") >= 9
    replication.marked_clean("a")
    assert replication.suspects == [] and replication.clean_due("a") is None
