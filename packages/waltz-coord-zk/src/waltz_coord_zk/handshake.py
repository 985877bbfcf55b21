"""A kazoo client whose connect handshake is bounded by a few seconds, not the session timeout.

kazoo (2.x, ``ConnectionHandler._connect``) opens the TCP (and TLS) connection with the
session timeout as its timeout, then waits ``session_timeout / len(hosts)`` for the answer
to its Connect request. With one host that is the whole session timeout: a connection that
a server accepts and never answers (a hung or dying ZooKeeper, a restarted one accepting
before it serves) is waited on until the session is as good as lost, while a retry would
have reached the server that is back. The Java client has the same rule.

Here the wait for one handshake starts at :data:`HANDSHAKE_TIMEOUT` and doubles after each
handshake that timed out (back to the start after one that succeeds), never above kazoo's
own wait. A server that answers is answered in milliseconds; one that is merely slow (a
loaded machine, a first session's fsync) still gets the longer waits after a retry or two,
so no setting is needed for it.

Why not the other ways: a connect string naming the host N times divides the wait by N but
also makes every round through the hosts N attempts, and leaves the TCP/TLS connect at the
session timeout; kazoo's ``connection_retry`` only spaces the attempts, it does not end one.
This leans on two kazoo internals, ``ConnectionHandler._invoke`` (the request/answer call
used during connection establishment only) and the client's ``_connection``; the tests in
``test_zk_handshake_bound.py`` fail if a kazoo release changes them.
"""

from __future__ import annotations

import logging
from typing import Any

from kazoo.client import KazooClient
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import Connect

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 5.0
"""Seconds the first wait for a connect handshake lasts (it grows after timeouts)."""


class HandshakeBound:
    """The wait for one connect handshake (TCP/TLS connect, then the Connect answer):
    ``base`` at first, doubled after each one that timed out, ``base`` again after one
    that succeeded; never more than kazoo's own wait. Used from kazoo's connection thread."""

    def __init__(self, base: float = HANDSHAKE_TIMEOUT) -> None:
        self.base = base
        self.current = base

    def wait(self, kazoo_wait: float) -> float:
        return min(kazoo_wait, self.current)

    def timed_out(self) -> None:
        self.current *= 2

    def succeeded(self) -> None:
        self.current = self.base


class _BoundedHandler(SequentialThreadingHandler):  # type: ignore[misc]  # kazoo is untyped
    """kazoo's threading handler whose TCP/TLS connect waits at most the bound."""

    def __init__(self, bound: HandshakeBound) -> None:
        super().__init__()
        self.handshake_bound = bound

    def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        timeout = kwargs.get("timeout")
        if timeout is None:
            return super().create_connection(*args, **kwargs)
        kwargs["timeout"] = self.handshake_bound.wait(timeout)
        try:
            return super().create_connection(*args, **kwargs)
        except TimeoutError:
            self.handshake_bound.timed_out()
            raise


def bounded_kazoo_handler(bound: HandshakeBound) -> Any:
    """A kazoo handler (``KazooClient(handler=...)``) whose connects wait at most ``bound``."""
    return _BoundedHandler(bound)


class _BoundedConnectionHandler(ConnectionHandler):  # type: ignore[misc]  # kazoo is untyped
    """kazoo's connection handler whose wait for the Connect answer is bounded."""

    def _invoke(self, timeout: float, request: Any, xid: int | None = None) -> Any:
        if not isinstance(request, Connect):
            return super()._invoke(timeout, request, xid)
        bound: HandshakeBound = self.handler.handshake_bound
        wait = bound.wait(timeout)
        try:
            result = super()._invoke(wait, request, xid)
        except self.handler.timeout_exception:
            bound.timed_out()
            log.info("no answer to the ZooKeeper connect handshake within %gs; trying again", wait)
            raise
        bound.succeeded()
        return result


def bounded_kazoo_client(
    handshake_timeout: float = HANDSHAKE_TIMEOUT, **kwargs: Any
) -> KazooClient:
    """A :class:`KazooClient` (same arguments, no ``handler``) whose connect handshake
    waits ``handshake_timeout`` seconds at first (see the module's docstring)."""
    client = KazooClient(handler=_BoundedHandler(HandshakeBound(handshake_timeout)), **kwargs)
    plain = client._connection
    if type(plain) is not ConnectionHandler or not callable(
        getattr(ConnectionHandler, "_invoke", None)
    ):
        log.warning(
            "this kazoo release's connection handler is not the one expected: the wait "
            "for a connect answer stays the session timeout divided by the hosts"
        )
        return client
    client._connection = _BoundedConnectionHandler(
        client, plain.retry_sleeper, logger=plain.logger, sasl_options=plain.sasl_options
    )
    return client
