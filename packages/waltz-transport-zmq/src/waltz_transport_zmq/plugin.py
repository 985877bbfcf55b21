"""Registers the ZeroMQ transport as the plugin ``zmq``.

Light on purpose: pyzmq and the transport are imported only when ``zmq`` is chosen."""

from __future__ import annotations

from waltz_api.capabilities import CONTROL_FUZZ, MALFORMED_INPUT, PEER_FAULTS, PROCESSES
from waltz_api.hookspecs import TransportDescriptor, TransportFactory, hookimpl

CAPABILITIES = frozenset({PROCESSES, PEER_FAULTS, MALFORMED_INPUT, CONTROL_FUZZ})


def load_factory() -> TransportFactory:
    from waltz_transport_zmq.transport import create_zmq_transport

    return create_zmq_transport


@hookimpl
def waltz_transports() -> list[TransportDescriptor]:
    return [
        TransportDescriptor(
            name="zmq",
            load=load_factory,
            capabilities=CAPABILITIES,
            description="ZeroMQ (pyzmq asyncio): tcp:// and ipc://, heartbeats, credit flow "
            "control, optional CurveZMQ",
            uri_schemes=("tcp", "ipc"),
            conformance_harness="waltz_transport_zmq.conformance:harness",
        )
    ]
