"""Clients of a storage node: :class:`StorageClient` (the requesting side of the
server-storage protocol) and :class:`StorageAdminClient` (the admin commands).

Both products use them: the server (``waltz_server.server.storage_client``: its
replicas over a StorageClient) and the storage node's admin commands
(``waltz storage list`` ...), so they live here, below both.

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
from collections.abc import Sequence
from typing import Any, TypeVar

from waltz_api import wire
from waltz_api.contracts.storage import LocalLog
from waltz_api.contracts.transport import Connection, Transport
from waltz_api.errors import (
    ConnectionClosedError,
    InvalidArgumentError,
    ProtocolError,
    StorageError,
    TransportError,
    WaltzError,
)
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
from waltz_api.storage_failures import error_from_failure
from waltz_api.types import PartitionInfo, Record, RecordHeader, SessionInfo

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
