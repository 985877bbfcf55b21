"""The Transport contract: ordered, message-framed connections between endpoints.

Transports move opaque frames (bytes); they never parse Waltz messages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

DEFAULT_MAX_FRAME_SIZE = 64 * 1024 * 1024
DEFAULT_FAILURE_DETECTION_BOUND = 3.0


class Connection(ABC):
    """One ordered, framed, bidirectional connection.

    - Frames arrive in the order they were sent, each exactly once, or the
      connection breaks (then ``recv`` raises ConnectionClosedError).
    - A peer's death (killed, paused, network cut) is detected and reported
      (``recv`` and ``send`` raise ConnectionClosedError) within the
      transport's configured failure-detection bound.
    - Frames from a connection that was replaced are never delivered after
      the first frame of its replacement: each connection is its own object
      with its own ``connection_id``, and a closed connection delivers nothing.
    - A frame above the maximum frame size is refused: ``send`` raises
      FrameTooLargeError without sending, and a receiver closes a connection
      that delivers one, without harm to other connections.
    - Back pressure: ``send`` waits while the peer is not reading and the
      bounded buffers are full, so memory stays bounded on both sides.
    """

    @property
    @abstractmethod
    def connection_id(self) -> int:
        """Unique per transport instance and increasing with each new connection."""

    @property
    @abstractmethod
    def peer(self) -> str:
        """A description of the remote end (endpoint or identity), for logs."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once the connection is closed or broken."""

    @property
    def peer_identity(self) -> str | None:
        """Who the transport proved the remote end to be, or None when it proved nothing.

        On a connection a listener accepted, a transport that authenticates its clients
        (capability ``authenticated_peers``) gives the identity its security handshake
        accepted, as a stable string: the same credentials give the same string on every
        connection and every listener of that transport (for CurveZMQ, the client's
        public key in Z85). The server's access control (``waltz acl``) grants
        permissions to these strings. None on a plaintext connection and on the
        connecting side; a transport that never authenticates keeps this default."""
        return None

    @property
    def max_frame_size(self) -> int | None:
        """The largest frame ``send`` takes on this connection: the smaller of this
        side's maximum frame size and the one the peer announced when the transport
        learns it (a frame above the peer's limit would only break the connection at the
        peer), or None when the transport does not know the peer's (then its own
        ``Transport.max_frame_size`` applies)."""
        return None

    @abstractmethod
    async def send(self, frame: bytes) -> None:
        """Send one frame (waits under back pressure)."""

    async def send_many(self, frames: list[bytes]) -> None:
        """Send several frames in order; transports may coalesce them.

        A frame above the maximum frame size refuses the whole call
        (FrameTooLargeError) before any of the frames is sent."""
        for frame in frames:
            await self.send(frame)

    @abstractmethod
    async def recv(self) -> bytes:
        """The next frame; raises ConnectionClosedError when the connection ends."""

    @abstractmethod
    async def close(self) -> None:
        """Close (idempotent). Pending frames may be dropped."""


ConnectionHandler = Callable[[Connection], Awaitable[None]]


class Listener(ABC):
    """A bound endpoint accepting connections."""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """The endpoint clients connect to (a port 0 request is resolved here)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop accepting and close every accepted connection."""


class Transport(ABC):
    """A factory of connections and listeners.

    Created by the plugin's factory with options (max frame size, heartbeat
    interval, security keys...). Endpoints are transport-specific strings
    (``tcp://127.0.0.1:5555``, ``ipc:///tmp/x``, ``memory://name``).
    """

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options: Mapping[str, Any] = dict(options or {})

    @property
    def max_frame_size(self) -> int:
        return int(self.options.get("max_frame_size", DEFAULT_MAX_FRAME_SIZE))

    @property
    def failure_detection_bound(self) -> float:
        """Seconds within which a dead, paused or unreachable peer is reported
        (``recv`` and ``send`` raise ConnectionClosedError), with these options."""
        return DEFAULT_FAILURE_DETECTION_BOUND

    @abstractmethod
    async def listen(self, endpoint: str, handler: ConnectionHandler) -> Listener:
        """Bind ``endpoint``; ``handler`` runs as a task for each accepted connection
        (and the connection is closed when it returns)."""

    @abstractmethod
    async def connect(
        self, endpoint: str, *, timeout: float = 10.0, replace_key: str | None = None
    ) -> Connection:
        """Connect to a listener; raises ConnectError when it cannot within ``timeout``
        (AuthenticationError when the listener refuses this transport's credentials).

        ``replace_key`` (the spec's network client sequence number): connections
        made by this transport instance to the same listener with the same key
        form a lineage, each new one replacing the older ones. The listener
        closes every older connection of the lineage before it delivers the
        first frame of the new one, and refuses an older one arriving late, so
        no frame of a replaced connection is delivered after the first frame of
        its replacement. The replaced connection is closed on this side too.
        Without a key, connections are independent.
        """

    @abstractmethod
    async def close(self) -> None:
        """Close every listener and connection of this transport."""
