"""The application-facing types: callbacks, transaction contexts, builders, transactions.

An application gives the client a :class:`WaltzClientCallbacks` (where its
high-water mark lives and how a committed transaction is applied) and submits
:class:`TransactionContext` objects (how a transaction is built). The client
calls :meth:`TransactionContext.execute` with a :class:`TransactionBuilder`,
sends the result, watches the feed for the outcome, and re-executes the
context when the append failed.
"""

from __future__ import annotations

import inspect
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, overload, runtime_checkable

from waltz_api.errors import ClientError
from waltz_api.types import (
    MAX_LOCKS_PER_TRANSACTION,
    NO_TRANSACTION,
    Lock,
    LockMode,
    LockRequest,
    ReqId,
    too_many_locks,
)
from waltz_client.errors import TransactionTooLargeError

APPEND_OVERHEAD = 50
"""Bytes of an AppendRequest frame besides its data and its locks (8 bytes each): type,
version, ReqId, high-water mark, lock counts, header, data length, checksum."""

T = TypeVar("T")

_NO_LOCKS = LockRequest()
"""The lock request of a transaction without locks (immutable: one for all of them)."""

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1


@runtime_checkable
class Serializer(Protocol[T]):
    """Turns application objects into transaction data and back."""

    def serialize(self, value: T) -> bytes: ...

    def deserialize(self, data: bytes) -> T: ...


class JsonSerializer:
    """A :class:`Serializer` of JSON values (UTF-8, compact)."""

    def serialize(self, value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":"), sort_keys=True).encode("utf-8")

    def deserialize(self, data: bytes) -> Any:
        return json.loads(data.decode("utf-8"))


JSON = JsonSerializer()
"""A ready-made JSON serializer: ``builder.set_data({"amount": 5}, JSON)``."""


class TransactionBuilder:
    """What :meth:`TransactionContext.execute` fills in: header, data and locks.

    ``client_high_water_mark`` is the high-water mark the transaction is built
    on (the application's state the context may read); the server checks the
    READ and WRITE locks against it.
    """

    __slots__ = ("_data", "_header", "_locks", "client_high_water_mark", "partition_id")

    def __init__(self, partition_id: int, client_high_water_mark: int) -> None:
        self.partition_id = partition_id
        self.client_high_water_mark = client_high_water_mark
        self._header = 0
        self._data = b""
        self._locks: list[Lock] = []

    def set_header(self, header: int) -> TransactionBuilder:
        """The application-defined 32-bit signed header (streamed with the feed)."""
        if isinstance(header, bool) or not isinstance(header, int):
            raise ClientError(f"a transaction header is an int, got {header!r}")
        if not INT32_MIN <= header <= INT32_MAX:
            raise ClientError(
                f"transaction header {header} does not fit in a signed 32-bit integer"
            )
        self._header = header
        return self

    @overload
    def set_data(self, data: bytes | bytearray | memoryview) -> TransactionBuilder: ...

    @overload
    def set_data(self, data: T, serializer: Serializer[T]) -> TransactionBuilder: ...

    def set_data(self, data: Any, serializer: Serializer[Any] | None = None) -> TransactionBuilder:
        """The transaction data: bytes, or any value with a :class:`Serializer`."""
        if serializer is not None:
            encoded = serializer.serialize(data)
            if not isinstance(encoded, bytes | bytearray | memoryview):
                raise ClientError(
                    f"{type(serializer).__name__}.serialize returned "
                    f"{type(encoded).__name__}, not bytes"
                )
            self._data = bytes(encoded)
        elif isinstance(data, bytes | bytearray | memoryview):
            self._data = bytes(data)
        else:
            raise ClientError(
                f"transaction data must be bytes, got {type(data).__name__}; pass a serializer "
                "(e.g. waltz_client.JSON) to store other values"
            )
        return self

    def lock(self, lock: Lock) -> TransactionBuilder:
        """Add a :class:`~waltz_api.types.Lock` (any mode)."""
        if not isinstance(lock, Lock):
            raise ClientError(f"expected a waltz_api.types.Lock, got {lock!r}")
        if len(self._locks) >= MAX_LOCKS_PER_TRANSACTION:
            raise too_many_locks(len(self._locks) + 1)
        self._locks.append(lock)
        return self

    def read_lock(self, name: str, lock_id: int) -> TransactionBuilder:
        """Fail the transaction if ``(name, lock_id)`` changed after the client high-water mark."""
        return self.lock(Lock(name, lock_id, LockMode.READ))

    def write_lock(self, name: str, lock_id: int) -> TransactionBuilder:
        """Like a read lock, and record the change at this transaction's id on commit."""
        return self.lock(Lock(name, lock_id, LockMode.WRITE))

    def append_lock(self, name: str, lock_id: int) -> TransactionBuilder:
        """Record a change at this transaction's id on commit, never checked."""
        return self.lock(Lock(name, lock_id, LockMode.APPEND))

    @property
    def header(self) -> int:
        return self._header

    @property
    def data(self) -> bytes:
        return self._data

    @property
    def locks(self) -> tuple[Lock, ...]:
        return tuple(self._locks)

    def lock_request(self) -> LockRequest:
        locks = self._locks
        return LockRequest.from_locks(locks) if locks else _NO_LOCKS

    @property
    def wire_size(self) -> int:
        """Bytes of the transaction's append frame."""
        return APPEND_OVERHEAD + 8 * len(self._locks) + len(self._data)

    def check_size(self, max_frame_size: int, whose: str = "the transport's") -> None:
        """TransactionTooLargeError when the append frame exceeds ``max_frame_size``
        (``whose``: the transport's own, or the server's when it announced a smaller one)."""
        size = self.wire_size
        if size > max_frame_size:
            raise TransactionTooLargeError(
                f"the transaction is {size} bytes on the wire ({len(self._data)} bytes of data, "
                f"{len(self._locks)} locks), above {whose} max_frame_size of "
                f"{max_frame_size} bytes: store less per transaction (e.g. a reference to the "
                "data), or raise max_frame_size on every client, server and storage node"
            )


class TransactionContext(ABC):
    """How to build one transaction; subclass it and implement :meth:`execute`.

    The client may call :meth:`execute` several times (once per attempt): it
    must build the transaction from the application's current state each time.
    Hooks are called on the client's event loop: keep them short.
    """

    def __init__(self) -> None:
        self.creation_time = time.time()
        self.attempts = 0
        """How many times :meth:`execute` was called so far."""

    @abstractmethod
    def partition_id(self, num_partitions: int) -> int:
        """The partition of this transaction, in ``range(num_partitions)``."""

    @abstractmethod
    def execute(self, builder: TransactionBuilder) -> bool | Awaitable[bool]:
        """Fill ``builder``; return False to drop the transaction (nothing is sent).

        A plain method runs on the client's callback thread (with the read of the
        client high-water mark, so no apply runs in between); an ``async def`` one
        runs on the event loop, which saves a thread hop per attempt."""

    def on_completion(self, committed: bool) -> None:  # noqa: B027
        """Called once when done: True when committed, False when execute declined."""

    def on_exception(self, exception: BaseException) -> None:  # noqa: B027
        """Called when the context failed with an exception (``execute`` raised, or the
        outcome of its last append is unknown:
        :class:`~waltz_client.TransactionOutcomeUnknownError`); no retry follows."""

    def on_lock_failure(self, transaction_id: int) -> None:  # noqa: B027
        """Called when an attempt was rejected by a lock check (a retry follows, once
        the application has applied transaction ``transaction_id``)."""

    def on_expiration(self) -> None:  # noqa: B027
        """Called when the context expired (``ClientConfig.transaction_timeout``)
        without being committed (decided: nothing of it is pending); no retry follows."""

    def on_application(self, transaction_id: int) -> None:  # noqa: B027
        """Called after this context's committed transaction was handed to
        :meth:`WaltzClientCallbacks.apply_transaction` by this client."""


class WaltzClientCallbacks(ABC):
    """Where the application keeps its high-water marks and how it applies transactions.

    Plain methods run on the client's callback thread (one thread, so calls are
    serialized and in feed order); ``async def`` overrides are awaited on the loop.
    """

    @abstractmethod
    def client_high_water_mark(self, partition_id: int) -> int | Awaitable[int]:
        """The id of the last transaction of ``partition_id`` applied (-1: none)."""

    @abstractmethod
    def apply_transaction(self, transaction: Transaction) -> Awaitable[None] | None:
        """Apply a committed transaction and record ``transaction.transaction_id`` as the
        partition's high-water mark (atomically, to apply each exactly once)."""

    def uncaught_exception(  # noqa: B027
        self, partition_id: int, transaction_id: int, exception: BaseException
    ) -> None:
        """Called when :meth:`apply_transaction` raised (and with the error that stops a
        partition). The feed of that partition restarts from
        :meth:`client_high_water_mark` after a back-off, so the transaction is offered
        again, up to ``ClientConfig.apply_retries`` times; then ``poison_policy``
        decides: the partition stops (:class:`~waltz_client.PoisonTransactionError`), or
        the transaction goes to :meth:`dead_letter`."""

    def dead_letter(
        self, transaction: Transaction, exception: BaseException
    ) -> Awaitable[None] | None:
        """Under ``ClientConfig(poison_policy="skip")``: ``transaction`` could not be
        applied (``exception`` is the last failure) and is skipped. Record it where it
        can be looked at later (a dead-letter table, a file) and advance the partition's
        high-water mark past it, atomically, as :meth:`apply_transaction` would: the
        client goes on with the next transaction, and a restart does not offer it again.
        If this raises, the partition stops. The SQL helpers implement it."""
        raise NotImplementedError(
            f"{type(self).__name__}.dead_letter is not implemented: a skipped transaction "
            "cannot be recorded"
        )


@dataclass(frozen=True, slots=True)
class SubmissionResult:
    """What a submission came to: committed (at ``transaction_id``) or declined by
    :meth:`TransactionContext.execute` (nothing was sent). True when committed, so
    ``if await client.submit(context):`` reads as before::

        result = await client.submit(Deposit(account=7, amount=100))
        if result:
            print("committed as transaction", result.transaction_id)

    A submission that is not committed for any other reason raises instead
    (:class:`~waltz_client.TransactionExpiredError`, what ``execute`` raised...).
    """

    committed: bool
    partition_id: int
    transaction_id: int = NO_TRANSACTION
    """The committed transaction's id (NO_TRANSACTION, -1, when declined)."""
    attempts: int = 0
    """How many times ``execute`` ran (retries after lock failures and lost appends)."""

    def __bool__(self) -> bool:
        return self.committed


DataFetcher = Callable[[int, int], Awaitable[bytes]]
"""(partition_id, transaction_id) -> data: how a :class:`Transaction` loads its data."""
BlockingFetcher = Callable[[int, int], bytes]
"""(partition_id, transaction_id) -> data, blocking: :meth:`Transaction.get_data` off the loop."""


class Transaction:
    """A committed transaction as the feed delivers it; the data is loaded on demand.

    ``await transaction.fetch_data()`` on the event loop, ``transaction.get_data()``
    from any other thread (the callback thread for plain callbacks).
    """

    __slots__ = ("_blocking", "_fetch", "header", "partition_id", "req_id", "transaction_id")

    def __init__(
        self,
        partition_id: int,
        transaction_id: int,
        header: int,
        req_id: ReqId,
        *,
        fetch: DataFetcher,
        blocking: BlockingFetcher | None = None,
    ) -> None:
        self.partition_id = partition_id
        self.transaction_id = transaction_id
        self.header = header
        self.req_id = req_id
        self._fetch = fetch
        self._blocking = blocking

    def __repr__(self) -> str:
        return (
            f"Transaction(partition_id={self.partition_id}, "
            f"transaction_id={self.transaction_id}, header={self.header})"
        )

    @overload
    async def fetch_data(self) -> bytes: ...

    @overload
    async def fetch_data(self, serializer: Serializer[T]) -> T: ...

    async def fetch_data(self, serializer: Serializer[Any] | None = None) -> Any:
        """The transaction data (from the client cache or the server), deserialized
        with ``serializer`` when given."""
        data = await self._fetch(self.partition_id, self.transaction_id)
        return data if serializer is None else serializer.deserialize(data)

    @overload
    def get_data(self) -> bytes: ...

    @overload
    def get_data(self, serializer: Serializer[T]) -> T: ...

    def get_data(self, serializer: Serializer[Any] | None = None) -> Any:
        """Blocking :meth:`fetch_data` for code off the event loop."""
        if self._blocking is None:
            raise ClientError(
                "Transaction.get_data() blocks, so it cannot run on the client's event loop; "
                "use `await transaction.fetch_data()` in async callbacks"
            )
        data = self._blocking(self.partition_id, self.transaction_id)
        return data if serializer is None else serializer.deserialize(data)


def is_async_callable(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn)
