"""The shared value types: locks, their stable hash, lock requests, records."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

from waltz_api.types import (
    NO_TRANSACTION,
    Lock,
    LockMode,
    LockRequest,
    Record,
    RecordHeader,
    ReqId,
    SessionInfo,
    lock_hash,
)

SAMPLE_LOCKS = [
    ("account", 1),
    ("account", -1),
    ("account", 0),
    ("user", 2**63 - 1),
    ("user", -(2**63)),
    ("ünïcödé ключ", 42),
    ("a", 7),
]


def test_lock_hash_is_a_stable_unsigned_64_bit_value() -> None:
    # Pinned: clients and servers of different versions must agree on it.
    assert lock_hash("account", 1) == 0x9598D8FA6E11D5DC
    # The documented algorithm: BLAKE2b-64 of utf-8 name, NUL, big-endian signed id.
    digest = hashlib.blake2b(b"account\x00" + (1).to_bytes(8, "big", signed=True), digest_size=8)
    assert lock_hash("account", 1) == int.from_bytes(digest.digest(), "big")
    for name, lock_id in SAMPLE_LOCKS:
        value = lock_hash(name, lock_id)
        assert 0 <= value < 2**64
        assert Lock(name, lock_id).hash == value


def test_lock_hash_does_not_depend_on_the_process_or_hash_seed() -> None:
    script = textwrap.dedent(
        """
        import json, sys
        from waltz_api.types import Lock
        locks = json.loads(sys.argv[1])
        print(json.dumps([[hash(name), Lock(name, i).hash] for name, i in locks]))
        """
    )
    here = [Lock(name, lock_id).hash for name, lock_id in SAMPLE_LOCKS]
    builtin_hashes = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script, json.dumps(SAMPLE_LOCKS)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
        pairs = json.loads(out)
        assert [lock for _, lock in pairs] == here, f"PYTHONHASHSEED={seed}"
        builtin_hashes.append([builtin for builtin, _ in pairs])
    # The builtin str hash did change with the seed: the test would catch a seeded hash.
    assert builtin_hashes[0] != builtin_hashes[1]


def test_distinct_locks_hash_apart() -> None:
    names = ["a", "b", "a\x00", "ab", "account", "accoun", ""]
    hashes = {
        lock_hash(name, lock_id) for name in names for lock_id in (-1, 0, 1, 256, 2**32, 2**62)
    }
    assert len(hashes) == len(names) * 6
    # The name/id boundary is unambiguous: ("a", id) never equals ("a" + bytes, id').
    assert lock_hash("a", 0) != lock_hash("a\x00" + "\x00" * 7, 0)


def test_mode_takes_part_in_equality_not_in_the_hash() -> None:
    read = Lock("account", 1, LockMode.READ)
    write = Lock("account", 1, LockMode.WRITE)
    assert read != write
    assert read.hash == write.hash
    assert Lock("account", 1) == write, "WRITE is the default mode"
    assert {Lock("account", 1), Lock("account", 1)} == {write}


def test_lock_mode_given_as_int_is_normalised() -> None:
    lock = Lock("account", 1, 0)  # type: ignore[arg-type]
    assert lock.mode is LockMode.READ
    assert LockRequest.from_locks([lock]).read == (lock.hash,)


@pytest.mark.parametrize(
    ("name", "lock_id", "mode", "message"),
    [
        ("", 1, LockMode.WRITE, "non-empty name"),
        (None, 1, LockMode.WRITE, "non-empty name"),
        (b"bytes", 1, LockMode.WRITE, "non-empty name"),
        ("a", 2**63, LockMode.WRITE, "signed 64-bit"),
        ("a", -(2**63) - 1, LockMode.WRITE, "signed 64-bit"),
        ("a", "1", LockMode.WRITE, "must be an int"),
        ("a", 1.0, LockMode.WRITE, "must be an int"),
        ("a", True, LockMode.WRITE, "must be an int"),
        ("a", 1, 3, "lock mode 3 is not one of READ"),
        ("a", 1, "READ", "is not one of"),
    ],
)
def test_bad_lock_is_refused(name: object, lock_id: object, mode: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Lock(name, lock_id, mode)  # type: ignore[arg-type]


def test_lock_is_frozen() -> None:
    lock = Lock("account", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lock.id = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        lock.hash = 5  # type: ignore[misc]


def test_lock_request_groups_by_mode_in_order() -> None:
    locks = [
        Lock("a", 1, LockMode.WRITE),
        Lock("b", 2, LockMode.READ),
        Lock("c", 3, LockMode.APPEND),
        Lock("d", 4, LockMode.READ),
        Lock("e", 5, LockMode.WRITE),
    ]
    request = LockRequest.from_locks(locks)
    assert request.read == (locks[1].hash, locks[3].hash)
    assert request.write == (locks[0].hash, locks[4].hash)
    assert request.append == (locks[2].hash,)
    assert LockRequest.from_locks(tuple(locks)) == request
    assert LockRequest.from_locks(lock for lock in locks) == request, "a generator is read once"


def test_lock_request_truthiness() -> None:
    assert not LockRequest()
    assert not LockRequest.from_locks([])
    assert LockRequest(append=(1,))
    assert LockRequest(read=(1,))


def test_lock_request_refuses_what_is_not_a_lock() -> None:
    with pytest.raises(TypeError, match="built from Lock objects"):
        LockRequest.from_locks([("account", 1)])  # type: ignore[list-item]


def test_record_header_of_a_record() -> None:
    req = ReqId(client_id=1, generation=2, partition_id=3, seq_num=4)
    record = Record(transaction_id=9, req_id=req, header=7, data=b"x", checksum=123)
    assert record.record_header == RecordHeader(9, req, 7)


def test_defaults_mean_nothing_yet() -> None:
    assert NO_TRANSACTION == -1
    info = SessionInfo()
    assert info.low_water_mark == NO_TRANSACTION
    assert info.local_low_water_mark == NO_TRANSACTION
    assert info.session_id == -1


def test_bad_arguments_raise_waltz_errors_that_are_also_what_python_raises() -> None:
    from waltz_api.errors import ArgumentTypeError, InvalidArgumentError, WaltzError

    with pytest.raises(InvalidArgumentError) as bad_value:
        Lock("", 1)
    assert isinstance(bad_value.value, WaltzError) and isinstance(bad_value.value, ValueError)
    with pytest.raises(ArgumentTypeError) as bad_type:
        LockRequest.from_locks(["account"])  # type: ignore[list-item]
    assert isinstance(bad_type.value, WaltzError) and isinstance(bad_type.value, TypeError)


def test_lock_names_are_bounded_proper_text_and_ids_any_signed_64_bit() -> None:
    from waltz_api.types import MAX_LOCK_NAME_BYTES, MAX_LOCKS_PER_TRANSACTION

    assert Lock("n" * MAX_LOCK_NAME_BYTES, -1).id == -1  # negative ids are valid (a long)
    with pytest.raises(ValueError, match="above the limit of 1024"):
        Lock("n" * (MAX_LOCK_NAME_BYTES + 1), 1)
    with pytest.raises(ValueError, match="cannot be encoded as UTF-8"):
        Lock("\udc80", 1)
    with pytest.raises(ValueError, match="cannot be encoded as UTF-8"):
        lock_hash("a\ud800", 1)
    locks = [Lock("a", i) for i in range(MAX_LOCKS_PER_TRANSACTION + 1)]
    assert len(LockRequest.from_locks(locks[:-1])) == MAX_LOCKS_PER_TRANSACTION
    with pytest.raises(ValueError, match=f"limit of {MAX_LOCKS_PER_TRANSACTION}"):
        LockRequest.from_locks(locks)
