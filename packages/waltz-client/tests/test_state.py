"""The pure state machines of the client, alone."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz_api.errors import ClientError
from waltz_api.messages import MountStatus
from waltz_api.types import ReqId
from waltz_client.state import (
    ApplyDecision,
    ApplyFailures,
    ConcurrencyLimit,
    FeedAction,
    FeedTracker,
    MountDecision,
    MountSequencer,
    MountState,
    Outcome,
    RetryQueue,
    RunningSubmissions,
    TransactionDataCache,
    TransactionMonitor,
)


def rid(seq: int, generation: int = 1, partition: int = 0) -> ReqId:
    return ReqId(7, generation, partition, seq)


# -- transaction monitor ------------------------------------------------------------------------


def test_monitor_commit_fails_every_older_pending_and_keeps_newer() -> None:
    m = TransactionMonitor()
    for seq in range(1, 6):
        m.register(rid(seq))
    resolved = m.on_feed(rid(3), 42)
    assert [(r.req_id.seq_num, r.outcome) for r in resolved] == [
        (1, Outcome.FAILED),
        (2, Outcome.FAILED),
        (3, Outcome.COMMITTED),
    ]
    assert resolved[-1].transaction_id == 42
    assert m.pending == (rid(4), rid(5))
    assert m.on_feed(rid(3), 43) == []  # resolved already: another client's look-alike
    assert m.on_feed(ReqId(8, 1, 0, 4), 44) == []  # another client's transaction


def test_monitor_lock_failure_and_refusal_touch_only_their_request() -> None:
    m = TransactionMonitor()
    for seq in (1, 2, 3):
        m.register(rid(seq))
    (lock,) = m.on_lock_failure(rid(2), 17)
    assert lock.outcome is Outcome.LOCK_FAILED and lock.transaction_id == 17
    (refused,) = m.on_refused(rid(3))
    assert refused.outcome is Outcome.FAILED
    assert m.pending == (rid(1),)
    assert m.on_lock_failure(rid(2), 17) == []
    assert [r.outcome for r in m.fail_all()] == [Outcome.FAILED]
    assert len(m) == 0


def test_monitor_a_flush_decides_every_append_sent_before_it_and_nothing_after() -> None:
    m = TransactionMonitor()
    m.register(rid(1))
    m.register(rid(2))
    m.register(rid(3))
    mark = m.flush_mark()  # the FlushRequest goes out now
    m.register(rid(4))
    assert [r.req_id for r in m.on_refused(rid(2), "refused: X")] == [rid(2)]
    assert m.order_of(rid(1)) == 1 and m.order_of(rid(2)) is None
    flushed = m.on_flushed(mark, 9)
    assert [(r.req_id, r.outcome) for r in flushed] == [
        (rid(1), Outcome.FAILED),
        (rid(3), Outcome.FAILED),
    ]
    assert all("not in the log up to transaction 9" in r.reason for r in flushed)
    assert m.pending == (rid(4),)
    assert m.on_flushed(mark, 9) == []  # decided once
    assert [r.req_id for r in m.on_flushed(m.flush_mark(), 10)] == [rid(4)]


def test_monitor_says_why_each_append_was_decided() -> None:
    m = TransactionMonitor()
    for seq in range(1, 6):
        m.register(rid(seq))
    superseded, _ = m.on_feed(rid(2), 7)
    assert "a later append of this client (transaction 7) committed first" in superseded.reason
    (lock,) = m.on_lock_failure(rid(3), 6)
    assert "lock check: transaction 6" in lock.reason
    (refused,) = m.on_refused(rid(4), "the server decided: not committed (NOT_COMMITTED: x)")
    assert "NOT_COMMITTED" in refused.reason
    (remounted,) = m.fail_all()
    assert "mounted again" in remounted.reason


def test_monitor_refuses_a_duplicate_registration() -> None:
    m = TransactionMonitor()
    m.register(rid(1))
    with pytest.raises(ClientError, match="registered already"):
        m.register(rid(1))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=30),
    st.lists(st.tuples(st.sampled_from(["feed", "lock", "mount", "flush"]), st.integers(0, 40))),
)
def test_monitor_resolves_each_request_exactly_once_in_order(
    n: int, events: list[tuple[str, int]]
) -> None:
    """Any sequence of feed items, lock failures, mounts and flushes: each registered
    request is resolved at most once; a commit resolves all older pending ones, a flush
    all pending ones sent before it; nothing newer."""
    m = TransactionMonitor()
    reqs = [rid(s) for s in range(1, n + 1)]
    for req in reqs:
        m.register(req)
    seen: dict[ReqId, Outcome] = {}
    tid = 0
    for kind, k in events:
        target = reqs[k % n]
        before = m.pending
        if kind == "feed":
            resolved = m.on_feed(target, tid)
            tid += 1
            if target in before:
                idx = before.index(target)
                assert [r.req_id for r in resolved] == list(before[: idx + 1])
                assert all(r.outcome is Outcome.FAILED for r in resolved[:-1])
                assert resolved[-1].outcome is Outcome.COMMITTED
            else:
                assert resolved == []
        elif kind == "lock":
            resolved = m.on_lock_failure(target, k)
            assert [r.req_id for r in resolved] == ([target] if target in before else [])
        elif kind == "flush":
            mark = k % n + 1  # the flush went out after the first ``mark`` registrations
            resolved = m.on_flushed(mark, tid)
            assert [r.req_id for r in resolved] == [r for r in before if r in reqs[:mark]]
            assert all(r.outcome is Outcome.FAILED for r in resolved)
        else:
            resolved = m.fail_all()
            assert [r.req_id for r in resolved] == list(before)
        for res in resolved:
            assert res.req_id not in seen, "resolved twice"
            seen[res.req_id] = res.outcome
        assert set(m.pending) == set(before) - {res.req_id for res in resolved}
    assert set(seen) | set(m.pending) == set(reqs)


def test_concurrency_limit_takes_a_free_slot_without_a_waiter() -> None:
    limit: ConcurrencyLimit[str] = ConcurrencyLimit(1)
    assert limit.try_acquire_free() and limit.in_use == 1
    assert not limit.try_acquire_free()  # full
    assert not limit.try_acquire("a")  # queued
    assert limit.release() == "a"  # handed over: still one in use
    assert not limit.try_acquire_free() and limit.in_use == 1
    assert limit.release() is None and limit.in_use == 0
    assert limit.try_acquire_free()


def test_running_submissions_tell_a_flush_when_those_before_it_are_done() -> None:
    running = RunningSubmissions()
    first, second = running.start(), running.start()
    mark = running.mark  # a flush now covers both
    third = running.start()
    assert running.running_up_to(mark) == 2
    running.finish(second)
    assert running.running_up_to(mark) == 1
    running.finish(third)  # started after the flush: not waited for
    assert running.running_up_to(mark) == 1
    running.finish(first)
    assert running.running_up_to(mark) == 0 and len(running) == 0
    assert running.running_up_to(running.mark) == 0


# -- poison transactions ----------------------------------------------------------------------


def test_apply_failures_retry_a_transaction_then_give_up_on_it() -> None:
    f = ApplyFailures(2)
    assert [f.on_failure(5) for _ in range(3)] == [
        ApplyDecision.RETRY,
        ApplyDecision.RETRY,
        ApplyDecision.GIVE_UP,
    ]
    assert f.on_failure(5) is ApplyDecision.GIVE_UP  # offered again later: given up at once
    assert f.on_failure(7) is ApplyDecision.RETRY  # another transaction counts on its own
    assert f.failures == 1
    assert f.on_applied(6) is False  # not past the failing one
    assert f.on_applied(7) is True and f.failures == 0  # it went through: start over
    assert f.on_failure(5) is ApplyDecision.RETRY  # forgotten once the feed passed it
    with pytest.raises(ClientError, match="apply_retries"):
        ApplyFailures(-1)
    zero = ApplyFailures(0)
    assert zero.on_failure(0) is ApplyDecision.GIVE_UP


# -- feed tracker ------------------------------------------------------------------------------


def test_feed_tracker_applies_after_the_application_mark_and_skips_below() -> None:
    f = FeedTracker()
    assert f.start_mount(4) == 4
    assert f.classify(4) is FeedAction.DUPLICATE
    assert f.classify(6) is FeedAction.GAP
    assert f.classify(5) is FeedAction.APPLY
    f.advance(5)
    # another instance sharing the database applied up to 9; this client has seen 5
    assert f.start_mount(9) == 5  # mount from the client's own position: it sees 6..9
    assert f.classify(6) is FeedAction.SKIP  # monitored, not applied
    for t in range(6, 10):
        f.advance(t)
    assert f.classify(10) is FeedAction.APPLY
    # the application lost progress (restored backup): re-applied from its mark
    assert f.start_mount(2) == 2
    assert f.classify(3) is FeedAction.APPLY
    with pytest.raises(ClientError, match="in order"):
        f.advance(5)
    with pytest.raises(ClientError, match="must be -1"):
        f.start_mount(-2)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(-1, 20),
    st.lists(st.one_of(st.integers(0, 60), st.tuples(st.just("mount"), st.integers(-1, 60)))),
)
def test_feed_tracker_applies_each_id_once_in_order(
    start: int, script: list[int | tuple[str, int]]
) -> None:
    """Whatever the feed replays, skips or repeats, and whatever application mark each
    mount reads: applied ids are increasing by one above the application's mark."""
    f = FeedTracker()
    app_mark = start
    f.start_mount(app_mark)
    for step in script:
        if isinstance(step, tuple):
            # the application's mark moves either way: another instance sharing its
            # database applied more, or it lost progress (a restored backup)
            before = f.position
            app_mark = step[1]
            assert f.start_mount(app_mark) == min(before, app_mark)
            continue
        action = f.classify(step)
        if action is FeedAction.APPLY:
            assert step == app_mark + 1
            app_mark = step
            f.advance(step)
        elif action is FeedAction.SKIP:
            assert step <= app_mark
            f.advance(step)
        elif action is FeedAction.DUPLICATE:
            assert step <= f.position
        else:
            assert step > f.position + 1


# -- retry queue -------------------------------------------------------------------------------


def test_retry_queue_waits_for_mount_and_for_the_failing_transaction() -> None:
    q: RetryQueue[str] = RetryQueue()
    q.add("plain")
    q.add("lock@10", wait_for=10)
    q.add("lock@5", wait_for=5)
    assert q.release(20, appends_allowed=False) == []  # mounting: nothing retries
    assert q.release(4, appends_allowed=True) == ["plain"]
    assert q.release(7, appends_allowed=True) == ["lock@5"]
    assert q.release(9, appends_allowed=True) == []
    q.add("later", wait_for=3)
    assert q.release(10, appends_allowed=True) == ["lock@10", "later"]  # failure order
    assert len(q) == 0
    q.add("x", wait_for=99)
    q.add("y")
    assert q.drain() == ["y", "x"] and len(q) == 0


# -- concurrency limit -------------------------------------------------------------------------


def test_concurrency_limit_is_fifo_and_hands_slots_over() -> None:
    limit: ConcurrencyLimit[str] = ConcurrencyLimit(2)
    assert limit.try_acquire("a") and limit.try_acquire("b")
    assert not limit.try_acquire("c")
    assert not limit.try_acquire("d")
    assert limit.waiting == 2
    assert limit.release() == "c"  # the slot passes to c directly
    assert limit.in_use == 2
    assert limit.cancel("d") and not limit.cancel("d")
    assert not limit.try_acquire("e")
    assert limit.drain() == ["e"] and limit.waiting == 0
    assert limit.release() is None and limit.release() is None
    assert limit.in_use == 0
    with pytest.raises(ClientError, match="without a slot"):
        limit.release()
    with pytest.raises(ClientError, match="at least 1"):
        ConcurrencyLimit(0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.lists(st.booleans(), max_size=60))
def test_concurrency_limit_never_exceeds_its_bound(limit_n: int, ops: list[bool]) -> None:
    limit: ConcurrencyLimit[int] = ConcurrencyLimit(limit_n)
    holders: list[int] = []
    queued: list[int] = []
    for i, acquire in enumerate(ops):
        if acquire:
            if limit.try_acquire(i):
                holders.append(i)
            else:
                queued.append(i)
        elif holders:
            holders.pop(0)
            handed = limit.release()
            if handed is not None:
                assert handed == queued.pop(0)  # first come, first served
                holders.append(handed)
        assert len(holders) == limit.in_use <= limit_n
        assert limit.waiting == len(queued)
        assert not queued or limit.in_use == limit_n


# -- mount sequencing --------------------------------------------------------------------------


def state(m: MountSequencer) -> MountState:
    return m.state  # read through a call: mypy must not narrow it between steps


def test_mount_sequence_blocks_appends_until_ready() -> None:
    m = MountSequencer()
    assert state(m) is MountState.UNASSIGNED and not m.appends_allowed
    assert m.on_assignment("tcp://a", 1)
    m.begin_mount(rid(1), network_seq_num=1)
    assert state(m) is MountState.MOUNTING and not m.appends_allowed
    assert m.on_mount_response(rid(99), MountStatus.READY) is MountDecision.IGNORE
    assert m.on_mount_response(rid(1), MountStatus.READY) is MountDecision.READY
    assert m.appends_allowed
    assert m.on_mount_response(rid(1), MountStatus.READY) is MountDecision.IGNORE
    # reconnect: blocked again, mounted again with a new network client
    assert m.on_disconnect()
    assert not m.appends_allowed
    m.begin_mount(rid(2), network_seq_num=2)
    assert m.on_mount_response(rid(2), MountStatus.NOT_READY) is MountDecision.RETRY
    assert state(m) is MountState.UNMOUNTED
    m.begin_mount(rid(3), network_seq_num=2)
    assert m.on_mount_refused(rid(3)) is MountDecision.RETRY
    m.begin_mount(rid(4), network_seq_num=2)
    assert m.on_mount_response(rid(4), MountStatus.CLIENT_AHEAD) is MountDecision.CLIENT_AHEAD
    assert state(m) is MountState.FAILED
    assert not m.on_assignment("tcp://b", 5)  # a configuration error is final
    assert not m.on_disconnect()


def test_mount_sequence_follows_newer_generations_only() -> None:
    m = MountSequencer()
    assert m.on_assignment("tcp://a", 2)
    m.begin_mount(rid(1, generation=2), 1)
    m.on_mount_response(rid(1, generation=2), MountStatus.READY)
    assert not m.on_assignment("tcp://old", 1)  # late read of an older assignment
    assert not m.on_assignment("tcp://a", 2)  # unchanged
    assert m.appends_allowed
    assert m.on_assignment("tcp://b", 3)
    assert state(m) is MountState.UNMOUNTED and m.endpoint == "tcp://b"
    with pytest.raises(ClientError, match="generation 2"):
        m.begin_mount(rid(2, generation=2), 1)
    assert not m.on_assignment("", 4)  # unassigned: nothing to mount
    assert state(m) is MountState.UNASSIGNED
    with pytest.raises(ClientError, match="state unassigned"):
        m.begin_mount(rid(3, generation=4), 1)


# -- data cache --------------------------------------------------------------------------------


def test_cache_is_bounded_in_bytes_and_least_recently_used_goes_first() -> None:
    c: TransactionDataCache[int] = TransactionDataCache(10)
    c.put(1, b"aaaa")
    c.put(2, b"bbbb")
    assert c.get(1) == b"aaaa"  # 1 is now the most recent
    c.put(3, b"cccc")  # 12 bytes > 10: 2 goes
    assert 2 not in c and c.get(2) is None
    assert c.size == 8 and len(c) == 2
    c.put(4, b"x" * 11)  # larger than the cache: never cached, nothing evicted
    assert 4 not in c and len(c) == 2
    c.put(1, b"a")  # replacing an entry adjusts the size
    assert c.size == 5
    assert (c.hits, c.misses) == (1, 1)
    with pytest.raises(ClientError, match=">= 0 bytes"):
        TransactionDataCache(-1)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 64), st.lists(st.tuples(st.integers(0, 9), st.binary(max_size=20))))
def test_cache_size_always_matches_its_entries_and_bound(
    bound: int, puts: list[tuple[int, bytes]]
) -> None:
    c: TransactionDataCache[int] = TransactionDataCache(bound)
    last: dict[int, bytes] = {}
    for key, data in puts:
        c.put(key, data)
        last[key] = data
        assert c.size <= bound
        assert c.size == sum(len(c._entries[k]) for k in c._entries)
        for k in c._entries:
            assert c._entries[k] == last[k]  # never a stale value
    if puts and len(puts[-1][1]) <= bound:
        assert puts[-1][0] in c  # the newest fitting entry stays
