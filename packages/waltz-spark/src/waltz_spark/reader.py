"""A small synchronous reader of committed records: what Spark executors run.

:class:`LogReader` connects to a partition's server through the transport plugin,
does the Hello handshake and sends :class:`~waltz_api.messages.RangeReadRequest`
in a loop (one in flight), following the partition when its server moved
(re-reads the assignment in coordination). It needs no mount and no feed, so it
costs one connection per server. Blocking: it runs its own asyncio loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from waltz_api import wire
from waltz_api.cluster import (
    ArchiveMark,
    ClusterMetadata,
    PartitionAssignment,
    coordination_from_uri,
)
from waltz_api.contracts.transport import Connection, Transport
from waltz_api.errors import ConfigError, ServerError, TransportError, WaltzError
from waltz_api.messages import (
    ErrorCode,
    ErrorResponse,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    Message,
    RangeReadRequest,
    RangeReadResponse,
)
from waltz_api.plugins import get_registry
from waltz_api.types import Record, ReqId

log = logging.getLogger(__name__)

T = TypeVar("T")

READER_CLIENT_ID = -2
"""The client id of range reads (never a mounted client: reads need no client id)."""

_RETRY_CODES = frozenset(
    {ErrorCode.PARTITION_NOT_ASSIGNED, ErrorCode.STALE_GENERATION, ErrorCode.SERVER_BUSY}
)


@dataclass(frozen=True)
class Endpoint:
    """Where a partition is served (as the driver saw it when planning)."""

    endpoint: str
    generation: int


class LogReader:
    """Blocking reads of committed records and high-water marks.

    ::

        with LogReader("zk://127.0.0.1:2181/waltz") as reader:
            top = reader.high_water_mark(0)
            for records in reader.read(0, 0, top + 1):
                ...
    """

    def __init__(
        self,
        coordination: str,
        *,
        transport: str = "zmq",
        transport_options: dict[str, Any] | None = None,
        timeout: float = 60.0,
        retry_interval: float = 0.2,
    ) -> None:
        if not coordination:
            raise ConfigError(
                "the Waltz coordination URI is missing: pass the `coordination` option "
                "(e.g. zk://127.0.0.1:2181/waltz or local:///var/lib/waltz?root=/waltz)",
                key="coordination",
            )
        self.uri = coordination
        self.transport_name = transport
        self.transport_options = dict(transport_options or {})
        self.timeout = timeout
        self.retry_interval = retry_interval
        self._runner = asyncio.Runner()
        self._transport: Transport | None = None
        self._num_partitions: int | None = None
        self._connections: dict[str, tuple[Connection, wire.ProtocolConnection]] = {}
        self._known: dict[int, Endpoint] = {}
        self._seq = itertools.count(1)
        self._stash: dict[ReqId, Message] = {}
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> LogReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._runner.run(self._aclose())
        finally:
            self._runner.close()

    async def _aclose(self) -> None:
        for conn, _ in self._connections.values():
            try:
                await conn.close()
            except WaltzError as exc:
                log.debug("closing %s: %s", conn.peer, exc)
        self._connections.clear()
        if self._transport is not None:
            await self._transport.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise ServerError("the Waltz log reader is closed")
        box: list[T] = []

        async def run() -> None:
            # the result is kept off the task: asyncio may repr a finished task, and the
            # repr of a large RangeReadResponse costs more than reading it
            box.append(await coro)

        self._runner.run(run())
        return box[0]

    # -- cluster ----------------------------------------------------------------------------

    async def _ask(self, question: Callable[[ClusterMetadata], Awaitable[T]]) -> T:
        """One coordination session per question: a blocking reader's loop does not run
        between calls, so a session kept open would expire unseen."""
        coordination = coordination_from_uri(self.uri)
        await coordination.start()
        try:
            return await question(ClusterMetadata(coordination))
        finally:
            await coordination.close()

    def num_partitions(self) -> int:
        if self._num_partitions is None:

            async def count(metadata: ClusterMetadata) -> int:
                return (await metadata.config()).num_partitions

            self._num_partitions = self._run(self._ask(count))
        return self._num_partitions

    def archive_marks(self, partitions: Sequence[int]) -> dict[int, ArchiveMark]:
        """Each partition's archive mark (mark -1: nothing archived; docs/archive.md)."""

        async def read(metadata: ClusterMetadata) -> dict[int, ArchiveMark]:
            return {p: (await metadata.archive_mark(p)).value for p in partitions}

        return self._run(self._ask(read))

    def locate(self, partition_id: int) -> Endpoint:
        """The partition's current server (from coordination)."""
        return self._run(self._locate(partition_id))

    async def _locate(self, partition_id: int) -> Endpoint:
        async def owner(metadata: ClusterMetadata) -> PartitionAssignment:
            return (await metadata.partition_assignment(partition_id)).value

        assignment = await self._ask(owner)
        found = Endpoint(assignment.endpoint, assignment.generation)
        self._known[partition_id] = found
        return found

    def prime(self, partition_id: int, endpoint: Endpoint) -> None:
        """Use ``endpoint`` for the partition without asking coordination (a planned split)."""
        self._known.setdefault(partition_id, endpoint)

    # -- requests ---------------------------------------------------------------------------

    async def _connection(self, endpoint: str) -> tuple[Connection, wire.ProtocolConnection]:
        found = self._connections.get(endpoint)
        if found is not None and not found[0].closed:
            return found
        if self._transport is None:
            self._transport = (
                get_registry().get("transport", self.transport_name).factory(self.transport_options)
            )
        transport = self._transport
        conn = await transport.connect(endpoint, timeout=min(self.timeout, 10.0))
        # range reads arrive as record blocks: checked and decoded once, by the caller
        protocol = wire.ProtocolConnection(
            wire.Role.INITIATOR,
            sender="spark-reader",
            max_frame_size=transport.max_frame_size,
            record_blocks=True,
        )
        try:
            await conn.send(protocol.start_handshake())
            protocol.receive_frame(await asyncio.wait_for(conn.recv(), self.timeout))
        except BaseException:
            await conn.close()
            raise
        self._connections[endpoint] = (conn, protocol)
        return conn, protocol

    async def _call(self, partition_id: int, make: Any) -> Message:
        """Send one request to the partition's server and wait for its answer, retrying
        (bounded by ``timeout``) when the partition moved or the connection broke."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        attempt = 0
        while True:
            attempt += 1
            where = self._known.get(partition_id)
            if where is None or not where.endpoint:
                where = await self._locate(partition_id)
            problem = f"partition {partition_id} has no server"
            if where.endpoint:
                req_id = ReqId(READER_CLIENT_ID, where.generation, partition_id, next(self._seq))
                try:
                    conn, protocol = await self._connection(where.endpoint)
                    await conn.send(protocol.send(make(req_id)))
                    remaining = max(deadline - loop.time(), 0.001)
                    while True:
                        reply = protocol.receive_frame(
                            await asyncio.wait_for(conn.recv(), remaining)
                        )
                        if getattr(reply, "req_id", None) == req_id:
                            break
                    if not (isinstance(reply, ErrorResponse) and reply.code in _RETRY_CODES):
                        return reply
                    problem = f"{reply.code.name}: {reply.message}"
                except (TransportError, TimeoutError) as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                    dropped = self._connections.pop(where.endpoint, None)
                    if dropped is not None:
                        await dropped[0].close()
            self._known.pop(partition_id, None)
            if loop.time() >= deadline:
                raise ServerError(
                    f"partition {partition_id}: no answer within {self.timeout} s after "
                    f"{attempt} attempts (last: {problem}); check that its server is running"
                )
            log.debug("partition %d: retrying (%s)", partition_id, problem)
            await asyncio.sleep(self.retry_interval)

    def high_water_mark(self, partition_id: int) -> int:
        """The partition's committed high-water mark (-1: empty)."""
        return self._run(self._high_water_mark(partition_id))

    async def _high_water_mark(self, partition_id: int) -> int:
        reply = await self._call(partition_id, HighWaterMarkRequest)
        if not isinstance(reply, HighWaterMarkResponse):
            raise ServerError(f"partition {partition_id}: unexpected answer {reply!r}")
        return reply.transaction_id

    def high_water_marks(self, partitions: Sequence[int]) -> dict[int, int]:
        async def read() -> dict[int, int]:
            return {p: await self._high_water_mark(p) for p in partitions}

        return self._run(read())

    def read(
        self,
        partition_id: int,
        start: int,
        end: int,
        *,
        max_records: int = 10_000,
        max_bytes: int = 16 * 1024 * 1024,
        depth: int = 3,
    ) -> Iterator[tuple[Record, ...]]:
        """Committed records ``start <= transaction_id < end`` in order, in chunks
        (see :meth:`read_blocks`; each chunk decoded to records, every checksum and id
        verified)."""
        position = start
        for block in self._blocks(
            partition_id, start, end, max_records=max_records, max_bytes=max_bytes, depth=depth
        ):
            records = block.records()
            for i, record in enumerate(records):
                if record.transaction_id != position + i:
                    raise ServerError(
                        f"partition {partition_id}: transaction {record.transaction_id} "
                        f"where {position + i} was expected"
                    )
            position += len(records)
            yield records

    def read_blocks(
        self,
        partition_id: int,
        start: int,
        end: int,
        *,
        max_records: int = 10_000,
        max_bytes: int = 16 * 1024 * 1024,
        depth: int = 3,
    ) -> Iterator[tuple[wire.RecordBlock, list[int]]]:
        """Committed records ``start <= transaction_id < end`` in order, in chunks as the
        server sent them: ``(block, offsets)``, a :class:`~waltz_api.wire.RecordBlock`
        whose every checksum and id was verified, and where each record starts in it
        (:meth:`RecordBlock.check`). No Record object is built.

        Up to ``depth`` range reads are in flight (the next chunks are asked for while
        one is checked); a short chunk (``max_bytes``) discards the ones asked ahead.
        Raises ServerError when a record of the range is not committed (``end`` above
        the high-water mark + 1), and ProtocolError (ChecksumError) for a corrupt record."""
        position = start
        for block in self._blocks(
            partition_id, start, end, max_records=max_records, max_bytes=max_bytes, depth=depth
        ):
            yield block, block.check(position)
            position += len(block)

    def _blocks(
        self,
        partition_id: int,
        start: int,
        end: int,
        *,
        max_records: int,
        max_bytes: int,
        depth: int,
    ) -> Iterator[wire.RecordBlock]:
        """The range's chunks as received (cut at ``end``; first ids checked)."""
        position = start
        ahead: deque[tuple[ReqId, int, int]] = deque()
        while position < end:
            reply = self._run(
                self._next_chunk(
                    partition_id,
                    position=position,
                    end=end,
                    max_records=max_records,
                    max_bytes=max_bytes,
                    depth=depth,
                    ahead=ahead,
                )
            )
            if isinstance(reply, ErrorResponse):
                raise ServerError(
                    f"partition {partition_id}: range read from {position} refused: "
                    f"{reply.code.name}: {reply.message}"
                )
            if not isinstance(reply, RangeReadResponse):
                raise ServerError(f"partition {partition_id}: unexpected answer {reply!r}")
            block = wire.RecordBlock.of(reply.records)
            if not block:
                raise ServerError(
                    f"partition {partition_id}: transactions {position}..{end - 1} are not "
                    f"committed (high-water mark {reply.high_water_mark})"
                )
            if block.first_transaction_id != position:
                raise ServerError(
                    f"partition {partition_id}: asked for {position}, got "
                    f"{block.first_transaction_id}"
                )
            if position + len(block) > end:
                block = block.cut(end - position)
            position += len(block)
            if ahead and ahead[0][1] != position:
                ahead.clear()  # a short chunk: what was asked ahead starts elsewhere
            yield block

    async def _next_chunk(
        self,
        partition_id: int,
        *,
        position: int,
        end: int,
        max_records: int,
        max_bytes: int,
        depth: int,
        ahead: deque[tuple[ReqId, int, int]],
    ) -> Message:
        where = self._known.get(partition_id)
        try:
            if where is None or not where.endpoint:
                raise _Fallback
            conn, protocol = await self._connection(where.endpoint)
            next_at = ahead[-1][1] + ahead[-1][2] if ahead else position
            while len(ahead) < max(depth, 1) and next_at < end:
                count = min(max_records, end - next_at)
                req_id = ReqId(READER_CLIENT_ID, where.generation, partition_id, next(self._seq))
                await conn.send(protocol.send(RangeReadRequest(req_id, next_at, count, max_bytes)))
                ahead.append((req_id, next_at, count))
                next_at += count
            wanted, at, _ = ahead.popleft()
            if at != position:
                raise _Fallback
            reply = await self._reply(conn, protocol, wanted, {r for r, _, _ in ahead})
            if isinstance(reply, ErrorResponse) and reply.code in _RETRY_CODES:
                raise _Fallback
            return reply
        except (_Fallback, TransportError, TimeoutError) as exc:
            log.debug("partition %d: range read pipeline restarts: %r", partition_id, exc)
            ahead.clear()
            self._stash.clear()
            if where is not None and where.endpoint:
                dropped = self._connections.pop(where.endpoint, None)
                if dropped is not None:
                    await dropped[0].close()
            self._known.pop(partition_id, None)
            count = min(max_records, end - position)
            return await self._call(
                partition_id, lambda req: RangeReadRequest(req, position, count, max_bytes)
            )

    async def _reply(
        self,
        conn: Connection,
        protocol: wire.ProtocolConnection,
        wanted: ReqId,
        later: set[ReqId],
    ) -> Message:
        """The answer to ``wanted`` (answers to ``later`` requests are kept for later;
        answers to abandoned requests are dropped)."""
        found = self._stash.pop(wanted, None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while found is None:
            remaining = max(deadline - loop.time(), 0.001)
            reply = protocol.receive_frame(await asyncio.wait_for(conn.recv(), remaining))
            req_id = getattr(reply, "req_id", None)
            if req_id == wanted:
                found = reply
            elif req_id in later:
                self._stash[req_id] = reply
        return found


class _Fallback(Exception):
    """The pipelined path cannot go on: one request through the retrying path."""
