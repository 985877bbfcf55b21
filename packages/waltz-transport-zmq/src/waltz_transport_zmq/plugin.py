"""Registers the ZeroMQ transport as the plugin ``zmq``, ``waltz keys`` (CurveZMQ key
pairs) and the transport's options.

Light on purpose: pyzmq and the transport are imported only when ``zmq`` is chosen."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from waltz_api.capabilities import (
    AUTHENTICATED_PEERS,
    CONTROL_FUZZ,
    MALFORMED_INPUT,
    PEER_FAULTS,
    PROCESSES,
)
from waltz_api.hookspecs import (
    CommandDescriptor,
    OptionSchema,
    OptionSpec,
    TransportDescriptor,
    TransportFactory,
    hookimpl,
)

if TYPE_CHECKING:
    import click

CAPABILITIES = frozenset(
    {PROCESSES, PEER_FAULTS, MALFORMED_INPUT, CONTROL_FUZZ, AUTHENTICATED_PEERS}
)


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


def load_keys() -> click.Command:
    from waltz_transport_zmq.cli import keys_group

    return keys_group


@hookimpl
def waltz_cli_commands() -> list[CommandDescriptor]:
    return [
        CommandDescriptor(
            "keys",
            load_keys,
            "CurveZMQ key pairs (encryption and client authentication of the zmq transport).",
        )
    ]


OPTION_MEANINGS = {
    "max_frame_size": "largest frame sent or accepted, bytes (also `ZMQ_MAXMSGSIZE`)",
    "heartbeat_interval": "seconds without sending after which a heartbeat is sent; the "
    "watchdog period",
    "heartbeat_timeout": "seconds of silence after which the peer is reported dead; must "
    "exceed the interval",
    "window_frames": "frames a peer may send beyond what this side's application consumed, "
    "and the most this side keeps in flight to a peer (1..2^24)",
    "window_bytes": "bytes a peer may send beyond what this side's application consumed, "
    "and the most this side keeps in flight to a peer (1..2^40)",
    "coalesce": "pack small frames sent in one loop iteration into one ZeroMQ message",
    "high_water_mark": "`ZMQ_SNDHWM`/`ZMQ_RCVHWM`; 0: automatic (`2 * window_frames + "
    "4096`); else must exceed `2 * window_frames`",
    "reconnect_interval": "seconds, `ZMQ_RECONNECT_IVL`",
    "reconnect_interval_max": "seconds, `ZMQ_RECONNECT_IVL_MAX`",
    "linger": "seconds a closed socket may spend sending its last messages",
    "io_threads": "ZeroMQ I/O threads of the transport's context",
    "security": '`"auto"` (curve when keys are given, else plaintext on loopback and ipc '
    'only), `"plaintext"` (anywhere, deliberately), `"curve"`',
    "curve_server_key": "listener: path of this process's `NAME.key_secret` "
    "(`waltz keys generate`)",
    "curve_authorized_keys": "listener: a directory of the allowed clients' `NAME.key` files, "
    "one such file or Z85 key, or a list of them",
    "curve_server_public_key": "connecting side: the server's `NAME.key` file or its Z85 "
    "public key",
    "curve_client_key": "connecting side: path of this process's own `NAME.key_secret`",
}
"""The meaning of each transport option (``[transport.options]``)."""


def options() -> Sequence[OptionSpec]:
    """Every option the transport reads, its default and its meaning."""
    from waltz_api.config import same_keys
    from waltz_transport_zmq.options import _DEFAULTS

    same_keys("zmq transport", _DEFAULTS, OPTION_MEANINGS)
    return [
        OptionSpec(key, _type(key, value), value, OPTION_MEANINGS[key])
        for key, value in _DEFAULTS.items()
    ]


def _type(key: str, value: object) -> str:
    if key.startswith("curve_"):
        return "str | list[str]" if key == "curve_authorized_keys" else "str"
    return type(value).__name__


@hookimpl
def waltz_option_schemas() -> list[OptionSchema]:
    return [OptionSchema("zmq-options", options)]
