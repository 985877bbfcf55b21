"""The ZeroMQ transport: pyzmq asyncio sockets, one packed frame per message.

Shape:

- A listener is one ROUTER socket; every connection a client makes is its own
  DEALER socket with a fresh random routing id, so a ROUTER identity is never
  reused and a connection's frames never mix with another's.
- A connection opens with HELLO/WELCOME (version, windows, limits, lineage).
- Flow control is credit based (:mod:`waltz_transport_zmq.protocol`): a
  sender has at most ``window_frames`` frames and about ``window_bytes`` bytes
  in flight beyond what the receiving application consumed, so receive buffers
  stay bounded per connection without blocking the shared ROUTER socket, and
  the ZeroMQ high-water marks (set above the window) never drop a frame.
- Heartbeats: each side sends one when it sent nothing else for
  ``heartbeat_interval``; a peer silent for ``heartbeat_timeout`` is dead.
- Sends go through the socket's synchronous shadow without blocking; when
  ZeroMQ cannot take a message, it and every later one of that connection
  wait in order in a queue the credit window bounds.

Modules: here the listener and the transport (one ZeroMQ context, its watchdog);
:mod:`~waltz_transport_zmq.connection` the connections (credit, coalescing, order);
:mod:`~waltz_transport_zmq.sockets` the socket pumps and the ordered sends;
:mod:`~waltz_transport_zmq.handshake` CurveZMQ and the handshake's failures;
:mod:`~waltz_transport_zmq.protocol` the messages; options and keys their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import zmq
import zmq.asyncio

from waltz_api.contracts.transport import Connection, ConnectionHandler, Listener, Transport
from waltz_api.errors import (
    ConfigError,
    ConnectionClosedError,
    ProtocolError,
    TransportError,
)
from waltz_transport_zmq import protocol as p
from waltz_transport_zmq.connection import ClientConnection, ServerConnection, ZmqConnection
from waltz_transport_zmq.handshake import (
    HANDSHAKE_FAILED,
    ZAP_DOMAIN,
    await_welcome,
    start_authenticator,
    watch_refusals,
)
from waltz_transport_zmq.logs import PeerLog
from waltz_transport_zmq.options import ZmqOptions, is_local_endpoint
from waltz_transport_zmq.sockets import Pump, terminate

__all__ = [
    "ClientConnection",
    "ServerConnection",
    "ZmqConnection",
    "ZmqListener",
    "ZmqTransport",
    "create_zmq_transport",
]

log = logging.getLogger(__name__)
_trouble = PeerLog(log)
"""Lines about misbehaving peers (refused connections), rate-limited."""

TERM_TIMEOUT = 5.0
"""Seconds beyond the linger that closing a transport waits for ZeroMQ's context to end."""


class ZmqListener(Listener):
    """A ROUTER socket accepting connections."""

    def __init__(
        self,
        transport: ZmqTransport,
        socket: zmq.Socket[bytes],
        endpoint: str,
        handler: ConnectionHandler,
    ) -> None:
        self._transport = transport
        self._socket = socket
        self._shadow = socket
        self._endpoint = endpoint
        self._handler = handler
        self._closed = False
        self._connections: dict[bytes, ServerConnection] = {}
        self._lineages: dict[tuple[str, str, str], ServerConnection] = {}
        """(client key, client transport, replace_key) -> the newest connection: only a
        peer with the same curve key can replace a connection."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._pump = Pump(socket, handle_routed=self._on_stranger, routes=self._connections)
        context = transport._context
        self._monitor = (
            None
            if context is None
            else watch_refusals(context, socket, endpoint, transport.opts.curve_listen)
        )

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def poke(self) -> None:
        """Read what waits on the socket (the watchdog's periodic look)."""
        self._pump.poke()

    def _reply(self, identity: bytes, message: bytes) -> None:
        """Best effort, never queued: to a peer that has no connection here."""
        with contextlib.suppress(zmq.ZMQError):
            self._shadow.send(identity, zmq.NOBLOCK | zmq.SNDMORE)
            self._shadow.send(message, zmq.NOBLOCK)
        self._pump.poke()

    def _on_stranger(self, identity: bytes, frame: zmq.Frame) -> None:
        message = frame.bytes
        if not message or message[0] != p.KIND_HELLO:
            if message and message[0] != p.KIND_CLOSE:
                self._reply(
                    identity, p.close_message("unknown connection (the listener restarted?)")
                )
            return
        try:
            self._accept(identity, message, self._authenticated(frame))
        except ProtocolError as exc:
            _trouble.log(
                logging.WARNING,
                identity,
                "%s: refused a connection: %s",
                self._endpoint,
                exc,
            )
            self._reply(identity, p.close_message(f"refused: {exc}"))

    def _authenticated(self, frame: zmq.Frame) -> str | None:
        """The public key (Z85) the ZAP handler accepted for the peer that sent ``frame``
        (its User-Id: pyzmq's authenticator answers with the Z85 key), None in plaintext."""
        if not self._transport.opts.curve_listen:
            return None
        try:
            user_id = frame.get("User-Id")
        except zmq.ZMQError as exc:
            # curve without the ZAP reply's user id: refuse rather than serve an unknown peer
            raise ProtocolError(f"the security handshake named no client key ({exc})") from None
        if not isinstance(user_id, str) or not user_id:
            raise ProtocolError("the security handshake named no client key")
        return user_id

    def _accept(self, identity: bytes, message: bytes, authenticated: str | None = None) -> None:
        transport = self._transport
        opts = transport.opts
        hello = p.parse_hello(message)
        client, seq, key = hello.client, hello.seq, hello.replace_key
        # the peer's window bounds what this side keeps in flight to it, and this side's
        # own window bounds it too: an absurd announced window buys nothing
        window_frames, window_bytes = transport.clamp_window(
            hello.window_frames, hello.window_bytes
        )
        lineage = (authenticated or "", client, key) if key is not None else None
        if lineage is not None:
            current = self._lineages.get(lineage)
            if current is not None:
                if current.client_seq >= seq:
                    raise ProtocolError(
                        f"connection {seq} was replaced by connection {current.client_seq} of "
                        "the same replace_key"
                    )
                # replaced: nothing of it is delivered from now on
                current.replaced("replaced by a newer connection of the same replace_key")
        conn = ServerConnection(
            transport,
            transport._next_id(),
            f"{self._endpoint}<-{client}#{seq}",
            peer_window_frames=window_frames,
            peer_window_bytes=window_bytes,
        )
        conn.peer_limit(hello.max_frame_size)
        conn.identity = identity
        conn.authenticated = authenticated
        conn.lineage = lineage
        conn.client_seq = seq
        wire = conn.attach(self._shadow, self._pump, identity, opts.hwm)
        conn.on_closed = self._on_connection_closed
        self._connections[identity] = conn
        if lineage is not None:
            self._lineages[lineage] = conn
        transport._connections.add(conn)
        wire.send(
            p.Welcome(
                version=p.PROTOCOL_VERSION,
                id=conn.connection_id,
                window_frames=opts.window_frames,
                window_bytes=opts.window_bytes,
                max_frame_size=opts.max_frame_size,
            ).encode()
        )
        task = asyncio.get_running_loop().create_task(self._run_handler(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_connection_closed(self, conn: ZmqConnection) -> None:
        assert isinstance(conn, ServerConnection)
        if self._connections.get(conn.identity) is conn:
            del self._connections[conn.identity]
        # a connection the peer closed may still hold frames for its handler: it stays in
        # its lineage until it is closed here, so a replacement still drops those frames
        if (
            conn.closed_here
            and conn.lineage is not None
            and self._lineages.get(conn.lineage) is conn
        ):
            del self._lineages[conn.lineage]

    async def _run_handler(self, conn: ServerConnection) -> None:
        try:
            await self._handler(conn)
        except ConnectionClosedError:
            log.debug("connection %d ended in its handler", conn.connection_id)
        except Exception:
            log.exception("the connection handler for %s failed", conn.peer)
        finally:
            await conn.close()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._transport._listeners.discard(self)
        for conn in list(self._connections.values()):
            await conn.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._pump.close()
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        self._socket.close(linger=int(self._transport.opts.linger * 1000))


class ZmqTransport(Transport):
    """The Transport contract on ZeroMQ (plugin ``zmq``)."""

    _instances = itertools.count(1)

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        self.opts = ZmqOptions.from_mapping(self.options)
        self.uid = uuid.uuid4().hex
        self._ids = itertools.count(1)
        self._context: zmq.asyncio.Context | None = None
        self._sync_context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._authenticator: Any = None
        self._connections: set[ZmqConnection] = set()
        self._client_connections: set[ClientConnection] = set()
        self._lineages: dict[tuple[str, str], ClientConnection] = {}
        self._listeners: set[ZmqListener] = set()
        self._watchdog_task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def max_frame_size(self) -> int:
        return self.opts.max_frame_size

    @property
    def failure_detection_bound(self) -> float:
        return self.opts.failure_detection_bound

    def _next_id(self) -> int:
        return next(self._ids)

    def clamp_window(self, frames: int, nbytes: int) -> tuple[int, int]:
        """A peer's announced receive window, capped at this side's own: what one
        connection keeps in flight stays bounded whatever a peer announces."""
        return min(frames, self.opts.window_frames), min(nbytes, self.opts.window_bytes)

    def forget(self, conn: ZmqConnection) -> None:
        self._connections.discard(conn)
        if isinstance(conn, ClientConnection):
            self._client_connections.discard(conn)

    def _ctx(self) -> zmq.asyncio.Context:
        if self._closed:
            raise TransportError("this zmq transport is closed; create a new one")
        if self._context is None:
            self._context = zmq.asyncio.Context(io_threads=self.opts.io_threads)
        if self._watchdog_task is None:
            self._watchdog_task = asyncio.get_running_loop().create_task(self._watchdog())
        return self._context

    def _sockets(self) -> zmq.Context[zmq.Socket[bytes]]:
        """The transport's context, for plain sockets (the pumps drive them from the loop)."""
        if self._sync_context is None:
            self._sync_context = zmq.Context.shadow(self._ctx().underlying)
        return self._sync_context

    def _check_endpoint(self, endpoint: str, curve: bool) -> None:
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
            raise ConfigError(
                f"zmq endpoint {endpoint!r} is invalid: use tcp://HOST:PORT or ipc:///path",
                key="endpoint",
            )
        if not curve and self.opts.security == "auto" and not is_local_endpoint(endpoint):
            raise ConfigError(
                f"{endpoint} is not a loopback address and no curve keys are configured: "
                "configure curve keys (see `waltz keys generate`) or set the transport option "
                "security = 'plaintext' to send unencrypted on purpose",
                key="security",
            )

    def _configure(self, socket: zmq.Socket[Any]) -> None:
        opts = self.opts
        socket.setsockopt(zmq.LINGER, int(opts.linger * 1000))
        socket.setsockopt(zmq.SNDHWM, opts.hwm)
        socket.setsockopt(zmq.RCVHWM, opts.hwm)
        socket.setsockopt(zmq.MAXMSGSIZE, max(opts.max_frame_size, p.BATCH_LIMIT) + p.HEADER_ROOM)
        socket.setsockopt(zmq.RECONNECT_IVL, int(opts.reconnect_interval * 1000))
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, int(opts.reconnect_interval_max * 1000))

    async def _watchdog(self) -> None:
        """Heartbeats out, silence in: one timer for every connection of this transport."""
        loop = asyncio.get_running_loop()
        interval = self.opts.heartbeat_interval
        timeout = self.opts.heartbeat_timeout
        while not self._closed:
            await asyncio.sleep(interval)
            now = loop.time()
            for conn in list(self._connections):
                conn.tick(now, timeout)
            # Every socket is read once per interval whatever its file descriptor says: its
            # readiness is an edge that any operation on the socket may consume, and a
            # socket that sends nothing (a listener without connections: a peer's hello
            # waits on it) would otherwise never look again.
            for listener in list(self._listeners):
                listener.poke()
            for client in list(self._client_connections):
                client.pump.poke()

    async def listen(self, endpoint: str, handler: ConnectionHandler) -> Listener:
        opts = self.opts
        self._check_endpoint(endpoint, opts.curve_listen)
        if opts.security == "curve" and not opts.curve_listen:
            raise ConfigError(
                "security = 'curve' but curve_server_key / curve_authorized_keys are not set, "
                "so this transport cannot listen securely",
                key="curve_server_key",
            )
        context = self._ctx()
        socket: zmq.Socket[bytes] = self._sockets().socket(zmq.ROUTER)
        self._configure(socket)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if opts.curve_server_key is not None:
            if self._authenticator is None:
                assert opts.curve_authorized_keys is not None
                self._authenticator = start_authenticator(context, opts.curve_authorized_keys)
            socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
            socket.setsockopt(zmq.CURVE_SERVER, 1)
            socket.setsockopt(zmq.CURVE_SECRETKEY, opts.curve_server_key.secret)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, opts.curve_server_key.public)
        bind_to = endpoint
        if bind_to.startswith("tcp://") and bind_to.endswith(":0"):
            bind_to = bind_to[:-2] + ":*"
        try:
            socket.bind(bind_to)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise TransportError(f"cannot listen on {endpoint}: {exc.strerror}") from exc
        resolved = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        listener = ZmqListener(self, socket, resolved, handler)
        self._listeners.add(listener)
        log.info("listening on %s%s", resolved, " (curve)" if opts.curve_listen else "")
        return listener

    async def connect(
        self, endpoint: str, *, timeout: float = 10.0, replace_key: str | None = None
    ) -> Connection:
        opts = self.opts
        self._check_endpoint(endpoint, opts.curve_connect)
        try:
            p.check_replace_key(replace_key)
        except ProtocolError as exc:
            raise ConfigError(str(exc), key="replace_key") from None
        if opts.security == "curve" and not opts.curve_connect:
            raise ConfigError(
                "security = 'curve' but curve_server_public_key / curve_client_key are not set, "
                "so this transport cannot connect securely",
                key="curve_server_public_key",
            )
        context = self._ctx()
        if replace_key is not None:
            older = self._lineages.get((endpoint, replace_key))
            if older is not None:
                await older.close()
        socket: zmq.Socket[bytes] = self._sockets().socket(zmq.DEALER)
        self._configure(socket)
        socket.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        if opts.curve_server_public_key is not None and opts.curve_client_key is not None:
            socket.setsockopt(zmq.CURVE_SERVERKEY, opts.curve_server_public_key)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, opts.curve_client_key.public)
            socket.setsockopt(zmq.CURVE_SECRETKEY, opts.curve_client_key.secret)
        monitor_address = f"inproc://waltz-monitor-{uuid.uuid4().hex}"
        socket.monitor(monitor_address, HANDSHAKE_FAILED)
        monitor = context.socket(zmq.PAIR)
        monitor.connect(monitor_address)
        connection_id = self._next_id()
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:
            monitor.close(linger=0)
            socket.close(linger=0)
            raise ConfigError(
                f"cannot connect to {endpoint!r}: {exc.strerror}", key="endpoint"
            ) from exc
        # the flow-control windows of the listener arrive in its welcome
        conn = ClientConnection(
            self, connection_id, endpoint, peer_window_frames=1, peer_window_bytes=1
        )
        conn.socket = socket
        conn.welcome = asyncio.get_running_loop().create_future()
        welcome = conn.welcome
        conn.pump = Pump(socket, handle=conn.on_first_message)
        conn.attach(socket, conn.pump, None, opts.hwm).send(
            p.Hello(
                version=p.PROTOCOL_VERSION,
                client=self.uid,
                seq=connection_id,
                replace_key=replace_key,
                window_frames=opts.window_frames,
                window_bytes=opts.window_bytes,
                max_frame_size=opts.max_frame_size,
            ).encode()
        )
        try:
            await await_welcome(welcome, monitor, endpoint, timeout, opts.curve_connect)
        except BaseException:
            conn.abort("the connection could not be established", log_level=logging.DEBUG)
            raise
        finally:
            with contextlib.suppress(zmq.ZMQError):
                socket.monitor(None, 0)
            monitor.close(linger=0)
        self._connections.add(conn)
        self._client_connections.add(conn)
        if replace_key is not None:
            lineage = (endpoint, replace_key)
            self._lineages[lineage] = conn

            def forget_lineage(closed: ZmqConnection, lineage: tuple[str, str] = lineage) -> None:
                if self._lineages.get(lineage) is closed:
                    del self._lineages[lineage]

            conn.on_closed = forget_lineage
        return conn

    async def close(self) -> None:
        if self._closed:
            return
        for listener in list(self._listeners):
            await listener.close()
        for conn in list(self._client_connections):
            await conn.close()
        self._closed = True
        if self._watchdog_task is not None:
            self._watchdog_task.cancel()
            await asyncio.gather(self._watchdog_task, return_exceptions=True)
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
        context = self._context
        self._context = None
        self._sync_context = None
        if context is not None:
            await terminate(context, self.opts.linger + TERM_TIMEOUT)


def create_zmq_transport(options: Mapping[str, Any] | None = None) -> ZmqTransport:
    """The plugin factory: ``(options) -> Transport``."""
    return ZmqTransport(options)
