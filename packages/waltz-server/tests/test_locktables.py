"""Implementation specifics of the built-in lock tables (the contract: the conformance suite)."""

from __future__ import annotations

import random

import pytest

from waltz_api.errors import ConfigError, WaltzError
from waltz_api.hookspecs import PluginKind
from waltz_api.plugins import get_registry
from waltz_api.types import NO_TRANSACTION, Lock, LockMode, LockRequest
from waltz_server.locktables import DEFAULT_SIZE, ExactLockTable, HwmArrayLockTable
from waltz_server.locktables.hwm_array import MAX_SIZE


def write(*locks: Lock) -> LockRequest:
    return LockRequest.from_locks(locks)


def read(lock: Lock) -> LockRequest:
    return LockRequest.from_locks([Lock(lock.name, lock.id, LockMode.READ)])


# -- registration ------------------------------------------------------------------


def test_both_tables_are_registered_by_name() -> None:
    registry = get_registry()
    assert registry.get(PluginKind.LOCK_TABLE, "hwm-array").factory is HwmArrayLockTable
    assert registry.get(PluginKind.LOCK_TABLE, "exact").factory is ExactLockTable
    assert "exact" in registry.get(PluginKind.LOCK_TABLE, "exact").capabilities
    assert "exact" not in registry.get(PluginKind.LOCK_TABLE, "hwm-array").capabilities


def test_factories_follow_the_hookspec_signature() -> None:
    """``factory(high_water_mark, options) -> LockTable``."""
    registry = get_registry()
    table = registry.get(PluginKind.LOCK_TABLE, "hwm-array").factory(7, {"size": 64})
    assert isinstance(table, HwmArrayLockTable)
    assert table.size == 64
    assert table.estimate(write(Lock("a", 1))) == 7
    exact = registry.get(PluginKind.LOCK_TABLE, "exact").factory(7, {})
    assert exact.estimate(write(Lock("a", 1))) == 7


# -- hwm-array options ---------------------------------------------------------------


def test_hwm_array_default_size_is_the_specs() -> None:
    assert DEFAULT_SIZE == 30_000
    table = HwmArrayLockTable()
    assert table.size == DEFAULT_SIZE
    assert table.stats()["size"] == DEFAULT_SIZE
    assert table.stats()["hash_functions"] == 3


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (0, "between 1 and"),
        (-5, "between 1 and"),
        (MAX_SIZE + 1, "between 1 and"),
        ("30000", "must be an integer"),
        (1.5, "must be an integer"),
        (True, "must be an integer"),
        (None, "must be an integer"),
    ],
)
def test_hwm_array_rejects_a_bad_size(size: object, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as info:
        HwmArrayLockTable(NO_TRANSACTION, {"size": size})
    assert info.value.key == "size"
    assert "'size'" in str(info.value)
    assert "hwm-array" in str(info.value)


def test_hwm_array_accepts_the_size_bounds() -> None:
    assert HwmArrayLockTable(options={"size": 1}).size == 1


def test_unknown_option_is_named_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"unknown option 'sise'.*did you mean 'size'") as info:
        HwmArrayLockTable(options={"sise": 100})
    assert info.value.key == "sise"
    with pytest.raises(ConfigError, match=r"unknown option 'size' for the exact lock table"):
        ExactLockTable(options={"size": 100})


@pytest.mark.parametrize("table_class", [HwmArrayLockTable, ExactLockTable])
@pytest.mark.parametrize("mark", [-2, "5", 1.0, None])
def test_bad_high_water_mark_is_refused(table_class: type, mark: object) -> None:
    with pytest.raises(ValueError, match="high-water mark must be an integer"):
        table_class(mark)
    table = table_class(0)
    with pytest.raises(ValueError, match="high-water mark must be an integer"):
        table.reset(mark)


def test_config_error_is_a_waltz_error() -> None:
    with pytest.raises(WaltzError):
        HwmArrayLockTable(options={"size": 0})


# -- hwm-array internals -------------------------------------------------------------


@pytest.mark.parametrize("size", [1024, 30_000, 99_991, MAX_SIZE])
def test_the_three_slots_are_independent_and_cover_the_table(size: int) -> None:
    table = HwmArrayLockTable(options={"size": size})
    count = 20_000
    coincide = 0
    highest = [0, 0, 0]
    for lock_id in range(count):
        slots = table.slots_of(Lock("row", lock_id).hash)
        assert all(0 <= slot < size for slot in slots)
        coincide += len(set(slots)) < 3
        highest = [max(h, s) for h, s in zip(highest, slots, strict=True)]
    # Independent uniform slots coincide with probability about 3/size.
    assert coincide <= 2 * count * 3 / size + 5
    # Each of the three reaches the top of the table (no slot confined to a part of it).
    assert all(h > size * 0.9 for h in highest), highest


def test_slots_spread_evenly() -> None:
    size = 100
    table = HwmArrayLockTable(options={"size": size})
    counts = [0] * size
    for lock_id in range(20_000):
        for slot in table.slots_of(Lock("row", lock_id).hash):
            counts[slot] += 1
    expected = 60_000 / size
    assert min(counts) > expected * 0.75
    assert max(counts) < expected * 1.25


def test_record_raises_exactly_the_three_slots() -> None:
    table = HwmArrayLockTable(5, {"size": 1000})
    lock = Lock("account", 42)
    table.record(write(lock), 9)
    slots = set(table.slots_of(lock.hash))
    assert table.stats()["slots_above_reset"] == len(slots)
    assert table.stats()["high_water_mark"] == 9


def test_record_never_lowers_a_slot() -> None:
    """Slots take max(slot, id): a stale id recorded late must not hide a newer change."""
    for table in (HwmArrayLockTable(0, {"size": 64}), ExactLockTable(0)):
        lock = Lock("account", 1)
        table.record(write(lock), 10)
        table.record(write(lock), 4)
        assert table.estimate(read(lock)) == 10
        table.record(LockRequest.from_locks([Lock("account", 1, LockMode.APPEND)]), 3)
        assert table.estimate(read(lock)) == 10


def test_reset_fills_every_slot() -> None:
    table = HwmArrayLockTable(0, {"size": 500})
    rng = random.Random(3)
    for txid in range(1, 300):
        table.record(write(Lock("row", rng.randrange(10_000))), txid)
    assert table.stats()["slots_above_reset"] > 0
    table.reset(120)
    stats = table.stats()
    assert stats["slots_above_reset"] == 0
    assert stats["high_water_mark"] == 120
    assert stats["reset_high_water_mark"] == 120


def test_one_slot_table_estimates_the_last_change_of_anything() -> None:
    table = HwmArrayLockTable(0, {"size": 1})
    table.record(write(Lock("a", 1)), 1)
    table.record(write(Lock("b", 2)), 2)
    assert table.estimate(read(Lock("never", 0))) == 2


def false_positive_rate(size: int, recorded: int, probes: int = 2000) -> float:
    """Share of never-recorded locks that estimate above the reset mark."""
    table = HwmArrayLockTable(0, {"size": size})
    for txid in range(1, recorded + 1):
        table.record(write(Lock("recorded", txid)), txid)
    hits = sum(1 for i in range(probes) if table.estimate(read(Lock("probe", i))) > 0)
    return hits / probes


def test_tiny_table_has_false_positives_never_false_negatives() -> None:
    size = 16
    table = HwmArrayLockTable(0, {"size": size})
    exact = ExactLockTable(0)
    locks = [Lock("row", i) for i in range(200)]
    rng = random.Random(11)
    for txid in range(1, 400):
        request = write(rng.choice(locks))
        table.record(request, txid)
        exact.record(request, txid)
    false_positives = 0
    for lock in locks:
        truth = exact.estimate(read(lock))
        estimate = table.estimate(read(lock))
        assert truth <= estimate <= 399
        false_positives += estimate > truth
    assert false_positives > len(locks) // 2, "16 slots for 200 locks must collide often"
    assert false_positive_rate(size, recorded=200) > 0.9


def test_false_positive_rate_falls_with_size() -> None:
    tiny = false_positive_rate(64, recorded=200)
    small = false_positive_rate(1000, recorded=200)
    default = false_positive_rate(DEFAULT_SIZE, recorded=200)
    assert tiny > small > default
    assert default < 0.001  # (3*200/30000)^3 = 8e-6 in theory
    assert tiny > 0.5


# -- exact ---------------------------------------------------------------------------


def test_exact_counts_entries_and_forgets_on_reset() -> None:
    table = ExactLockTable(0)
    for txid in range(1, 101):
        table.record(write(Lock("row", txid % 40)), txid)
    assert table.stats()["entries"] == 40
    assert table.stats()["high_water_mark"] == 100
    table.reset(100)
    assert table.stats()["entries"] == 0
    assert table.estimate(read(Lock("row", 1))) == 100


def test_exact_has_no_false_positive_with_many_locks() -> None:
    table = ExactLockTable(0)
    for txid in range(1, 20_001):
        table.record(write(Lock("recorded", txid)), txid)
    assert all(table.estimate(read(Lock("probe", i))) == 0 for i in range(2000))
