"""The ZeroMQ transport of Waltz (plugin ``zmq``): tcp:// and ipc://, optional CurveZMQ."""

from waltz_transport_zmq.transport import (
    ClientConnection,
    ServerConnection,
    ZmqConnection,
    ZmqListener,
    ZmqTransport,
    create_zmq_transport,
)

__all__ = [
    "ClientConnection",
    "ServerConnection",
    "ZmqConnection",
    "ZmqListener",
    "ZmqTransport",
    "create_zmq_transport",
]
