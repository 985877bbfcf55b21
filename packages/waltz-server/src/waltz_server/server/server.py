"""The client-facing server: connections, the Hello handshake, dispatch to partitions.

:class:`WaltzServer` listens on the configured Transport. Each client
connection completes the version handshake (``waltz_api.wire``), then its
messages are routed by the partition id in their ReqId to the
:class:`~waltz_server.server.partition.Partition` this server holds. A
request for a partition held elsewhere is refused (a MountRequest gets
NOT_READY, anything else ErrorResponse PARTITION_NOT_ASSIGNED), so the client
re-reads the assignment. With an :class:`~waltz_server.server.access.AccessGate` (the
cluster's ACL, ``waltz acl``), a request whose connection's key lacks the permission
it needs on its partition is answered ErrorResponse ACCESS_DENIED before anything
else looks at it. Another server's :class:`~waltz_api.messages.PeerPing` (its
failure detector, :mod:`waltz_server.server.peers`) is answered with a ``PeerPong``
carrying this server's current id.

Back pressure both ways: a connection's messages are read one at a time and a
full partition queue stops the reading; each connection's outgoing frames go
through a bounded outbox. A feed waits for room, and so does the reading of the
connection's next request: a client that does not read its replies gets no more
work done, and what it sent waits in the transport's (bounded) window. Replies to
requests already taken (at most a partition's ``read_concurrency`` reads) may go
beyond the bound; a reply that finds the outbox at OUTBOX_CEILING times its bound
closes the connection. Per connection the server holds at most that, the frames
being handed to the transport and the transport's window, whatever the client
announces or does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from waltz_api import wire
from waltz_api.access import AccessControl
from waltz_api.contracts.coordination import Coordination
from waltz_api.contracts.transport import Connection, Listener, Transport
from waltz_api.errors import (
    ConnectionClosedError,
    ProtocolError,
    TransportError,
    WaltzError,
)
from waltz_api.messages import (
    AppendRequest,
    ErrorCode,
    ErrorResponse,
    FeedData,
    FeedRequest,
    Message,
    MountRequest,
    MountResponse,
    MountStatus,
    PeerPing,
    PeerPong,
)
from waltz_api.outbox import Outbox
from waltz_api.peerlog import PeerLog
from waltz_api.types import MAX_LOCKS_PER_TRANSACTION, ReqId
from waltz_server.observability import ServerMetrics
from waltz_server.server.access import AccessGate
from waltz_server.server.archiving import ServerArchive
from waltz_server.server.partition import Partition, PartitionConfig
from waltz_server.server.replica import ReplicaConnector
from waltz_server.server.store import StoreConfig, StorePartition

log = logging.getLogger(__name__)
_refusals = PeerLog(log)
"""Clients refused for bad input (a failed handshake, a malformed frame): one line each,
at most 10 a minute in all, so that a hostile client cannot flood the log."""

OUTBOX_CEILING = 4
"""A reply that finds a connection's outbox at this many times its bound closes it."""


@dataclass(frozen=True)
class ServerConfig:
    """Tuning of the client-facing server."""

    outbox_frames: int = 10_000
    outbox_bytes: int = 8 * 1024 * 1024
    """A connection's queued replies, at most (one frame is always accepted when empty)."""
    handshake_timeout: float = 10.0
    store: StoreConfig = field(default_factory=StoreConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)


def _encoder(
    protocol: wire.ProtocolConnection,
    metrics: ServerMetrics | None,
    feed_positions: dict[int, int],
) -> Callable[[Message], bytes]:
    """A client connection's encoder: a message's frame, noting each FeedData's position
    and counting each error sent. (A function of these, not a method: an outbox holding
    its connection would make a reference cycle, and a closed connection's buffers
    would wait for the cyclic garbage collector.)"""

    def encode(message: Message) -> bytes:
        kind = type(message)
        if kind is FeedData:
            feed = typing.cast(FeedData, message)
            feed_positions[feed.req_id.partition_id] = feed.transaction_id
        elif kind is ErrorResponse and metrics is not None:
            metrics.error(typing.cast(ErrorResponse, message).code.name.lower())
        return protocol.send(message)

    return encode


class ClientConnection:
    """One client connection: a :class:`~waltz_server.server.partition.ClientStream`.

    Its replies and feed frames go through one bounded :class:`~waltz_api.outbox.Outbox`;
    when the outbox's writer ends (aborted, or the transport failed) the connection is
    closed here (an outbox never closes its connection)."""

    _ids = itertools.count(1)

    def __init__(
        self,
        conn: Connection,
        protocol: wire.ProtocolConnection,
        limit: int,
        limit_bytes: int = 8 * 1024 * 1024,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.id = next(self._ids)
        self.metrics = metrics
        self.feed_positions: dict[int, int] = {}
        """Partition -> the last transaction id this client's feed was sent (or the
        high-water mark it mounted with): its feed lag, seen from here."""
        self.conn = conn
        self.protocol = protocol
        self.from_server = False
        """True once the other end sent a PeerPing: another server's failure detector,
        not a client."""
        self.limit = limit
        self.limit_bytes = limit_bytes
        self.outbox = Outbox(
            conn,
            _encoder(protocol, metrics, self.feed_positions),
            max_frames=limit,
            max_bytes=limit_bytes,
            name=f"client-out-{conn.connection_id}",
        )
        self.writer = asyncio.create_task(
            self._close_after_writer(), name=f"client-close-{conn.connection_id}"
        )

    @property
    def closed(self) -> bool:
        return self.outbox.closed

    @property
    def queued_frames(self) -> int:
        """Frames this connection holds: queued, and being handed to the transport."""
        return self.outbox.queued_frames

    async def wait_room(self) -> None:
        """Until the outbox is below its bound (or the connection closed): the next
        request of this connection is read only then."""
        await self.outbox.wait_room()

    @property
    def peer(self) -> str:
        return self.protocol.peer or self.conn.peer

    async def send(self, message: Message) -> None:
        await self.outbox.put(message)

    async def send_feed(
        self, frames: Sequence[bytes], partition_id: int, last_transaction_id: int
    ) -> None:
        """Send encoded FeedData frames (the feed cache's, shared by every connection),
        waiting while the outbox is full."""
        if self.protocol.version != wire.PROTOCOL_VERSION:
            # the shared frames are of this version (the only one there is so far)
            raise ProtocolError(
                f"client {self.peer} speaks protocol version {self.protocol.version}: the "
                f"feed frames are of version {wire.PROTOCOL_VERSION}"
            )
        await self.outbox.put_frames(frames)
        self.feed_positions[partition_id] = last_transaction_id

    def post_feed(
        self, frames: Sequence[bytes], partition_id: int, last_transaction_id: int
    ) -> bool:
        """:meth:`send_feed` without waiting: False (nothing sent) when the outbox has no
        room for them all now (or the client speaks another protocol version: the
        feed's task then tells it)."""
        if self.protocol.version != wire.PROTOCOL_VERSION or not self.outbox.post_frames(frames):
            return False
        self.feed_positions[partition_id] = last_transaction_id
        return True

    def post(self, message: Message) -> None:
        """Queue a reply without waiting: beyond the outbox's bound (a reply to a request
        already taken), up to OUTBOX_CEILING times it; at the ceiling the client does not
        read its replies and its connection is closed."""
        outbox = self.outbox
        if outbox.post(message, slack=OUTBOX_CEILING) or outbox.closed:
            return
        log.warning(
            "client %s does not read its replies (%d frames, %d bytes queued): closing "
            "its connection",
            self.peer,
            outbox.queued_frames,
            outbox.queued_bytes,
        )
        self.abort()

    def abort(self) -> None:
        """Stop now (what is queued is dropped); the connection is closed."""
        self.outbox.abort()

    async def _close_after_writer(self) -> None:
        try:
            await asyncio.wait([self.outbox.task])
        finally:
            self.outbox.abort()
            with contextlib.suppress(WaltzError):
                await self.conn.close()

    async def close(self) -> None:
        await self.outbox.close()
        with contextlib.suppress(BaseException):
            await self.writer


class WaltzServer:
    """Serves the partitions assigned to this server to clients."""

    def __init__(
        self,
        *,
        transport: Transport,
        endpoint: str,
        coordination: Coordination,
        connector: ReplicaConnector,
        config: ServerConfig | None = None,
        rng: random.Random | None = None,
        name: str = "server",
        metrics: ServerMetrics | None = None,
        archive: ServerArchive | None = None,
        access: AccessGate | None = None,
    ) -> None:
        self.transport = transport
        self.access = access
        """The cluster's ACL, checked before any request reaches a partition (None:
        every connection may do everything)."""
        if access is not None:
            access.on_change = self._access_changed
        self.archive = archive
        """The archive (tiered storage) of the partitions served here, when configured."""
        self.requested_endpoint = endpoint
        self.coordination = coordination
        self.connector = connector
        self.config = config or ServerConfig()
        self.rng = rng or random.Random()
        self.name = name
        self.metrics = metrics
        self.partitions: dict[int, Partition] = {}
        self.identity: Callable[[], int] = lambda: -1
        """This server's current cluster id (set by whoever registers it: the cluster
        manager); a :class:`PeerPing` is answered with it."""
        self._listener: Listener | None = None
        self._connections: set[ClientConnection] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._partition_lock = asyncio.Lock()

    @property
    def connections(self) -> list[ClientConnection]:
        """The open client connections (not those of other servers probing this one)."""
        return [c for c in self._connections if not c.from_server]

    @property
    def endpoint(self) -> str:
        if self._listener is None:
            raise WaltzError("the server is not started")
        return self._listener.endpoint

    async def start(self) -> None:
        self._listener = await self.transport.listen(self.requested_endpoint, self._serve)
        log.info("%s listening on %s", self.name, self._listener.endpoint)

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.close()
        for connection in list(self._connections):
            await connection.close()
        async with self._partition_lock:
            if self.archive is not None:
                await self.archive.close()
            for partition in list(self.partitions.values()):
                await partition.close()
            self.partitions.clear()

    # -- partitions ---------------------------------------------------------------------------

    async def add_partition(
        self, partition_id: int, generation: int, replica_nodes: Sequence[str]
    ) -> Partition:
        """Serve ``partition_id`` at ``generation`` (replacing an older generation)."""
        async with self._partition_lock:
            current = self.partitions.get(partition_id)
            if current is not None:
                if current.generation >= generation:
                    return current
                if self.archive is not None:
                    await self.archive.stop(partition_id)
                await current.close()
            store = StorePartition(
                partition_id=partition_id,
                generation=generation,
                coordination=self.coordination,
                replica_nodes=replica_nodes,
                connector=self.connector,
                config=self.config.store,
                rng=random.Random(self.rng.getrandbits(64)),
                archive=self.archive.link(partition_id) if self.archive is not None else None,
            )
            partition = Partition(store=store, config=self.config.partition, metrics=self.metrics)
            await partition.start()
            if self.archive is not None:
                self.archive.start(store)
            self.partitions[partition_id] = partition
            if self.metrics is not None:
                self.metrics.partitions_owned.set(len(self.partitions))
            log.info(
                "%s: serving partition %d at generation %d", self.name, partition_id, generation
            )
            return partition

    async def remove_partition(self, partition_id: int, generation: int | None = None) -> None:
        """Stop serving ``partition_id`` (only that generation, when given)."""
        async with self._partition_lock:
            current = self.partitions.get(partition_id)
            if current is None or (generation is not None and current.generation != generation):
                return
            del self.partitions[partition_id]
            if self.archive is not None:
                await self.archive.stop(partition_id)
            await current.close()
            if self.metrics is not None:
                self.metrics.partitions_owned.set(len(self.partitions))
            log.info("%s: partition %d removed", self.name, partition_id)

    # -- connections ---------------------------------------------------------------------------

    async def _serve(self, conn: Connection) -> None:
        protocol = await self._handshake(conn)
        if protocol is None:
            return
        client = ClientConnection(
            conn, protocol, self.config.outbox_frames, self.config.outbox_bytes, self.metrics
        )
        self._connections.add(client)
        try:
            while not client.closed:
                await client.wait_room()  # a client that does not read gets nothing more done
                if client.closed:
                    break
                frame = await conn.recv()
                try:
                    message = protocol.receive_frame(frame)
                except ProtocolError as exc:
                    _refusals.log(
                        logging.WARNING,
                        client.peer,
                        "client %s sent a malformed frame (%d bytes), closing: %s",
                        client.peer,
                        len(frame),
                        exc,
                    )
                    return
                await self._dispatch(message, client)
        except ConnectionClosedError:
            log.debug("client %s disconnected", client.peer)
        except TransportError as exc:
            log.info("client %s: connection failed: %s", client.peer, exc)
        finally:
            self._connections.discard(client)
            for partition in list(self.partitions.values()):
                partition.detach(client)
            await client.close()

    def _access_changed(self, acl: AccessControl) -> None:
        """The ACL changed: a connection that mounted a partition its key may no longer
        read is closed (its client mounts again, and that mount is refused)."""
        access = self.access
        if access is None:
            return
        for client in self.connections:
            identity = client.conn.peer_identity
            lost = [p for p in client.feed_positions if not access.may_read(identity, p)]
            if lost and not client.closed:
                log.warning(
                    "client %s (key %s) may no longer read partition(s) %s: closing its connection",
                    client.peer,
                    identity,
                    ", ".join(map(str, sorted(lost))),
                )
                task = asyncio.get_running_loop().create_task(client.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    async def _handshake(self, conn: Connection) -> wire.ProtocolConnection | None:
        protocol = wire.ProtocolConnection(
            wire.Role.ACCEPTOR, sender=self.name, max_frame_size=self.transport.max_frame_size
        )
        try:
            frame = await asyncio.wait_for(conn.recv(), self.config.handshake_timeout)
            protocol.receive_frame(frame)
            await conn.send(protocol.send(protocol.hello_response()))
        except (TimeoutError, ProtocolError, TransportError) as exc:
            _refusals.log(
                logging.WARNING,
                conn.peer,
                "client connection %s: handshake failed: %s",
                conn.peer,
                str(exc) or type(exc).__name__,
            )
            return None
        if protocol.state is not wire.ConnectionState.OPEN:
            log.warning(
                "client %s speaks protocol versions %s, none of ours",
                protocol.peer,
                protocol.peer_versions,
            )
            return None
        return protocol

    async def _dispatch(self, message: Message, client: ClientConnection) -> None:
        if self.metrics is not None:
            self.metrics.request(type(message).__name__)
        req_id: ReqId | None = getattr(message, "req_id", None)
        if req_id is None:
            if isinstance(message, PeerPing):  # another server's failure detector
                client.from_server = True
                client.post(PeerPong(message.seq_num, self.identity()))
                return
            client.post(
                ErrorResponse(
                    ReqId(-1, -1, -1, -1),
                    ErrorCode.BAD_REQUEST,
                    f"{type(message).__name__} is not a client request",
                )
            )
            return
        access = self.access
        if access is not None and access.enforced:
            refused = access.refusal(client.conn.peer_identity, req_id.partition_id, message)
            if refused is not None:
                client.post(ErrorResponse(req_id, ErrorCode.ACCESS_DENIED, refused))
                return
        if type(message) is AppendRequest and len(message.locks) > MAX_LOCKS_PER_TRANSACTION:
            # the client library refuses this before sending; a raw client gets told
            client.post(
                ErrorResponse(
                    req_id,
                    ErrorCode.BAD_REQUEST,
                    f"an append with {len(message.locks)} locks is above the limit of "
                    f"{MAX_LOCKS_PER_TRANSACTION}; nothing of it was done",
                )
            )
            return
        partition = self.partitions.get(req_id.partition_id)
        if partition is None:
            if isinstance(message, MountRequest):
                client.post(MountResponse(req_id, MountStatus.NOT_READY, -1))
            else:
                client.post(
                    ErrorResponse(
                        req_id,
                        ErrorCode.PARTITION_NOT_ASSIGNED,
                        f"partition {req_id.partition_id} is not served by {self.name}; "
                        "re-read the partition assignment",
                    )
                )
            return
        if isinstance(message, (MountRequest, FeedRequest)):
            client.feed_positions[req_id.partition_id] = message.client_high_water_mark
        await partition.submit(message, client)
