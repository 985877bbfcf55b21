"""The value types shared by every Waltz component.

All are frozen (immutable, hashable) with slots. Transaction ids are ``int``
(64-bit signed on the wire and on disk); ``-1`` means "no transaction" (an
empty partition has max transaction id ``-1``).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from waltz_api.errors import ArgumentTypeError, InvalidArgumentError

NO_TRANSACTION = -1
"""The transaction id of "nothing yet": the high-water mark of an empty partition."""

UNRESOLVED = -1
"""A replica's closing high-water mark before recovery resolved it (ReplicaState.UNRESOLVED)."""

NO_SESSION = -1
"""A session id field that holds no session (``SessionInfo`` of a new partition)."""

LOST_SESSION = -2
"""``SessionInfo.low_water_mark_session_id`` of a replica whose storage lost records it had
acknowledged (found by the engine's start-up recovery): no session vouches for its marks."""

_LOCK_KEY = struct.Struct(">q")

MAX_LOCK_NAME_BYTES = 1024
"""The longest lock name, in UTF-8 bytes (only its hash travels, but a name is an
identifier, not a payload: a longer one is a bug)."""
MAX_LOCKS_PER_TRANSACTION = 4096
"""The most locks of one transaction (all modes together): each is checked and recorded
in the partition's lock table while the partition waits."""
LOCK_ID_MIN = -(2**63)
LOCK_ID_MAX = 2**63 - 1
"""Lock ids are any signed 64-bit integer (the spec's ``long``), negative ones included."""


@dataclass(frozen=True, slots=True)
class ReqId:
    """The unique id of a client request (spec: Request ID).

    ``client_id`` is allocated by coordination, ``generation`` is the
    partition's generation the client believed in, ``seq_num`` increases per
    request of that client.
    """

    client_id: int
    generation: int
    partition_id: int
    seq_num: int


class LockMode(enum.IntEnum):
    """How a lock takes part in the optimistic concurrency check.

    - READ: checked against the client high-water mark, never recorded.
    - WRITE: checked, and recorded at the transaction's id on commit.
    - APPEND: recorded on commit, never checked (a parent "ownership" lock
      whose children are read-locked).
    """

    READ = 0
    WRITE = 1
    APPEND = 2


def lock_hash(name: str, lock_id: int) -> int:
    """The stable 64-bit hash of a lock id (name, id).

    It does not depend on PYTHONHASHSEED, the process or the platform, so a
    client and a server always agree. BLAKE2b with an 8-byte digest; the
    result is an unsigned 64-bit integer.
    """
    return _hash_encoded(_lock_name_bytes(name), lock_id)


def _hash_encoded(name: bytes, lock_id: int) -> int:
    digest = hashlib.blake2b(name + b"\x00" + _LOCK_KEY.pack(lock_id), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _lock_name_bytes(name: object) -> bytes:
    """The UTF-8 of a valid lock name; InvalidArgumentError saying what is wrong."""
    if not isinstance(name, str):
        raise InvalidArgumentError(f"a lock needs a non-empty name (str), got {name!r:.80}")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"lock name {name!r:.80} is not valid text: character {exc.start} "
            f"({name[exc.start]!r}) cannot be encoded as UTF-8 (a lone surrogate?); "
            "a lock name must be a proper Unicode string"
        ) from None
    if len(encoded) > MAX_LOCK_NAME_BYTES:
        raise InvalidArgumentError(
            f"lock name {name!r:.40}... is {len(encoded)} UTF-8 bytes, above the limit of "
            f"{MAX_LOCK_NAME_BYTES} (waltz_api.types.MAX_LOCK_NAME_BYTES); name the "
            "entity kind and put the entity in the lock id"
        )
    return encoded


@dataclass(frozen=True, slots=True)
class Lock:
    """An application-defined lock: a name and a 64-bit id, in a mode.

    The scope of a lock is its partition.
    """

    name: str
    id: int
    mode: LockMode = LockMode.WRITE
    hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgumentError(f"a lock needs a non-empty name (str), got {self.name!r}")
        encoded = _lock_name_bytes(self.name)
        if isinstance(self.id, bool) or not isinstance(self.id, int):
            raise InvalidArgumentError(f"a lock id must be an int, got {self.id!r:.80}")
        if not LOCK_ID_MIN <= self.id <= LOCK_ID_MAX:
            raise InvalidArgumentError(
                f"lock id {self.id} does not fit in a signed 64-bit integer "
                f"({LOCK_ID_MIN}..{LOCK_ID_MAX})"
            )
        if type(self.mode) is not LockMode:
            # A plain int (say, read back from a database) must not be silently
            # dropped by the `is LockMode.X` grouping of LockRequest.from_locks.
            try:
                object.__setattr__(self, "mode", LockMode(self.mode))
            except ValueError:
                valid = ", ".join(f"{m.name} ({m.value})" for m in LockMode)
                raise InvalidArgumentError(
                    f"lock mode {self.mode!r} is not one of {valid}"
                ) from None
        object.__setattr__(self, "hash", _hash_encoded(encoded, self.id))


def too_many_locks(count: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"a transaction with {count} locks is above the limit of {MAX_LOCKS_PER_TRANSACTION} "
        "(waltz_api.types.MAX_LOCKS_PER_TRANSACTION); lock fewer, coarser entities"
    )


@dataclass(frozen=True, slots=True)
class LockRequest:
    """The lock hashes of one append request, grouped by mode (what travels on the wire)."""

    read: tuple[int, ...] = ()
    write: tuple[int, ...] = ()
    append: tuple[int, ...] = ()

    @classmethod
    def from_locks(cls, locks: Iterable[Lock]) -> LockRequest:
        """Group ``locks`` by mode, keeping their order (any iterable, read once); at
        most MAX_LOCKS_PER_TRANSACTION of them."""
        groups: tuple[list[int], list[int], list[int]] = ([], [], [])
        for count, lock in enumerate(locks, 1):
            if not isinstance(lock, Lock):
                raise ArgumentTypeError(f"a lock request is built from Lock objects, got {lock!r}")
            if count > MAX_LOCKS_PER_TRANSACTION:
                raise too_many_locks(count)
            groups[lock.mode].append(lock.hash)
        return cls(tuple(groups[0]), tuple(groups[1]), tuple(groups[2]))

    def __len__(self) -> int:
        return len(self.read) + len(self.write) + len(self.append)

    def __bool__(self) -> bool:
        return bool(self.read or self.write or self.append)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A committed transaction without its data (what the feed carries)."""

    transaction_id: int
    req_id: ReqId
    header: int


@dataclass(frozen=True, slots=True)
class Record:
    """A transaction record as stored: id, request id, header, data and its CRC-32C."""

    transaction_id: int
    req_id: ReqId
    header: int
    data: bytes
    checksum: int

    @property
    def record_header(self) -> RecordHeader:
        return RecordHeader(self.transaction_id, self.req_id, self.header)


@dataclass(frozen=True, slots=True)
class Transaction:
    """A committed transaction as an application sees it.

    ``data`` is ``None`` when only the header was streamed (the data is then
    fetched lazily by the client).
    """

    partition_id: int
    transaction_id: int
    header: int
    req_id: ReqId
    data: bytes | None = None


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A storage partition's last store session (spec: Partition Info).

    - ``session_id``: the highest store session id this partition accepted.
    - ``low_water_mark``: the cluster high-water mark when that session started.
    - ``local_low_water_mark``: the highest valid transaction id in this
      storage when that session started (below ``low_water_mark`` when the
      replica was behind).
    - ``low_water_mark_session_id``: the store session whose low-water-mark write
      (SetLowWaterMark) recorded the two marks, kept apart from the fence
      ``session_id`` (which any request of a newer session raises). A storage
      restored from a backup shows an older one than the partition's metadata
      says it completed, even after a later session raised its fence and died.
      :data:`NO_SESSION` when unknown (never written, or an engine or a format
      that does not keep it: recovery then compares ``session_id``, the original's
      rule); :data:`LOST_SESSION` when the engine's start-up recovery found that
      records it had acknowledged may be lost (a damaged tail it moved aside):
      the replica is then treated like one restored from a backup.
    """

    session_id: int = -1
    low_water_mark: int = NO_TRANSACTION
    local_low_water_mark: int = NO_TRANSACTION
    low_water_mark_session_id: int = -1


@dataclass(frozen=True, slots=True)
class ReplicaId:
    """A replica: a partition on a storage node (by the node's connect string)."""

    partition_id: int
    storage_node: str


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """A replica's state in the partition store metadata (spec: ReplicaState)."""

    replica_id: ReplicaId
    session_id: int
    closing_high_water_mark: int = UNRESOLVED


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    """What a storage node reports about one of its partitions."""

    partition_id: int
    session_info: SessionInfo
    max_transaction_id: int
    available: bool = True
