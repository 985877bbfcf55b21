"""Clients of a storage node: :class:`StorageClient` (the server side of the
server-storage protocol) and :class:`StorageAdminClient` (the admin commands).

A client owns one connection. Requests are pipelined: each gets a fresh
sequence number, is sent in call order, and its response is matched by
``seq_num``, so many requests may be in flight at once::

    client = await StorageClient.connect(transport, "tcp://127.0.0.1:5500", sender="server:1")
    await client.open(cluster_key, num_partitions)
    await client.append(session_id, partition_id, records)

The typed methods raise the error of a FailureResponse
(:class:`~waltz_api.errors.SessionFencedError` with ``highest_session_id``,
:class:`~waltz_api.errors.ClusterKeyMismatchError`, ...); :meth:`request`
returns whatever response arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from waltz_api import wire
from waltz_api.contracts.transport import Connection, Transport
from waltz_api.errors import (
    ConnectionClosedError,
    InvalidArgumentError,
    ProtocolError,
    StorageError,
    TransportError,
    WaltzError,
)
from waltz_api.features import MAX_FEATURE_LEVEL, MIN_FEATURE_LEVEL
from waltz_api.messages import (
    FailureResponse,
    LastSessionInfoRequest,
    LastSessionInfoResponse,
    MarkReplicaRequest,
    MaxTransactionIdRequest,
    MaxTransactionIdResponse,
    Message,
    MissingRangeRequest,
    MissingRangeResponse,
    RecordHeaderListRequest,
    RecordHeaderListResponse,
    RecordHeaderRequest,
    RecordHeaderResponse,
    RecordListRequest,
    RecordListResponse,
    RecordRequest,
    RecordResponse,
    RepairRequest,
    SetLowWaterMarkRequest,
    StorageAdminRequest,
    StorageAdminResponse,
    StorageAppendRequest,
    StorageOpenRequest,
    SuccessResponse,
    TruncateRequest,
)
from waltz_api.outbox import Outbox
from waltz_api.types import PartitionInfo, Record, RecordHeader, SessionInfo
from waltz_server.server.features import mark_at_level, tell_storage_node
from waltz_server.server.replica import REPLICA_CAPABILITIES, LocalLog
from waltz_server.storage_node.failures import error_from_failure

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Message)

DEFAULT_REQUEST_TIMEOUT = 60.0


class StorageClient:
    """A pipelined connection to a storage node (see the module docstring)."""

    def __init__(self, conn: Connection, protocol: wire.ProtocolConnection) -> None:
        self.conn = conn
        self.protocol = protocol
        self.version = protocol.version
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._started: dict[int, asyncio.TimerHandle] = {}
        """Requests of :meth:`start_append`: their timeout; their response is checked
        here, their future resolves to None or to the response's error."""
        self._failure: WaltzError | None = None
        # unbounded: what is in flight is bounded by the callers (one per request)
        self._outbox = Outbox(
            conn, protocol.send, on_failure=self._fail, name=f"storage-client-w-{conn.peer}"
        )
        self._reader = asyncio.create_task(self._read(), name=f"storage-client-{conn.peer}")

    @classmethod
    async def connect(
        cls,
        transport: Transport,
        endpoint: str,
        *,
        sender: str = "server",
        timeout: float = 10.0,
        replace_key: str | None = None,
    ) -> StorageClient:
        """Connect and handshake; raises ConnectError, or ProtocolError on a bad handshake."""
        conn = await transport.connect(endpoint, timeout=timeout, replace_key=replace_key)
        # record lists arrive as blocks (structure checked): a range read forwards them
        # as they came, and records() decodes them (checking every checksum)
        protocol = wire.ProtocolConnection(
            wire.Role.INITIATOR,
            sender=sender,
            max_frame_size=transport.max_frame_size,
            record_blocks=True,
        )
        try:
            await asyncio.wait_for(cls._handshake(conn, protocol), timeout)
        except BaseException:
            with contextlib.suppress(WaltzError):
                await conn.close()
            raise
        return cls(conn, protocol)

    @staticmethod
    async def _handshake(conn: Connection, protocol: wire.ProtocolConnection) -> None:
        await conn.send(protocol.start_handshake())
        frame = await conn.recv()
        if frame[:1] == bytes([FailureResponse.TYPE]):
            refusal = wire.decode(frame)
            reason = refusal.message if isinstance(refusal, FailureResponse) else refusal
            raise ProtocolError(f"the storage node refused the handshake: {reason}")
        protocol.receive_frame(frame)

    # -- plumbing --------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._failure is not None

    def next_seq_num(self) -> int:
        return next(self._seq)

    async def request(
        self, message: Message, *, timeout: float | None = DEFAULT_REQUEST_TIMEOUT
    ) -> Message:
        """Send ``message`` (its ``seq_num`` must be unique among pending ones) and
        return the response with the same ``seq_num``."""
        if self._failure is not None:
            raise self._failure
        seq_num: int = getattr(message, "seq_num")  # noqa: B009 - every storage request has one
        if seq_num in self._pending:
            raise InvalidArgumentError(f"a request with seq_num {seq_num} is already pending")
        future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[seq_num] = future
        try:
            if not self._outbox.post(message):
                raise self._failure or ConnectionClosedError(
                    f"connection to {self.conn.peer} is closed"
                )
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise StorageError(
                f"no response from the storage node {self.conn.peer} to "
                f"{type(message).__name__} (seq_num {seq_num}) within {timeout}s"
            ) from None
        finally:
            self._pending.pop(seq_num, None)

    def start_append(
        self,
        session_id: int,
        partition_id: int,
        records: Sequence[Record],
        *,
        timeout: float = DEFAULT_REQUEST_TIMEOUT,
    ) -> asyncio.Future[None]:
        """:meth:`append`, posted now, as a future: None once the storage node answered
        success, else the error :meth:`append` raises (a FailureResponse's, or
        StorageError when no response came within ``timeout``). The request is queued
        before this returns, so appends started one after another are sent in order;
        no task and no timeout wrapper per request (the store session's hot path).
        Cancelling the future does not recall the request."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if self._failure is not None:
            future.set_exception(self._failure)
            return future
        seq_num = self.next_seq_num()
        message = StorageAppendRequest(session_id, seq_num, partition_id, tuple(records))
        if not self._outbox.post(message):
            future.set_exception(
                self._failure or ConnectionClosedError(f"connection to {self.conn.peer} is closed")
            )
            return future
        self._pending[seq_num] = future
        self._started[seq_num] = loop.call_later(timeout, self._expire, seq_num, timeout)
        return future

    def _expire(self, seq_num: int, timeout: float) -> None:
        """A :meth:`start_append` request got no response in time."""
        self._started.pop(seq_num, None)
        future = self._pending.pop(seq_num, None)
        if future is not None and not future.done():
            future.set_exception(
                StorageError(
                    f"no response from the storage node {self.conn.peer} to "
                    f"StorageAppendRequest (seq_num {seq_num}) within {timeout}s"
                )
            )

    @staticmethod
    def _settle_append(future: asyncio.Future[Any], response: Message) -> None:
        """A :meth:`start_append` request's response, checked as :meth:`_call` does."""
        if isinstance(response, SuccessResponse):
            future.set_result(None)
        elif isinstance(response, FailureResponse):
            future.set_exception(error_from_failure(response))
        else:
            future.set_exception(
                ProtocolError(
                    f"expected SuccessResponse from the storage node, got {type(response).__name__}"
                )
            )

    async def _call(self, message: Message, expected: type[R]) -> R:
        response = await self.request(message)
        if isinstance(response, FailureResponse):
            raise error_from_failure(response)
        if not isinstance(response, expected):
            raise ProtocolError(
                f"expected {expected.__name__} from the storage node, got {type(response).__name__}"
            )
        return response

    async def _read(self) -> None:
        try:
            while True:
                frame = await self.conn.recv()
                if frame[:1] == bytes([FailureResponse.TYPE]) and frame[1:2] != bytes(
                    [self.protocol.version or 0]
                ):
                    message = wire.decode(frame)  # a refusal in another version
                else:
                    message = self.protocol.receive_frame(frame)
                seq_num = getattr(message, "seq_num", None)
                if isinstance(message, FailureResponse) and message.seq_num == -1:
                    raise ProtocolError(
                        f"the storage node closed the connection: {message.message}"
                    )
                future = self._pending.get(seq_num) if isinstance(seq_num, int) else None
                if future is None:
                    log.warning(
                        "storage node %s sent %s with no pending request (seq_num %s)",
                        self.conn.peer,
                        type(message).__name__,
                        seq_num,
                    )
                    continue
                if (
                    isinstance(seq_num, int)
                    and (timer := self._started.pop(seq_num, None)) is not None
                ):  # a start_append request: settled here
                    timer.cancel()
                    del self._pending[seq_num]
                    if not future.done():
                        self._settle_append(future, message)
                elif not future.done():
                    future.set_result(message)
        except WaltzError as exc:
            self._fail(exc)

    def _fail(self, exc: WaltzError) -> None:
        if self._failure is None:
            self._failure = (
                exc
                if isinstance(exc, ConnectionClosedError | ProtocolError)
                else ConnectionClosedError(f"connection to {self.conn.peer} failed: {exc}")
            )
        self._outbox.abort()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(self._failure)
        for seq_num, timer in self._started.items():
            timer.cancel()
            self._pending.pop(seq_num, None)
        self._started.clear()

    async def close(self) -> None:
        self._fail(
            ConnectionClosedError(f"connection to {self.conn.peer} was closed by this client")
        )
        with contextlib.suppress(TransportError):
            await self.conn.close()
        self._reader.cancel()
        await self._outbox.close()
        with contextlib.suppress(BaseException):
            await self._reader

    async def __aenter__(self) -> StorageClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- the ten request patterns ------------------------------------------------------

    async def open(self, cluster_key: uuid.UUID, num_partitions: int) -> None:
        await self._call(
            StorageOpenRequest(-1, self.next_seq_num(), -1, cluster_key, num_partitions),
            SuccessResponse,
        )

    async def last_session_info(self, session_id: int, partition_id: int) -> SessionInfo:
        response = await self._call(
            LastSessionInfoRequest(session_id, self.next_seq_num(), partition_id),
            LastSessionInfoResponse,
        )
        return response.session_info

    async def max_transaction_id(self, session_id: int, partition_id: int) -> int:
        response = await self._call(
            MaxTransactionIdRequest(session_id, self.next_seq_num(), partition_id),
            MaxTransactionIdResponse,
        )
        return response.transaction_id

    async def truncate(self, session_id: int, partition_id: int, transaction_id: int) -> None:
        await self._call(
            TruncateRequest(session_id, self.next_seq_num(), partition_id, transaction_id),
            SuccessResponse,
        )

    async def set_low_water_mark(
        self, session_id: int, partition_id: int, low_water_mark: int
    ) -> None:
        await self._call(
            SetLowWaterMarkRequest(session_id, self.next_seq_num(), partition_id, low_water_mark),
            SuccessResponse,
        )

    async def mark_replica(
        self,
        session_id: int,
        partition_id: int,
        low_water_mark: int,
        *,
        clean: bool,
        log_end: int = -1,
    ) -> None:
        await self._call(
            MarkReplicaRequest(
                session_id, self.next_seq_num(), partition_id, low_water_mark, clean, log_end
            ),
            SuccessResponse,
        )

    async def append(self, session_id: int, partition_id: int, records: Sequence[Record]) -> None:
        await self._call(
            StorageAppendRequest(session_id, self.next_seq_num(), partition_id, tuple(records)),
            SuccessResponse,
        )

    async def missing_range(self, session_id: int, partition_id: int) -> tuple[int, int] | None:
        """The lowest range of the replica's log lost to damage (``None``: none)."""
        response = await self._call(
            MissingRangeRequest(session_id, self.next_seq_num(), partition_id),
            MissingRangeResponse,
        )
        return None if response.first < 0 else (response.first, response.last)

    async def repair(self, session_id: int, partition_id: int, records: Sequence[Record]) -> None:
        """Fill (the start of) the lowest missing range with records copied from a peer."""
        await self._call(
            RepairRequest(session_id, self.next_seq_num(), partition_id, tuple(records)),
            SuccessResponse,
        )

    async def record_header(
        self, session_id: int, partition_id: int, transaction_id: int
    ) -> RecordHeader | None:
        response = await self._call(
            RecordHeaderRequest(session_id, self.next_seq_num(), partition_id, transaction_id),
            RecordHeaderResponse,
        )
        return response.record_header

    async def record(
        self, session_id: int, partition_id: int, transaction_id: int
    ) -> Record | None:
        response = await self._call(
            RecordRequest(session_id, self.next_seq_num(), partition_id, transaction_id),
            RecordResponse,
        )
        return response.record

    async def record_headers(
        self, session_id: int, partition_id: int, transaction_id: int, max_records: int
    ) -> list[RecordHeader]:
        response = await self._call(
            RecordHeaderListRequest(
                session_id, self.next_seq_num(), partition_id, transaction_id, max_records
            ),
            RecordHeaderListResponse,
        )
        return list(response.record_headers)

    async def records(
        self,
        session_id: int,
        partition_id: int,
        transaction_id: int,
        max_records: int,
        max_bytes: int = 16 * 1024 * 1024,
    ) -> list[Record]:
        block = await self.record_block(
            session_id, partition_id, transaction_id, max_records, max_bytes
        )
        try:
            return list(block)
        except ProtocolError as exc:  # a bad checksum: as if the frame had been refused
            self._fail(exc)
            raise

    async def record_block(
        self,
        session_id: int,
        partition_id: int,
        transaction_id: int,
        max_records: int,
        max_bytes: int = 16 * 1024 * 1024,
    ) -> Sequence[Record]:
        """The records as the storage node sent them (a :class:`~waltz_api.wire.RecordBlock`:
        nothing decoded, checksums not yet verified; iterating it verifies them)."""
        response = await self._call(
            RecordListRequest(
                session_id,
                self.next_seq_num(),
                partition_id,
                transaction_id,
                max_records,
                max_bytes,
            ),
            RecordListResponse,
        )
        return response.records


class StorageAdminClient:
    """The admin commands of a storage node (used by ``waltz storage list`` and friends)."""

    def __init__(self, client: StorageClient) -> None:
        self.client = client

    @classmethod
    async def connect(
        cls, transport: Transport, endpoint: str, *, sender: str = "admin", timeout: float = 10.0
    ) -> StorageAdminClient:
        return cls(await StorageClient.connect(transport, endpoint, sender=sender, timeout=timeout))

    async def close(self) -> None:
        await self.client.close()

    async def __aenter__(self) -> StorageAdminClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def command(
        self, command: str, *, timeout: float | None = DEFAULT_REQUEST_TIMEOUT, **arguments: Any
    ) -> dict[str, Any]:
        """Run an admin command (waiting ``timeout`` seconds for the answer, None: as long
        as it takes); raises StorageError with the node's message on failure."""
        request = StorageAdminRequest(
            self.client.next_seq_num(), command, json.dumps(arguments).encode("utf-8")
        )
        response = await self.client.request(request, timeout=timeout)
        if isinstance(response, FailureResponse):
            raise error_from_failure(response)
        if not isinstance(response, StorageAdminResponse):
            raise ProtocolError(f"expected StorageAdminResponse, got {type(response).__name__}")
        if not response.success:
            raise StorageError(f"storage node refused {command!r}: {response.error}")
        result = json.loads(response.result.decode("utf-8")) if response.result else {}
        if not isinstance(result, dict):
            raise ProtocolError(f"admin result of {command!r} is not a JSON object")
        return result

    async def info(self) -> dict[str, Any]:
        return await self.command("info")

    async def set_feature_level(self, level: int, cluster_key: uuid.UUID | str) -> dict[str, Any]:
        """The cluster's feature level, told (StorageError: the node cannot write it)."""
        return await self.command("set_feature_level", level=level, cluster_key=str(cluster_key))

    async def list_partitions(self) -> list[PartitionInfo]:
        """Every hosted partition; one that could not be recovered shows max id -2
        and unavailable (``list_partitions_raw`` has its error)."""
        rows = await self.list_partitions_raw()
        infos = []
        for row in rows:
            session = row.get("session_info") or {}
            infos.append(
                PartitionInfo(
                    partition_id=row["partition_id"],
                    session_info=SessionInfo(
                        session.get("session_id", -1),
                        session.get("low_water_mark", -1),
                        session.get("local_low_water_mark", -1),
                        session.get("low_water_mark_session_id", -1),
                    ),
                    max_transaction_id=(
                        row["max_transaction_id"] if row["max_transaction_id"] is not None else -2
                    ),
                    available=bool(row["available"]) and row.get("error") is None,
                )
            )
        return infos

    async def list_partitions_raw(self) -> list[dict[str, Any]]:
        result = await self.command("list")
        return list(result["partitions"])

    async def max_transaction_id(self, partition_id: int) -> int:
        result = await self.command("max_transaction_id", partition_id=partition_id)
        return int(result["max_transaction_id"])

    async def add_partition(self, partition_id: int, cluster_key: uuid.UUID | str) -> None:
        await self.command("add_partition", partition_id=partition_id, cluster_key=str(cluster_key))

    async def remove_partition(self, partition_id: int, cluster_key: uuid.UUID | str) -> None:
        await self.command(
            "remove_partition", partition_id=partition_id, cluster_key=str(cluster_key)
        )

    async def set_availability(
        self, partition_id: int, available: bool, cluster_key: uuid.UUID | str
    ) -> None:
        await self.command(
            "set_availability",
            partition_id=partition_id,
            available=available,
            cluster_key=str(cluster_key),
        )

    async def local_log(self, partition_id: int) -> LocalLog:
        """The partition's local log (start, end, segments)."""
        return LocalLog.from_json(await self.command("local_log", partition_id=partition_id))

    async def prune(
        self, partition_id: int, through: int, session_id: int, cluster_key: uuid.UUID | str
    ) -> int:
        """Delete the partition's local records up to ``through`` (archived and verified:
        the caller's promise, docs/archive.md), fenced as store session ``session_id``;
        the new log start."""
        result = await self.command(
            "prune",
            partition_id=partition_id,
            through=through,
            session_id=session_id,
            cluster_key=str(cluster_key),
        )
        return int(result["log_start"])


class StorageReplica:
    """One partition on one storage node, for one store session (the server's
    ``waltz_server.server.replica.ReplicaConnection``), over a :class:`StorageClient`.

    Every request carries ``session_id``; a node that has seen a newer session
    raises SessionFencedError. Safe for concurrent calls (requests are pipelined).
    """

    def __init__(
        self,
        client: StorageClient,
        storage_node: str,
        partition_id: int,
        session_id: int,
        *,
        owns_client: bool = False,
        cluster_key: uuid.UUID | None = None,
        feature_level: Callable[[], int] = lambda: MAX_FEATURE_LEVEL,
    ) -> None:
        self.client = client
        self._storage_node = storage_node
        self.partition_id = partition_id
        self.session_id = session_id
        self._owns_client = owns_client
        self._cluster_key = cluster_key
        self._feature_level = feature_level

    @property
    def storage_node(self) -> str:
        return self._storage_node

    @property
    def capabilities(self) -> frozenset[str]:
        """Both optional features: the node refuses ``prune`` (StorageError) when its
        engine cannot delete a prefix."""
        return REPLICA_CAPABILITIES

    async def last_session_info(self) -> SessionInfo:
        return await self.client.last_session_info(self.session_id, self.partition_id)

    async def max_transaction_id(self) -> int:
        return await self.client.max_transaction_id(self.session_id, self.partition_id)

    async def truncate(self, transaction_id: int) -> None:
        await self.client.truncate(self.session_id, self.partition_id, transaction_id)

    async def set_low_water_mark(self, low_water_mark: int) -> None:
        await self.client.set_low_water_mark(self.session_id, self.partition_id, low_water_mark)

    async def mark_replica(self, low_water_mark: int, *, clean: bool, log_end: int = -1) -> None:
        """MarkReplicaRequest from feature level 2 on (see :func:`mark_at_level`)."""
        level, session, partition = self._feature_level(), self.session_id, self.partition_id
        await mark_at_level(
            self.client, level, session, partition, low_water_mark, clean=clean, log_end=log_end
        )

    async def append(self, records: Sequence[Record]) -> None:
        await self.client.append(self.session_id, self.partition_id, records)

    def start_append(self, records: Sequence[Record]) -> asyncio.Future[None]:
        """:meth:`append` as a future, the request posted now
        (:meth:`StorageClient.start_append`): the store session's write loop."""
        return self.client.start_append(self.session_id, self.partition_id, records)

    async def missing_range(self) -> tuple[int, int] | None:
        return await self.client.missing_range(self.session_id, self.partition_id)

    async def repair(self, records: Sequence[Record]) -> None:
        await self.client.repair(self.session_id, self.partition_id, records)

    async def read_records(self, start: int, max_records: int, max_bytes: int) -> list[Record]:
        return await self.client.records(
            self.session_id, self.partition_id, start, max_records, max_bytes
        )

    async def read_block(self, start: int, max_records: int, max_bytes: int) -> Sequence[Record]:
        """:meth:`read_records` as the storage node's block (see StorageClient.record_block)."""
        return await self.client.record_block(
            self.session_id, self.partition_id, start, max_records, max_bytes
        )

    async def read_headers(self, start: int, max_records: int) -> list[RecordHeader]:
        return await self.client.record_headers(
            self.session_id, self.partition_id, start, max_records
        )

    async def local_log(self) -> LocalLog:
        """The replica's local log (start, end, segments): an admin command."""
        return await StorageAdminClient(self.client).local_log(self.partition_id)

    async def prune(self, through: int) -> int:
        """Delete the replica's local records up to ``through`` (archived and verified),
        fenced by this session; the new log start."""
        if self._cluster_key is None:
            raise StorageError(
                f"replica {self._storage_node} of partition {self.partition_id} was connected "
                "without the cluster key: it cannot be pruned"
            )
        return await StorageAdminClient(self.client).prune(
            self.partition_id, through, self.session_id, self._cluster_key
        )

    async def close(self) -> None:
        if self._owns_client:
            await self.client.close()


def replica_connector(
    transport: Transport,
    cluster_key: uuid.UUID,
    num_partitions: int,
    *,
    sender: str = "server",
    timeout: float = 10.0,
) -> Callable[[str, int, int], Awaitable[StorageReplica]]:
    """A ``connector(storage_node, partition_id, session_id)`` that opens a new
    connection per replica (connect, handshake, cluster key check); the
    storage node string is the endpoint to connect to."""

    async def connect(storage_node: str, partition_id: int, session_id: int) -> StorageReplica:
        client = await StorageClient.connect(
            transport, storage_node, sender=sender, timeout=timeout
        )
        try:
            await client.open(cluster_key, num_partitions)
        except BaseException:
            await client.close()
            raise
        return StorageReplica(
            client,
            storage_node,
            partition_id,
            session_id,
            owns_client=True,
            cluster_key=cluster_key,
        )

    return connect


class StorageConnectionPool:
    """One pipelined, opened connection per storage node, shared by every replica
    on that node (a ``ReplicaConnector``: ``await pool.connect(node, partition, session)``).

    A replica stays bound to the connection it was given: when that connection
    breaks, the replica's calls raise ConnectionClosedError (the store session
    has lost the replica, as the spec wants), and the next ``connect`` for that
    node opens a new connection.
    """

    def __init__(
        self,
        transport: Transport,
        cluster_key: uuid.UUID,
        num_partitions: int,
        *,
        sender: str = "server",
        timeout: float = 10.0,
        feature_level: Callable[[], int] = lambda: MAX_FEATURE_LEVEL,
    ) -> None:
        self.transport = transport
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.sender = sender
        self.timeout = timeout
        self.feature_level = feature_level  # from 2 on, told to each node connected
        self._clients: dict[str, StorageClient] = {}
        self._told: dict[str, int] = {}  # the level each node was told on its connection
        self._locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    async def client(self, storage_node: str) -> StorageClient:
        """The live, opened connection to ``storage_node`` (made when needed)."""
        if self._closed:
            raise ConnectionClosedError("the storage connection pool is closed")
        async with self._locks.setdefault(storage_node, asyncio.Lock()):
            client = self._clients.get(storage_node)
            if client is not None and not client.closed and not client.conn.closed:
                return client
            if client is not None:
                await client.close()
            client = await StorageClient.connect(
                self.transport, storage_node, sender=self.sender, timeout=self.timeout
            )
            try:
                await client.open(self.cluster_key, self.num_partitions)
                self._told.pop(storage_node, None)
                await self._tell_level(storage_node, client)
            except BaseException:
                await client.close()
                raise
            self._clients[storage_node] = client
            return client

    async def _tell_level(self, storage_node: str, client: StorageClient) -> None:
        level = self.feature_level()
        if level > max(MIN_FEATURE_LEVEL, self._told.get(storage_node, 0)) and (
            await tell_storage_node(
                StorageAdminClient(client), storage_node, level, self.cluster_key
            )
        ):
            self._told[storage_node] = level

    async def tell_level(self) -> None:
        """Tell every connected storage node the feature level (after it rose)."""
        for storage_node, client in list(self._clients.items()):
            if client.closed or client.conn.closed:
                continue
            async with self._locks.setdefault(storage_node, asyncio.Lock()):
                if self._clients.get(storage_node) is client:
                    with contextlib.suppress(TransportError, OSError):
                        await self._tell_level(storage_node, client)

    async def connect(
        self, storage_node: str, partition_id: int, session_id: int
    ) -> StorageReplica:
        client = await self.client(storage_node)
        return StorageReplica(
            client,
            storage_node,
            partition_id,
            session_id,
            cluster_key=self.cluster_key,
            feature_level=self.feature_level,
        )

    async def close(self) -> None:
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
