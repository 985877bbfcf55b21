"""The storage node: serves the server-storage protocol over a Transport.

One asyncio event loop. Each accepted connection has a reader (this module)
and a writer task; each hosted partition has a :class:`PartitionWorker` that
processes that partition's requests in order (an append runs to completion in the
callbacks that receive it and its durability: no task in between). See
``partition.py`` for that, the fencing and low-water mark semantics, ``admin.py``
for the admin commands.

A connection starts with the Hello handshake. Then:

- ``StorageOpenRequest`` checks the cluster key and number of partitions;
  until one succeeded, every partition request on the connection is refused
  with ``NOT_OPEN`` (a failed open answers ``CLUSTER_KEY_MISMATCH``).
- ``StorageAdminRequest`` is served on any connection (mutating commands carry
  the cluster key in their arguments instead).
- A frame that does not decode is answered with ``FailureResponse(code=BAD_REQUEST,
  seq_num=-1)`` and the connection is closed; other connections are untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import TYPE_CHECKING, Any

from waltz_api import wire
from waltz_api.contracts.storage import StorageEngine
from waltz_api.contracts.transport import Connection, Listener, Transport
from waltz_api.errors import (
    ClusterKeyMismatchError,
    ConnectionClosedError,
    PartitionNotFoundError,
    ProtocolError,
    StorageError,
    TransportError,
    WaltzError,
)
from waltz_api.messages import (
    ErrorCode,
    FailureResponse,
    Message,
    StorageAdminRequest,
    StorageAdminResponse,
    StorageOpenRequest,
    SuccessResponse,
)
from waltz_api.outbox import Outbox
from waltz_api.peerlog import PeerLog
from waltz_api.storage_failures import StorageNotOpenError, StorageRequestError
from waltz_storage_node.admin import run_admin_command
from waltz_storage_node.partition import PARTITION_REQUESTS, PartitionWorker, failure_for

if TYPE_CHECKING:
    from waltz_storage_node.metrics import StorageNodeMetrics
    from waltz_storage_node.scrub import Scrubber

log = logging.getLogger(__name__)
_refusals = PeerLog(log)
"""Peers refused for bad input (a failed handshake, a malformed frame): one line each, at
most 10 a minute in all, so that a hostile peer cannot flood the log."""

OUTBOX_FRAMES = 4096
"""Responses queued per connection before a partition worker waits for the peer to read."""
REQUEST_KINDS = tuple(
    kind.__name__ for kind in (*PARTITION_REQUESTS, StorageOpenRequest, StorageAdminRequest)
)
"""What a storage node serves: the ``kind`` labels of its request counter."""


def _outbox(
    conn: Connection, protocol: wire.ProtocolConnection, metrics: StorageNodeMetrics | None
) -> Outbox:
    """The connection's outbox of responses (bounded: a partition worker waits while
    the peer does not read)."""

    def encode(message: Message) -> bytes:
        if metrics is not None and type(message) is FailureResponse:
            metrics.error(message.code.name.lower())
        if protocol.state is not wire.ConnectionState.OPEN:
            # the peer broke the protocol: this is the last frame, telling it why
            return wire.encode(message, max_frame_size=protocol.max_frame_size)
        try:
            return protocol.send(message)
        except ProtocolError as exc:
            # e.g. one record larger than a frame: the request still gets an answer
            log.error("cannot send %s to %s: %s", type(message).__name__, conn.peer, exc)
            return protocol.send(
                FailureResponse(
                    getattr(message, "session_id", -1),
                    getattr(message, "seq_num", -1),
                    getattr(message, "partition_id", -1),
                    ErrorCode.GENERIC,
                    f"the response could not be sent: {exc}",
                )
            )

    return Outbox(conn, encode, max_frames=OUTBOX_FRAMES, name=f"storage-out-{conn.connection_id}")


class StorageNode:
    """Serves a StorageEngine's partitions over a Transport endpoint."""

    def __init__(
        self,
        engine: StorageEngine,
        transport: Transport,
        endpoint: str,
        *,
        queue_size: int = 1000,
        queue_bytes: int = 64 * 1024 * 1024,
        max_append_batch_records: int = 10000,
        max_list_records: int = 10000,
        sender: str = "storage",
        handshake_timeout: float = 30.0,
        metrics: StorageNodeMetrics | None = None,
        capabilities: frozenset[str] = frozenset(),
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        """Prometheus metrics of the node (see :mod:`waltz_storage_node.metrics`), if any."""
        if metrics is not None:
            metrics.expect_requests(REQUEST_KINDS)
        self.capabilities = capabilities
        """The optional features the engine's plugin declares (``waltz_api.capabilities``)."""
        self.scrubber: Scrubber | None = None
        """The background scrub (:mod:`waltz_storage_node.scrub`): started and
        stopped with the node when set before :meth:`start`."""
        self.transport = transport
        self.handshake_timeout = handshake_timeout
        self.requested_endpoint = endpoint
        self.sender = sender
        self._queue_size = queue_size
        self._queue_bytes = queue_bytes
        self._max_batch = max_append_batch_records
        self._max_list = max_list_records
        # A list response must fit in a frame, with room for the framing around the data.
        self._max_response_bytes = max(1024, transport.max_frame_size // 2)
        self._workers: dict[int, PartitionWorker] = {}
        self._partition_locks: dict[int, asyncio.Lock] = {}
        self._listener: Listener | None = None
        self._connections: set[Connection] = set()
        self._serving: dict[int, set[Connection]] = {}
        """Per partition, the opened connections that sent requests for it."""
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------

    @property
    def serving(self) -> bool:
        """Whether the node is started and not closed."""
        return self._listener is not None and not self._closed

    @property
    def endpoint(self) -> str:
        """The endpoint clients connect to (resolved once started)."""
        if self._listener is None:
            raise StorageError("the storage node is not started")
        return self._listener.endpoint

    async def start(self) -> None:
        for partition_id in self.engine.partition_ids():
            self._worker(partition_id)
        self._listener = await self.transport.listen(self.requested_endpoint, self._serve)
        log.info(
            "storage node listening on %s: %d partitions hosted, cluster key %s",
            self._listener.endpoint,
            len(self._workers),
            self.engine.cluster_key,
        )
        if self.scrubber is not None:
            self.scrubber.start()

    async def close(self) -> None:
        """Stop accepting, answer what is queued, close connections and the engine."""
        if self._closed:
            return
        self._closed = True
        if self.scrubber is not None:
            await self.scrubber.stop()
        if self._listener is not None:
            await self._listener.close()
        for worker in list(self._workers.values()):
            await worker.stop()
        self._workers.clear()
        for conn in list(self._connections):
            with contextlib.suppress(WaltzError):
                await conn.close()
        await self.engine.close()
        log.info("storage node stopped")

    # -- partitions ----------------------------------------------------------------

    def _worker(self, partition_id: int) -> PartitionWorker:
        worker = self._workers.get(partition_id)
        if worker is None:
            worker = PartitionWorker(
                self.engine,
                partition_id,
                queue_size=self._queue_size,
                queue_bytes=self._queue_bytes,
                max_append_batch_records=self._max_batch,
                max_list_records=self._max_list,
                max_response_bytes=self._max_response_bytes,
                metrics=self.metrics,
            )
            # an administrator's choice, kept by the engine across restarts (a partition
            # that failed recovery refuses requests anyway)
            with contextlib.suppress(StorageError):
                worker.available = self.engine.partition(partition_id).available()
            if not worker.available:
                log.warning(
                    "partition %d is marked unavailable (by an administrator); it refuses "
                    "requests until `waltz storage availability %d available`",
                    partition_id,
                    partition_id,
                )
            worker.start()
            self._workers[partition_id] = worker
            if self.metrics is not None:
                self.metrics.host_partition(partition_id)  # its counters at zero from now
        return worker

    def hosted_workers(self) -> dict[int, PartitionWorker]:
        return dict(self._workers)

    def partition_lock(self, partition_id: int) -> asyncio.Lock:
        """Serialises add/remove of one partition (admin commands)."""
        return self._partition_locks.setdefault(partition_id, asyncio.Lock())

    def check_partition_id(self, partition_id: Any) -> int:
        if isinstance(partition_id, bool) or not isinstance(partition_id, int):
            raise StorageRequestError(f"partition_id must be an integer, got {partition_id!r}")
        if not 0 <= partition_id < self.engine.num_partitions:
            raise StorageRequestError(
                f"partition id {partition_id} is out of range: the cluster has "
                f"{self.engine.num_partitions} partitions (0..{self.engine.num_partitions - 1})"
            )
        return partition_id

    async def add_partition(self, partition_id: int) -> None:
        partition_id = self.check_partition_id(partition_id)
        async with self.partition_lock(partition_id):
            await self.engine.add_partition(partition_id)
            self._worker(partition_id)
        log.info("partition %d added", partition_id)

    async def remove_partition(self, partition_id: int) -> None:
        """Stop serving the partition (after its queued requests) and delete its data."""
        partition_id = self.check_partition_id(partition_id)
        async with self.partition_lock(partition_id):
            worker = self._workers.pop(partition_id, None)
            if worker is not None:
                await worker.stop()
            await self.engine.remove_partition(partition_id)
        log.info("partition %d removed", partition_id)

    def worker_of(self, partition_id: int) -> PartitionWorker:
        worker = self._workers.get(partition_id)
        if worker is None:
            raise PartitionNotFoundError(
                f"partition {partition_id} is not hosted on this storage node; "
                "add it with `waltz storage add-partition`"
            )
        return worker

    async def end_sessions(self, partition_id: int, why: str) -> int:
        """Close the connections that sent requests for the partition (a server's store
        session, its replica of the partition here among them); how many. Its replica
        task then leaves, connects again and rejoins, and a rejoin repairs the replica's
        missing ranges from the other writers (a scrub found damage)."""
        connections = list(self._serving.pop(partition_id, ()))
        for conn in connections:
            log.warning(
                "partition %d: closing connection %s so that its server rejoins and repairs "
                "the replica: %s",
                partition_id,
                conn.peer,
                why,
            )
            with contextlib.suppress(WaltzError):
                await conn.close()
        return len(connections)

    # -- connections -------------------------------------------------------------------

    async def _serve(self, conn: Connection) -> None:
        self._connections.add(conn)
        outbox: Outbox | None = None
        tasks: set[asyncio.Task[None]] = set()
        try:
            protocol = await self._handshake(conn)
            if protocol is None:
                return
            outbox = _outbox(conn, protocol, self.metrics)
            await self._read_loop(conn, protocol, outbox, tasks)
        except ConnectionClosedError:
            log.debug("connection %s closed by the peer", conn.peer)
        except TransportError as exc:
            log.info("connection %s failed: %s", conn.peer, exc)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task
            if outbox is not None:
                await outbox.flush_and_stop(timeout=5.0)
            self._connections.discard(conn)
            for serving in self._serving.values():
                serving.discard(conn)
            with contextlib.suppress(WaltzError):
                await conn.close()

    async def _handshake(self, conn: Connection) -> wire.ProtocolConnection | None:
        """The version handshake; None (after telling the peer why) when it failed."""
        # the records of an append or a repair are verified once, by the storage engine
        # as it stores them (its contract), not also when the frame is decoded
        protocol = wire.ProtocolConnection(
            wire.Role.ACCEPTOR,
            sender=self.sender,
            max_frame_size=self.transport.max_frame_size,
            verify_record_checksums=False,
        )
        try:
            frame = await asyncio.wait_for(conn.recv(), self.handshake_timeout)
        except TimeoutError:
            log.warning(
                "connection %s sent no Hello within %ss; closing it",
                conn.peer,
                self.handshake_timeout,
            )
            return None
        try:
            hello = protocol.receive_frame(frame)
            response = protocol.hello_response()
        except ProtocolError as exc:
            _refusals.log(
                logging.WARNING, conn.peer, "connection %s: handshake failed: %s", conn.peer, exc
            )
            failure = FailureResponse(-1, -1, -1, ErrorCode.BAD_REQUEST, str(exc))
            with contextlib.suppress(WaltzError):
                await conn.send(wire.encode(failure))
            return None
        await conn.send(protocol.send(response))
        if protocol.state is not wire.ConnectionState.OPEN:
            log.warning(
                "connection %s (%s): no common protocol version (it speaks %s)",
                conn.peer,
                protocol.peer,
                protocol.peer_versions,
            )
            return None
        log.debug("connection %s: %s speaks version %s", conn.peer, protocol.peer, response)
        del hello
        return protocol

    async def _read_loop(
        self,
        conn: Connection,
        protocol: wire.ProtocolConnection,
        outbox: Outbox,
        tasks: set[asyncio.Task[None]],
    ) -> None:
        opened = False
        served: set[int] = set()  # the partitions this connection sent requests for
        while True:
            frame = await conn.recv()
            try:
                message = protocol.receive_frame(frame)
            except ProtocolError as exc:
                _refusals.log(
                    logging.WARNING,
                    conn.peer,
                    "connection %s sent a malformed frame (%d bytes), closing it: %s",
                    conn.peer,
                    len(frame),
                    exc,
                )
                await outbox.put(FailureResponse(-1, -1, -1, ErrorCode.BAD_REQUEST, str(exc)))
                return
            if self.metrics is not None:
                self.metrics.request(type(message).__name__)
            if isinstance(message, PARTITION_REQUESTS):
                request: Any = message
                if not opened:
                    await outbox.put(
                        failure_for(
                            request,
                            StorageNotOpenError(
                                "this connection has not opened the storage: send a "
                                "StorageOpenRequest with the cluster key first"
                            ),
                        )
                    )
                    continue
                try:
                    worker = self.worker_of(request.partition_id)
                except PartitionNotFoundError as exc:
                    await outbox.put(failure_for(request, exc))
                    continue
                if request.partition_id not in served:
                    served.add(request.partition_id)
                    self._serving.setdefault(request.partition_id, set()).add(conn)
                await worker.submit(request, outbox.put, len(frame), outbox.post)
            elif isinstance(message, StorageOpenRequest):
                opened = await self._open(message, outbox) or opened
            elif isinstance(message, StorageAdminRequest):
                self._spawn(tasks, self._admin(message, outbox))
            else:
                log.warning(
                    "connection %s sent %s, which a storage node does not serve; closing it",
                    conn.peer,
                    type(message).__name__,
                )
                await outbox.put(
                    FailureResponse(
                        -1,
                        getattr(message, "seq_num", -1),
                        -1,
                        ErrorCode.BAD_REQUEST,
                        f"a storage node does not serve {type(message).__name__}",
                    )
                )
                return

    @staticmethod
    def _spawn(tasks: set[asyncio.Task[None]], coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _open(self, request: StorageOpenRequest, outbox: Outbox) -> bool:
        try:
            self.engine.check_cluster_key(request.cluster_key, request.num_partitions)
        except ClusterKeyMismatchError as exc:
            log.warning("refused a storage open: %s", exc)
            await outbox.put(failure_for(request, exc))
            return False
        await outbox.put(SuccessResponse(request.session_id, request.seq_num, request.partition_id))
        return True

    async def _admin(self, request: StorageAdminRequest, outbox: Outbox) -> None:
        try:
            arguments = json.loads(request.arguments.decode("utf-8")) if request.arguments else {}
            if not isinstance(arguments, dict):
                raise StorageRequestError("admin arguments must be a JSON object")
            result = await run_admin_command(self, request.command, arguments)
        except (ValueError, WaltzError) as exc:
            log.info("admin command %r refused: %s", request.command, exc)
            response = StorageAdminResponse(request.seq_num, False, error=str(exc))
        except Exception as exc:
            log.exception("admin command %r failed", request.command)
            response = StorageAdminResponse(
                request.seq_num, False, error=f"{type(exc).__name__}: {exc}"
            )
        else:
            response = StorageAdminResponse(
                request.seq_num, True, result=json.dumps(result).encode("utf-8")
            )
        with contextlib.suppress(ConnectionClosedError):
            await outbox.put(response)
