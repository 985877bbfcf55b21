"""Registers the ZeroMQ transport as the plugin ``zmq``."""

from __future__ import annotations

from waltz_api.capabilities import CONTROL_FUZZ, MALFORMED_INPUT, PEER_FAULTS, PROCESSES
from waltz_api.hookspecs import PluginDescriptor, PluginKind, hookimpl

CAPABILITIES = frozenset({PROCESSES, PEER_FAULTS, MALFORMED_INPUT, CONTROL_FUZZ})


@hookimpl
def waltz_transports() -> list[PluginDescriptor]:
    from waltz_transport_zmq.transport import create_zmq_transport

    return [
        PluginDescriptor(
            kind=PluginKind.TRANSPORT,
            name="zmq",
            factory=create_zmq_transport,
            capabilities=CAPABILITIES,
            description="ZeroMQ (pyzmq asyncio): tcp:// and ipc://, heartbeats, credit flow "
            "control, optional CurveZMQ",
            uri_schemes=("tcp", "ipc"),
            conformance_harness="waltz_transport_zmq.conformance:harness",
        )
    ]
