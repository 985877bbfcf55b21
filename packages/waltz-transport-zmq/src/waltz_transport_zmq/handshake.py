"""The security handshake of the transport: CurveZMQ keys, the ZAP handler, and what a
failed handshake means, in words that say what to configure.

A listener with curve keys starts one ZAP handler (:func:`start_authenticator`) that
accepts the authorized client keys; its socket's monitor logs the peers the handshake
refused (:func:`watch_refusals`). A connecting side waits for the listener's welcome
while watching its own socket's handshake (:func:`await_welcome`), so a refusal is an
AuthenticationError at once rather than a time-out. The transport's own HELLO/WELCOME
(versions, windows, lineage) is :mod:`waltz_transport_zmq.protocol`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from waltz_api.errors import AuthenticationError, ConnectError
from waltz_transport_zmq.logs import PeerLog

log = logging.getLogger(__name__)
_refusals = PeerLog(log, repeat_after=60.0)
"""Lines about peers refused by the security handshake: each peer (or, where libzmq does
not say who it was, each kind of refusal) once a minute at most."""

ZAP_DOMAIN = "waltz"
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
"""The monitor events of a failed security handshake."""
_MECHANISM_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
_CRYPTOGRAPHIC = zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC


class _AuthorizedKeys:
    """The ZAP credentials provider: the configured client public keys (Z85). ``peer``
    is the address of the request being decided (set by the authenticator)."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self._keys = keys
        self.peer = "an unknown address"

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self._keys
        if not allowed:
            shown = key.decode("ascii", "replace")
            _refusals.log(
                logging.WARNING,
                (self.peer, key),
                "refused a CurveZMQ client at %s: its public key %s is not in "
                "curve_authorized_keys",
                self.peer,
                shown,
            )
        return allowed


_NO_DETAIL = {
    # a plaintext peer that saw the mechanism mismatch and hung up before this side did
    # is reported this way too (a race in libzmq's handshake): say what the listener needs
    True: (
        "refused a peer whose ZeroMQ handshake ended without detail (this listener requires "
        "CurveZMQ: a plaintext peer that hung up first, or a broken one)"
    ),
    False: "a peer's ZeroMQ handshake ended without detail (a peer that hung up, or a broken one)",
}


def _handshake_refusal(value: int, curve: bool) -> tuple[str, str]:
    """What a failed handshake on a listener means: (kind, one line for the log)."""
    if value == _MECHANISM_MISMATCH:
        if curve:
            return "plaintext", (
                "refused a plaintext peer: this listener requires CurveZMQ (the peer needs "
                "curve_server_public_key and an authorized curve_client_key)"
            )
        return "curve", "refused a CurveZMQ peer: this listener is plaintext"
    if value == _CRYPTOGRAPHIC:
        return "crypto", (
            "refused a peer whose CurveZMQ handshake failed (it trusts another server "
            "public key, or its stream is corrupted)"
        )
    return f"protocol-{value:x}", (
        f"a peer's ZeroMQ handshake failed (protocol error 0x{value:x}: not a ZeroMQ peer, "
        "or a broken one)"
    )


def watch_refusals(
    context: zmq.asyncio.Context, socket: zmq.Socket[bytes], endpoint: str, curve: bool
) -> asyncio.Task[None]:
    """Log the peers the security handshake refused on a listener's socket (one
    rate-limited line each), until the task is cancelled."""
    address = f"inproc://waltz-listener-monitor-{uuid.uuid4().hex}"
    socket.monitor(
        address, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    monitor = context.socket(zmq.PAIR)
    monitor.connect(address)

    async def watch() -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                kind, value = event["event"], event["value"]
                if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                    key, line = "no-detail", _NO_DETAIL[curve]
                else:
                    key, line = _handshake_refusal(value, curve)
                _refusals.log(logging.WARNING, (endpoint, key), "%s: %s", endpoint, line)
        except (zmq.ZMQError, asyncio.CancelledError):
            pass
        finally:
            monitor.close(linger=0)

    return asyncio.get_running_loop().create_task(watch(), name=f"monitor-{endpoint}")


def start_authenticator(context: zmq.asyncio.Context, keys: frozenset[bytes]) -> Any:
    """The ZAP handler of a curve listener's context: it accepts the client public keys
    ``keys`` (Z85) and logs who it refused (stop it with ``.stop()``)."""
    from zmq.auth.asyncio import AsyncioAuthenticator

    provider = _AuthorizedKeys(keys)

    class Authenticator(AsyncioAuthenticator):
        async def handle_zap_message(self, msg: list[bytes]) -> None:
            # requests are decided one at a time: the provider logs who was refused
            if len(msg) > 3:
                provider.peer = msg[3].decode("utf-8", "replace") or "an unknown address"
            await super().handle_zap_message(msg)

    authenticator = Authenticator(context, log=log.getChild("zap"))
    authenticator.start()
    authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=provider)
    return authenticator


async def await_welcome(
    welcome: asyncio.Future[None],
    monitor: zmq.asyncio.Socket,
    endpoint: str,
    timeout: float,
    curve: bool,
) -> None:
    """Wait for a connecting socket's welcome (its hello sent): the listener's answer, a
    failed security handshake (``monitor`` watches the socket: AuthenticationError
    saying what to configure), or ``timeout`` (ConnectError)."""

    async def handshake_failure() -> str:
        # ZAP refusing the key is always an authentication failure, and so is a
        # security mechanism mismatch (plaintext against curve, either way); other
        # handshake failures only when curve is on (a wrong server key shows as one).
        # Without curve, libzmq retries and the timeout decides.
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
                if curve:
                    return (
                        "the listener does not use CurveZMQ (plaintext) while this "
                        "transport is configured for curve; use the same security on both"
                    )
                return (
                    "the listener requires CurveZMQ and this transport connects in "
                    "plaintext: set curve_server_public_key (the listener's public key) "
                    "and curve_client_key (a key pair the listener authorizes)"
                )
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return (
                    "the listener refused this transport's curve client key: add its "
                    "public key to the listener's curve_authorized_keys"
                )
            if curve and kind & HANDSHAKE_FAILED:
                return (
                    f"{zmq.Event(kind).name}: this side trusts another server public key "
                    "(curve_server_public_key), the listener refused this key, or it "
                    "does not use CurveZMQ"
                )

    failure_task = asyncio.ensure_future(handshake_failure())
    try:
        done, _ = await asyncio.wait(
            {cast("asyncio.Future[Any]", welcome), failure_task},
            timeout=timeout,
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        failure_task.cancel()
        await asyncio.gather(failure_task, return_exceptions=True)
    if welcome.done():
        welcome.result()  # raises the ConnectError of a refusal
        return
    welcome.cancel()
    if failure_task in done and not failure_task.cancelled() and failure_task.exception() is None:
        raise AuthenticationError(
            f"the security handshake with {endpoint} failed: {failure_task.result()}"
        )
    raise ConnectError(
        f"no answer from {endpoint} within {timeout} s: is a listener running there, and do "
        "the security settings of both ends match (a listener that requires CurveZMQ "
        "refuses a plaintext peer)?"
    )
