"""The ZeroMQ transport of Waltz (plugin ``zmq``): tcp:// and ipc://, optional CurveZMQ.

The names below are imported on first use: the plugin's entry point imports this
package, and reading its descriptor must not import the implementation.
"""

from typing import TYPE_CHECKING

from waltz_api.lazy import lazy_exports

if TYPE_CHECKING:
    from waltz_transport_zmq.connection import ClientConnection, ServerConnection, ZmqConnection
    from waltz_transport_zmq.transport import ZmqListener, ZmqTransport, create_zmq_transport

__all__ = [
    "ClientConnection",
    "ServerConnection",
    "ZmqConnection",
    "ZmqListener",
    "ZmqTransport",
    "create_zmq_transport",
]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ClientConnection": ".connection",
        "ServerConnection": ".connection",
        "ZmqConnection": ".connection",
        "ZmqListener": ".transport",
        "ZmqTransport": ".transport",
        "create_zmq_transport": ".transport",
    },
)
