"""The LockTable conformance suite.

A backend author subclasses :class:`LockTableSuite` and provides a ``harness``
fixture returning a :class:`LockTableHarness`::

    class TestMyLockTable(LockTableSuite):
        @pytest.fixture
        def harness(self) -> LockTableHarness:
            return LockTableHarness(name="mine", factory=MyLockTable)

Every table is checked against an exact model (:class:`ExactModel`): its
estimate is never below the model's (no false negative) and never above the
highest id it was given (a client that has seen everything always passes).
A table that declares the capability ``"exact"`` must equal the model.
"""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from waltz_api.capabilities import BOUNDED_MEMORY as BOUNDED_MEMORY  # noqa: PLC0414 (re-exported for plugin authors)
from waltz_api.capabilities import EXACT as EXACT  # noqa: PLC0414 (re-exported for plugin authors)
from waltz_api.contracts import LockTable
from waltz_api.hookspecs import PluginDescriptor
from waltz_api.types import NO_TRANSACTION, Lock, LockMode, LockRequest
from waltz_conformance.harness import Harness, requires, skip_unless_capable

LockTableFactory = Callable[[int, Mapping[str, Any]], LockTable]


@dataclass(kw_only=True)
class LockTableHarness(Harness):
    """How the suite builds the backend's lock tables.

    ``factory(high_water_mark, options)`` returns a new table; ``options`` are
    passed to every table the suite builds.
    """

    factory: LockTableFactory
    options: Mapping[str, Any] = field(default_factory=dict)

    def make(self, high_water_mark: int = NO_TRANSACTION) -> LockTable:
        table = self.factory(high_water_mark, dict(self.options))
        if not isinstance(table, LockTable):
            raise TypeError(
                f"the {self.name} factory returned {type(table).__name__}, not a LockTable"
            )
        return table

    @classmethod
    def from_descriptor(
        cls,
        descriptor: PluginDescriptor,
        options: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
    ) -> LockTableHarness:
        """A harness for an installed lock-table plugin (its declared capabilities)."""
        return cls(
            name=name or descriptor.name,
            factory=descriptor.factory,
            capabilities=descriptor.capabilities,
            options=dict(options or {}),
        )


class ExactModel:
    """The truth: the last WRITE/APPEND id of every lock hash since the last reset."""

    def __init__(self, high_water_mark: int = NO_TRANSACTION) -> None:
        self.floor = high_water_mark
        self.last: dict[int, int] = {}
        self.high_water_mark = high_water_mark

    def estimate(self, request: LockRequest) -> int:
        result = NO_TRANSACTION
        for lock_hash in (*request.read, *request.write):
            result = max(result, self.last.get(lock_hash, self.floor))
        return result

    def record(self, request: LockRequest, transaction_id: int) -> None:
        for lock_hash in (*request.write, *request.append):
            self.last[lock_hash] = max(transaction_id, self.last.get(lock_hash, self.floor))
        self.high_water_mark = max(self.high_water_mark, transaction_id)

    def reset(self, high_water_mark: int) -> None:
        self.floor = high_water_mark
        self.high_water_mark = high_water_mark
        self.last.clear()


def lock_universe(names: Sequence[str] = ("account", "user", "order"), ids: int = 6) -> list[Lock]:
    """Locks with real names and ids (hashed by :func:`waltz_api.types.lock_hash`)."""
    return [Lock(name, lock_id) for name in names for lock_id in range(ids)]


EXTREME_HASHES = (0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 0xFFFFFFFF00000000)
"""Lock hashes at the edges of the unsigned 64-bit range."""


def request_of(
    read: Iterable[int] = (), write: Iterable[int] = (), append: Iterable[int] = ()
) -> LockRequest:
    return LockRequest(tuple(read), tuple(write), tuple(append))


def assert_agrees(
    table: LockTable,
    model: ExactModel,
    request: LockRequest,
    client_high_water_mark: int,
    *,
    exact: bool,
    where: str = "",
) -> int | None:
    """Check ``table`` against ``model`` on one request; return the table's check result."""
    expected = model.estimate(request)
    estimate = table.estimate(request)
    context = f"{where}request={request!r} client_hwm={client_high_water_mark}"
    assert estimate >= expected, (
        f"false negative: estimate {estimate} is below the last change {expected}; {context}"
    )
    if request.read or request.write:
        assert estimate <= model.high_water_mark, (
            f"estimate {estimate} is above every id the table was given "
            f"({model.high_water_mark}): a caught-up client would never pass; {context}"
        )
    else:
        assert estimate == NO_TRANSACTION, (
            f"a request without READ/WRITE locks must estimate {NO_TRANSACTION}, "
            f"got {estimate}; {context}"
        )
    if exact:
        assert estimate == expected, (
            f"false positive in an exact table: estimate {estimate}, truth {expected}; {context}"
        )
    result = table.check(request, client_high_water_mark)
    checked = bool(request.read or request.write)
    if checked and expected > client_high_water_mark:
        assert result is not None, f"a real conflict passed the check; {context}"
    if result is None:
        assert not checked or estimate <= client_high_water_mark, (
            f"check passed but the estimate {estimate} is above the client; {context}"
        )
    else:
        assert checked, f"a request without READ/WRITE locks failed the check; {context}"
        assert result == estimate, (
            f"check failed with {result}, which is not the estimate {estimate}; {context}"
        )
        assert result > client_high_water_mark, (
            f"check failed with {result}, not above the client's {client_high_water_mark}"
        )
    return result


def random_request(rng: random.Random, hashes: Sequence[int], max_locks: int = 4) -> LockRequest:
    read: list[int] = []
    write: list[int] = []
    append: list[int] = []
    for _ in range(rng.randint(0, max_locks)):
        lock_hash = rng.choice(hashes)
        rng.choice((read, write, append)).append(lock_hash)
    return request_of(read, write, append)


def run_random_workload(
    harness: LockTableHarness,
    seed: int,
    *,
    steps: int,
    distinct_locks: int,
    start: int = NO_TRANSACTION,
) -> None:
    """A server's append path on random requests, with recoveries, against the model."""
    rng = random.Random(seed)
    hashes = [rng.getrandbits(64) for _ in range(distinct_locks)]
    table = harness.make(start)
    model = ExactModel(start)
    high_water_mark = start
    exact = EXACT in harness.capabilities
    for step in range(steps):
        request = random_request(rng, hashes)
        client = rng.randint(max(NO_TRANSACTION, high_water_mark - 8), high_water_mark)
        result = assert_agrees(table, model, request, client, exact=exact, where=f"step {step}: ")
        if result is None:
            high_water_mark += 1
            table.record(request, high_water_mark)
            model.record(request, high_water_mark)
        if rng.random() < 0.01:
            # Recovery: in-flight transactions (recorded, never committed) are lost.
            high_water_mark = rng.randint(max(NO_TRANSACTION, high_water_mark - 3), high_water_mark)
            table.reset(high_water_mark)
            model.reset(high_water_mark)


# -- the hypothesis state machine --------------------------------------------------

_MACHINE_LOCKS = lock_universe(ids=4)
_MACHINE_HASHES = [lock.hash for lock in _MACHINE_LOCKS] + list(EXTREME_HASHES)
_locks_in_request = st.lists(
    st.tuples(st.sampled_from(_MACHINE_HASHES), st.sampled_from(list(LockMode))),
    max_size=5,
)


def _request_from(pairs: Sequence[tuple[int, LockMode]]) -> LockRequest:
    return request_of(
        (h for h, mode in pairs if mode is LockMode.READ),
        (h for h, mode in pairs if mode is LockMode.WRITE),
        (h for h, mode in pairs if mode is LockMode.APPEND),
    )


def lock_table_machine(harness: LockTableHarness) -> type[RuleBasedStateMachine]:
    """A state machine driving a table of ``harness`` beside the exact model."""

    class LockTableMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.table: LockTable | None = None
            self.model = ExactModel()
            self.high_water_mark = NO_TRANSACTION
            self.exact = EXACT in harness.capabilities

        @initialize(start=st.integers(min_value=NO_TRANSACTION, max_value=1000))
        def open_partition(self, start: int) -> None:
            self.table = harness.make(start)
            self.model = ExactModel(start)
            self.high_water_mark = start

        def _table(self) -> LockTable:
            assert self.table is not None
            return self.table

        @rule(pairs=_locks_in_request, lag=st.integers(min_value=0, max_value=6))
        def append(self, pairs: list[tuple[int, LockMode]], lag: int) -> None:
            """A client at ``hwm - lag`` appends; a passing request is recorded."""
            request = _request_from(pairs)
            client = max(NO_TRANSACTION, self.high_water_mark - lag)
            result = assert_agrees(self._table(), self.model, request, client, exact=self.exact)
            if result is None:
                self.high_water_mark += 1
                self._table().record(request, self.high_water_mark)
                self.model.record(request, self.high_water_mark)

        @rule(pairs=_locks_in_request)
        def record_unchecked(self, pairs: list[tuple[int, LockMode]]) -> None:
            """An id is assigned (and its locks recorded) whatever the check said."""
            request = _request_from(pairs)
            self.high_water_mark += 1
            self._table().record(request, self.high_water_mark)
            self.model.record(request, self.high_water_mark)

        @rule(lost=st.integers(min_value=0, max_value=3))
        def recover(self, lost: int) -> None:
            """Recovery: up to ``lost`` in-flight transactions never committed."""
            self.high_water_mark = max(NO_TRANSACTION, self.high_water_mark - lost)
            self._table().reset(self.high_water_mark)
            self.model.reset(self.high_water_mark)

        @precondition(lambda self: self.table is not None)
        @invariant()
        def every_lock_agrees(self) -> None:
            table = self._table()
            for lock_hash in _MACHINE_HASHES:
                for request in (request_of(read=[lock_hash]), request_of(write=[lock_hash])):
                    estimate = table.estimate(request)
                    truth = self.model.estimate(request)
                    assert truth <= estimate <= self.model.high_water_mark, (
                        f"lock hash {lock_hash:#x}: estimate {estimate}, truth {truth}, "
                        f"high-water mark {self.model.high_water_mark}"
                    )
                    if self.exact:
                        assert estimate == truth

    LockTableMachine.__name__ = f"LockTableMachine[{harness.name}]"
    return LockTableMachine


class LockTableSuite:
    """The LockTable contract. Subclass it and provide the ``harness`` fixture."""

    @pytest.fixture(autouse=True)
    def _waltz_capabilities(self, request: pytest.FixtureRequest, harness: Harness) -> None:
        assert isinstance(harness, LockTableHarness), (
            f"the harness fixture must return a LockTableHarness, got {type(harness).__name__}"
        )
        skip_unless_capable(request, harness)

    # -- a new table ------------------------------------------------------------

    @pytest.mark.parametrize("start", [NO_TRANSACTION, 0, 41, 2**62])
    def test_new_table_estimates_its_high_water_mark(
        self, harness: LockTableHarness, start: int
    ) -> None:
        table = harness.make(start)
        for lock in lock_universe():
            for request in (request_of(read=[lock.hash]), request_of(write=[lock.hash])):
                assert table.estimate(request) == start
                assert table.check(request, start) is None
                if start > NO_TRANSACTION:
                    assert table.check(request, start - 1) == start

    def test_empty_request_passes(self, harness: LockTableHarness) -> None:
        table = harness.make(10)
        table.record(request_of(write=[lock.hash for lock in lock_universe()]), 11)
        empty = LockRequest()
        assert table.estimate(empty) == NO_TRANSACTION
        assert table.check(empty, NO_TRANSACTION) is None
        assert table.check(empty, 0) is None

    # -- the three modes ------------------------------------------------------

    def test_write_lock_is_checked_and_recorded(self, harness: LockTableHarness) -> None:
        account = Lock("account", 1, LockMode.WRITE)
        table = harness.make(4)
        request = LockRequest.from_locks([account])
        assert table.check(request, 4) is None
        table.record(request, 5)
        failure = table.check(request, 4)
        assert failure is not None
        assert failure == 5, "the failure carries the id of the last change (the table's max)"
        assert table.check(request, 5) is None
        assert table.check(LockRequest.from_locks([Lock("account", 1, LockMode.READ)]), 4) == 5

    def test_read_lock_is_checked_never_recorded(self, harness: LockTableHarness) -> None:
        table = harness.make(4)
        reader = LockRequest.from_locks([Lock("account", 1, LockMode.READ)])
        writer = LockRequest.from_locks([Lock("account", 1, LockMode.WRITE)])
        assert table.check(reader, 4) is None
        table.record(reader, 5)
        # Nothing was recorded, so the lock still estimates the opening mark.
        assert table.estimate(reader) == 4
        assert table.check(writer, 4) is None
        assert table.check(reader, 4) is None
        table.record(writer, 6)
        assert table.check(reader, 5) == 6
        assert table.check(reader, 6) is None

    def test_append_lock_is_recorded_never_checked(self, harness: LockTableHarness) -> None:
        table = harness.make(4)
        owner = LockRequest.from_locks([Lock("owner", 7, LockMode.APPEND)])
        assert table.estimate(owner) == NO_TRANSACTION
        table.record(owner, 5)
        # APPEND is never checked: a client far behind still appends under the parent lock.
        assert table.check(owner, NO_TRANSACTION) is None
        assert table.check(owner, 0) is None
        table.record(owner, 6)
        assert table.check(owner, 0) is None
        # ...but it is recorded: a later READ or WRITE of the same lock sees the change.
        for mode in (LockMode.READ, LockMode.WRITE):
            request = LockRequest.from_locks([Lock("owner", 7, mode)])
            assert table.check(request, 5) == 6
            assert table.check(request, 6) is None

    def test_append_children_read_pattern(self, harness: LockTableHarness) -> None:
        """The spec's use: a parent APPEND lock, children read-locking the parent."""
        table = harness.make(0)
        parent_append = LockRequest.from_locks([Lock("parent", 1, LockMode.APPEND)])
        child_read = LockRequest.from_locks(
            [Lock("parent", 1, LockMode.READ), Lock("child", 9, LockMode.WRITE)]
        )
        # Many appends under the parent, from clients at any high-water mark.
        for txid in range(1, 6):
            assert table.check(parent_append, 0) is None
            table.record(parent_append, txid)
        assert table.check(child_read, 4) == 5
        assert table.check(child_read, 5) is None

    def test_request_estimate_is_max_over_read_and_write(self, harness: LockTableHarness) -> None:
        table = harness.make(0)
        a, b, c = (Lock("item", i) for i in range(3))
        table.record(LockRequest.from_locks([a]), 3)
        table.record(LockRequest.from_locks([b]), 7)
        table.record(LockRequest.from_locks([Lock("item", 2, LockMode.APPEND)]), 9)
        read_a = LockRequest.from_locks([Lock("item", 0, LockMode.READ)])
        mixed = LockRequest.from_locks([Lock("item", 0, LockMode.READ), b])
        estimate = table.estimate(mixed)
        assert estimate == max(table.estimate(read_a), table.estimate(LockRequest.from_locks([b])))
        assert 7 <= estimate <= 9
        assert table.check(mixed, 6) == estimate
        assert table.check(mixed, estimate) is None
        # An APPEND lock in a request adds nothing to its estimate...
        with_append = LockRequest.from_locks([a, Lock("item", 2, LockMode.APPEND)])
        assert table.estimate(with_append) == table.estimate(read_a)
        # ...but c's recorded APPEND counts once c is read or written.
        assert table.check(LockRequest.from_locks([a, c]), 8) == 9
        if EXACT in harness.capabilities:
            assert estimate == 7
            assert table.check(with_append, 3) is None

    def test_in_flight_transaction_is_seen_by_the_next(self, harness: LockTableHarness) -> None:
        """``record`` happens when the id is assigned, before the commit is known."""
        table = harness.make(10)
        request = LockRequest.from_locks([Lock("account", 5)])
        assert table.check(request, 10) is None
        table.record(request, 11)  # in flight
        assert table.check(request, 10) == 11  # a second client built on 10 must fail

    def test_many_locks_in_one_request(self, harness: LockTableHarness) -> None:
        table = harness.make(0)
        locks = [Lock("row", i) for i in range(300)]
        table.record(LockRequest.from_locks(locks), 1)
        for lock in locks:
            assert table.check(LockRequest.from_locks([lock]), 0) == 1
        assert table.check(LockRequest.from_locks(locks), 1) is None

    def test_extreme_hashes_and_ids(self, harness: LockTableHarness) -> None:
        top = 2**63 - 1
        table = harness.make(top - 100)
        model = ExactModel(top - 100)
        exact = EXACT in harness.capabilities
        for offset, lock_hash in enumerate(EXTREME_HASHES):
            request = request_of(write=[lock_hash])
            txid = top - 99 + offset
            table.record(request, txid)
            model.record(request, txid)
        for lock_hash in EXTREME_HASHES:
            for request in (request_of(read=[lock_hash]), request_of(write=[lock_hash])):
                assert_agrees(table, model, request, top - 100, exact=exact)
                assert table.check(request, model.high_water_mark) is None

    # -- reset (recovery) ------------------------------------------------------

    def test_reset_makes_every_lock_estimate_the_mark(self, harness: LockTableHarness) -> None:
        table = harness.make(0)
        recorded = lock_universe()[:6]
        for txid, lock in enumerate(recorded, start=1):
            table.record(LockRequest.from_locks([lock]), txid)
        # Transactions 5 and 6 were in flight and lost: recovery reopens at 4.
        table.reset(4)
        for lock in lock_universe():
            for mode in (LockMode.READ, LockMode.WRITE):
                request = LockRequest.from_locks([Lock(lock.name, lock.id, mode)])
                assert table.estimate(request) == 4, f"{lock} after reset(4)"
                assert table.check(request, 4) is None
                assert table.check(request, 3) == 4
        # The table works normally after the reset.
        again = LockRequest.from_locks([recorded[0]])
        table.record(again, 5)
        assert table.check(again, 4) == 5
        other = LockRequest.from_locks([recorded[1]])
        assert table.estimate(other) in (4, 5)  # 5 only through a collision with `again`
        if EXACT in harness.capabilities:
            assert table.check(other, 4) is None

    def test_reset_can_raise_the_mark(self, harness: LockTableHarness) -> None:
        table = harness.make(NO_TRANSACTION)
        table.record(LockRequest.from_locks([Lock("a", 1)]), 0)
        table.reset(1000)
        request = LockRequest.from_locks([Lock("never", 1), Lock("a", 1, LockMode.READ)])
        assert table.estimate(request) == 1000
        assert table.check(request, 999) == 1000
        assert table.check(request, 1000) is None

    def test_stats_is_a_mapping(self, harness: LockTableHarness) -> None:
        table = harness.make(0)
        table.record(LockRequest.from_locks([Lock("a", 1)]), 1)
        stats = table.stats()
        assert isinstance(stats, Mapping)
        assert all(isinstance(key, str) for key in stats)

    # -- exactness (optional) --------------------------------------------------

    @requires(EXACT)
    def test_no_false_positive(self, harness: LockTableHarness) -> None:
        table = harness.make(0)
        locks = [Lock("row", i) for i in range(5000)]
        for txid, lock in enumerate(locks, start=1):
            table.record(LockRequest.from_locks([lock]), txid)
        for txid, lock in enumerate(locks, start=1):
            read = LockRequest.from_locks([Lock(lock.name, lock.id, LockMode.READ)])
            assert table.estimate(read) == txid
        never = LockRequest.from_locks([Lock("other", i) for i in range(200)])
        assert table.estimate(never) == 0

    @requires(BOUNDED_MEMORY)
    def test_memory_does_not_grow_with_distinct_locks(self, harness: LockTableHarness) -> None:
        rng = random.Random(17)
        table = harness.make(0)
        txid = 0

        def record_distinct(count: int) -> None:
            nonlocal txid
            for _ in range(count // 2):
                txid += 1
                table.record(request_of(write=[rng.getrandbits(64), rng.getrandbits(64)]), txid)

        tracemalloc.start()
        try:
            record_distinct(20_000)
            before = tracemalloc.get_traced_memory()[0]
            record_distinct(100_000)
            growth = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        # A dictionary would take about 70 bytes per new lock (7 MB here).
        assert growth < 8 * 100_000, f"{growth} bytes more for 100,000 more distinct locks"

    # -- random and stateful workloads against the exact model ---------------------

    @pytest.mark.parametrize(("seed", "distinct_locks"), [(1, 8), (2, 100), (3, 5000), (4, 40)])
    def test_random_workload_against_exact_model(
        self, harness: LockTableHarness, seed: int, distinct_locks: int
    ) -> None:
        run_random_workload(harness, seed, steps=2500, distinct_locks=distinct_locks)

    def test_random_workload_from_a_high_mark(self, harness: LockTableHarness) -> None:
        run_random_workload(harness, 5, steps=1500, distinct_locks=50, start=2**40)

    def test_stateful_against_exact_model(self, harness: LockTableHarness) -> None:
        run_state_machine_as_test(
            lock_table_machine(harness),
            settings=settings(
                max_examples=60,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
