"""Recovery voting against a brute-force model: every completion of the offline replicas."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz_api.errors import WaltzError
from waltz_api.types import UNRESOLVED
from waltz_server.server.voting import (
    Outcome,
    plan_replica,
    quorum_of,
    resolve_high_water_mark,
    votes_for,
)

DOMAIN = range(-1, 5)  # log ends: -1 (empty) .. 4


def true_high_water_mark(marks: list[int], quorum: int) -> int | None:
    """The highest mark a quorum of these complete logs holds (None: none has a quorum)."""
    best = None
    for candidate in set(marks):
        if votes_for(marks, candidate) >= quorum and (best is None or candidate > best):
            best = candidate
    return best


def model(online: list[int], num_offline: int, quorum: int) -> set[int | None]:
    """Every answer the offline replicas could still produce (they may hold anything,
    including more than any online replica)."""
    wide = range(-1, 7)
    return {
        true_high_water_mark([*online, *offline], quorum)
        for offline in itertools.product(wide, repeat=num_offline)
    }


def check_against_model(online: list[int], num_offline: int, floor: int | None) -> None:
    quorum = quorum_of(len(online) + num_offline)
    answers = model(online, num_offline, quorum)
    result = resolve_high_water_mark(online, num_offline, quorum, floor)
    if result.outcome is Outcome.DECIDED:
        # decided only when every completion agrees, on that mark, and it is not below the floor
        assert answers == {result.high_water_mark}, (online, num_offline, answers, result)
        assert result.high_water_mark in online
        assert floor is None or result.high_water_mark >= floor
        # a quorum of the online replicas actually holds it (every log holds the empty prefix)
        if result.high_water_mark != -1:
            assert votes_for(online, result.high_water_mark) >= quorum
    elif result.outcome is Outcome.UNDECIDABLE:
        assert len(answers) > 1, (online, num_offline, answers)
    else:
        assert floor is not None or online
        undecided = len(answers) > 1
        below_floor = (
            len(answers) == 1
            and floor is not None
            and (next(iter(answers)) is None or next(iter(answers)) < floor)  # type: ignore[operator]
        )
        assert undecided or below_floor, (online, num_offline, floor, answers)
    if floor is None and online and len(answers) == 1:
        # without a floor, a decidable situation is always decided
        assert result.outcome is Outcome.DECIDED, (online, num_offline, answers, result)


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4, 5])
def test_exhaustive_against_brute_force_model(num_replicas: int) -> None:
    checked = 0
    for num_offline in range(num_replicas + 1):
        for online in itertools.combinations_with_replacement(DOMAIN, num_replicas - num_offline):
            for floor in (None, *DOMAIN):
                check_against_model(list(online), num_offline, floor)
                checked += 1
    assert checked > 0


@settings(max_examples=300, deadline=None)
@given(
    online=st.lists(st.integers(-1, 6), min_size=0, max_size=5),
    num_offline=st.integers(0, 3),
    floor=st.none() | st.integers(-1, 6),
)
def test_random_against_brute_force_model(
    online: list[int], num_offline: int, floor: int | None
) -> None:
    if len(online) + num_offline == 0:
        return
    check_against_model(online, num_offline, floor)


def test_spec_example_replica_b_offline_is_undecidable() -> None:
    # spec: A holds H_A, B (offline) holds H_B > H_A, C holds H_C < H_A; quorum 2
    h_c, h_a = 10, 20
    assert resolve_high_water_mark([h_a, h_c], 1, 2).outcome is Outcome.UNDECIDABLE
    # B comes back: H_A is the highest mark a majority holds
    result = resolve_high_water_mark([h_a, 30, h_c], 0, 2)
    assert result.decided and result.high_water_mark == h_a
    # or C catches up with A: decidable again, without B
    result = resolve_high_water_mark([h_a, h_a], 1, 2)
    assert result.decided and result.high_water_mark == h_a


def test_floor_makes_lagging_replicas_catch_up_first() -> None:
    # a voter at 10 and two clean replicas at 5: 5 has a quorum but is below the voter
    assert resolve_high_water_mark([10, 5, 5], 0, 2, floor=10).outcome is Outcome.WAITING
    result = resolve_high_water_mark([10, 10, 5], 0, 2, floor=10)
    assert result.decided and result.high_water_mark == 10


def test_quorum_of() -> None:
    assert [quorum_of(n) for n in range(1, 7)] == [1, 2, 2, 3, 3, 4]
    with pytest.raises(WaltzError):
        quorum_of(0)
    with pytest.raises(WaltzError):
        resolve_high_water_mark([1], 0, 0)
    with pytest.raises(WaltzError):
        resolve_high_water_mark([1], -1, 1)


def plan(**kw: int | bool) -> tuple[int | None, bool, bool]:
    args: dict[str, int | bool] = {
        "known": True,
        "metadata_empty": False,
        "state_session_id": 5,
        "state_closing_high_water_mark": UNRESOLVED,
        "storage_session_id": 5,
        "storage_low_water_mark": 10,
        "max_transaction_id": 20,
    }
    args.update(kw)
    p = plan_replica(**args)  # type: ignore[arg-type]
    return p.truncate_to, p.voting, p.new


def test_plan_replica_cases() -> None:
    # clean at the last session's start: votes with its whole log
    assert plan() == (None, True, False)
    # missed the end of its session: truncated to the closing mark, no vote
    assert plan(state_closing_high_water_mark=15) == (15, False, False)
    # storage older than the metadata: back to its own low-water mark
    assert plan(storage_session_id=3) == (10, False, False)
    # behind the last session's start: no vote, catches up
    assert plan(max_transaction_id=7) == (None, False, False)
    # a replica added since: truncated to its low-water mark, new
    assert plan(known=False) == (10, False, True)
    # a brand-new partition: everybody votes
    assert plan(
        known=False, metadata_empty=True, storage_session_id=-1, storage_low_water_mark=-1
    ) == (None, True, False)
    p = plan_replica(
        known=True,
        metadata_empty=False,
        state_session_id=1,
        state_closing_high_water_mark=3,
        storage_session_id=1,
        storage_low_water_mark=0,
        max_transaction_id=9,
    )
    assert p.mark_after(9) == 3 and p.mark_after(2) == 2


def test_online_replicas_all_below_the_floor_wait_even_with_a_quorum_offline() -> None:
    # Nobody online: what the offline replicas hold decides (UNDECIDABLE). Replicas
    # online but every one below the floor: they must catch up first (WAITING), even
    # when the offline ones alone could form a quorum.
    assert resolve_high_water_mark([], 2, 2, floor=10).outcome is Outcome.UNDECIDABLE
    assert resolve_high_water_mark([5], 2, 2, floor=10).outcome is Outcome.WAITING
    assert resolve_high_water_mark([5, 3], 3, 3, floor=10).outcome is Outcome.WAITING
    assert resolve_high_water_mark([5], 1, 2, floor=10).outcome is Outcome.WAITING
