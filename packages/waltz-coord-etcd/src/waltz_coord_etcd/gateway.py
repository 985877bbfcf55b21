"""A small asyncio client of etcd v3's JSON gRPC gateway (``/v3/...`` over HTTP).

etcd serves every v3 RPC as JSON on its client port: ``POST /v3/kv/range``,
``/v3/kv/txn``, ``/v3/lease/grant``, ``/v3/lease/keepalive``, ``/v3/watch``
(a stream of JSON objects). Keys and values are base64, 64-bit integers are
decimal strings, and zero values are omitted (proto3 JSON mapping).

Failover: requests go to the current endpoint; when it cannot be reached the
next one is tried. A request that may have been applied (the connection broke
after it was sent) is retried only when it is idempotent; a mutation then
fails with CoordinationUnavailableError, because retrying a compare-and-set
whose first attempt succeeded would report a false failure.

Security: over TLS (``https://`` members, an ``ssl.SSLContext`` with the CA and a
client certificate) and with etcd's authentication: a user name and password are
exchanged for a token (``/v3/auth/authenticate``) sent with every request; a
request refused for its token (expired, or the member restarted) was not applied,
so it is sent again after a new token, mutations included.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from waltz_api.errors import AuthenticationError, CoordinationError, CoordinationUnavailableError
from waltz_api.security import Login

log = logging.getLogger(__name__)

GRPC_INVALID_ARGUMENT = 3
GRPC_NOT_FOUND = 5
GRPC_PERMISSION_DENIED = 7
GRPC_UNAVAILABLE = 14
GRPC_UNAUTHENTICATED = 16

# Errors of a request refused for its token: nothing was applied; authenticate again.
_TOKEN_MESSAGES = ("invalid auth token", "user name is empty", "auth: revision in header is old")
_PLAIN_TO_TLS = b"Client sent an HTTP request to an HTTPS server"
_CN_REFUSED = b"CommonName of client sending a request against gateway"
_TLS_HINT = (
    "the member speaks TLS: set tls=true and tls_ca (and tls_cert/tls_key when it "
    "requires client certificates)"
)

# Errors after which etcd did not propose the request: safe to retry anywhere.
_NOT_APPLIED_MESSAGES = ("etcdserver: no leader", "etcdserver: not capable")

JSON = dict[str, Any]


class EtcdRequestError(CoordinationError):
    """etcd answered a request with an error (``code`` is the gRPC status code)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def b64(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


class EtcdGateway:
    """HTTP/JSON access to one etcd cluster, with failover between its members."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        request_timeout: float = 10.0,
        connect_timeout: float = 2.0,
        tls: ssl.SSLContext | None = None,
        login: Login | None = None,
    ) -> None:
        if not endpoints:
            raise CoordinationError("no etcd endpoint given")
        scheme = "https://" if tls is not None else "http://"
        self._endpoints = [scheme + e.split("://", 1)[-1] for e in endpoints]
        self._current = 0
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None
        self._tls = tls
        self._login = login
        self._token: str | None = None
        self._token_lock = asyncio.Lock()

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    async def open(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=0, force_close=False, ssl=self._tls if self._tls is not None else True
                ),
                json_serialize=json.dumps,
            )
        if self._login is not None and self._token is None:
            await self.authenticate()

    async def authenticate(self, stale: str | None = None) -> None:
        """Exchange the login for a token (again, when the one in use is ``stale``)."""
        login = self._login
        if login is None:
            return
        async with self._token_lock:
            if self._token is not None and self._token != stale:
                return  # another request renewed it meanwhile
            self._token = None
            try:
                answer = await self.call(
                    "auth/authenticate",
                    {"name": login.username, "password": login.password},
                    idempotent=True,
                    _auth=False,
                )
            except EtcdRequestError as exc:
                raise AuthenticationError(
                    f"etcd refused the login of user {login.username!r} ({exc}): check the "
                    "coordination username and password, and that etcd's authentication is "
                    "enabled"
                ) from None
            token = answer.get("token")
            if not isinstance(token, str) or not token:
                raise AuthenticationError(
                    f"etcd answered the login of user {login.username!r} without a token; "
                    "is authentication enabled (etcdctl auth enable)?"
                )
            self._token = token

    async def diagnose(self) -> str:
        """Why the first member may not answer, as far as one TLS handshake tells: a
        plaintext client at a TLS port, or the TLS error ("" when it tells nothing)."""
        host, _, port = self._endpoints[0].split("://", 1)[-1].rpartition(":")
        context = self._tls
        if context is None:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        try:
            async with asyncio.timeout(3):
                _, writer = await asyncio.open_connection(host, int(port), ssl=context)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        except ssl.SSLError as exc:
            if self._tls is not None:
                return f"the TLS handshake with {host}:{port} failed ({exc.reason or exc})"
            if "WRONG_VERSION_NUMBER" in str(exc) or "record layer" in str(exc):
                return ""
            return _TLS_HINT
        except (OSError, TimeoutError):
            return ""
        return "" if self._tls is not None else _TLS_HINT

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = dict(extra or {})
        if self._token is not None:
            headers["Authorization"] = self._token
        return headers

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise CoordinationError("the etcd client is not started (call start())")
        return self._session

    def _rotate(self, failed: int) -> None:
        if self._current == failed:
            self._current = (failed + 1) % len(self._endpoints)

    async def call(
        self,
        method: str,
        body: Mapping[str, Any],
        *,
        idempotent: bool,
        timeout: float | None = None,
        _auth: bool = True,
    ) -> JSON:
        """POST ``body`` to ``/v3/<method>`` and return the decoded answer."""
        session = self._require_session()
        reauthenticated = False
        loop = asyncio.get_running_loop()
        if not idempotent:
            # Let the loop process pending events of pooled connections first: a
            # member that died since the last request has already closed them (its
            # FIN is queued), and a mutation sent on such a connection would fail
            # ambiguously although it never reached anyone. Two iterations: one to
            # select the socket, one for its read handler to mark it closed.
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        budget = self.request_timeout if timeout is None else timeout
        deadline = loop.time() + budget
        last_error: BaseException | None = None
        tried = 0
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            index = self._current
            url = f"{self._endpoints[index]}/v3/{method}"
            if tried and tried % len(self._endpoints) == 0:
                # Every member failed once: pause briefly (an election takes ~1 s).
                await asyncio.sleep(min(0.2, max(remaining - 0.01, 0)))
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
            tried += 1
            attempt = remaining
            if idempotent and len(self._endpoints) > 1:
                # A member that accepted the connection and never answers (hung, or not
                # serving yet) must not take the whole budget when another could answer:
                # an idempotent request moves on after its share (at least the connect
                # timeout). A mutation waits for its answer: once sent it is not retried.
                share = max(self.connect_timeout, budget / len(self._endpoints))
                attempt = min(remaining, share)
            client_timeout = aiohttp.ClientTimeout(
                total=attempt, sock_connect=min(self.connect_timeout, attempt)
            )
            token = self._token if _auth else None
            try:
                async with session.post(
                    url,
                    json=body,
                    timeout=client_timeout,
                    headers={"Authorization": token} if token else None,
                ) as response:
                    raw = await response.read()
            except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError) as exc:
                raise CoordinationUnavailableError(
                    f"the TLS handshake with etcd at {self._endpoints[index]} failed ({exc}): "
                    "check tls_ca (the CA of the members' certificates) and tls_cert/tls_key "
                    "(a client certificate the members trust)"
                ) from None
            except aiohttp.ClientConnectorError as exc:
                last_error = exc
                self._rotate(index)
                continue
            except (aiohttp.ClientError, TimeoutError) as exc:
                last_error = exc
                self._rotate(index)
                if idempotent:
                    continue
                raise CoordinationUnavailableError(
                    f"etcd request {method} to {self._endpoints[index]} failed after it was "
                    f"sent ({type(exc).__name__}: {exc}); it may or may not have been applied: "
                    "read the state again before retrying"
                ) from exc
            if raw.startswith(_PLAIN_TO_TLS):
                raise CoordinationUnavailableError(
                    f"etcd at {self._endpoints[index]} speaks TLS: set tls=true and tls_ca "
                    "(and tls_cert/tls_key when it requires client certificates)"
                )
            if raw.startswith(_CN_REFUSED):
                raise CoordinationError(
                    f"etcd at {self._endpoints[index]} refuses this client certificate: with "
                    "authentication on, etcd's JSON gateway takes no client certificate that "
                    "carries a CommonName; issue tls_cert without a CN (e.g. subject O=waltz, "
                    "OU=node), the user comes from username/password"
                )
            data = _decode_single(raw, method)
            if "error" in data or ("code" in data and "message" in data):
                code = int(data.get("code", 0))
                message = str(data.get("message") or data.get("error"))
                if (
                    _auth
                    and self._login is not None
                    and not reauthenticated
                    and any(m in message for m in _TOKEN_MESSAGES)
                ):
                    reauthenticated = True  # refused for its token: nothing was applied
                    await self.authenticate(stale=token)
                    continue
                if code == GRPC_PERMISSION_DENIED:
                    who = self._login.username if self._login else "an unauthenticated client"
                    raise EtcdRequestError(
                        f"etcd refused {method} for {who}: permission denied; the user's role "
                        "must grant readwrite on the cluster's key prefix (the URI's root + '/')",
                        code,
                    )
                if "user name is empty" in message:
                    raise EtcdRequestError(
                        f"etcd requires authentication for {method}: set the coordination "
                        "username and password (or password_file)",
                        code,
                    )
                if code == GRPC_UNAVAILABLE or response.status >= 500:
                    last_error = EtcdRequestError(message, code)
                    self._rotate(index)
                    if idempotent or any(m in message for m in _NOT_APPLIED_MESSAGES):
                        continue
                    raise CoordinationUnavailableError(
                        f"etcd request {method} failed ({message}); it may or may not have "
                        "been applied: read the state again before retrying"
                    )
                raise EtcdRequestError(f"etcd request {method} failed: {message}", code)
            return data
        raise CoordinationUnavailableError(
            f"etcd at {', '.join(self._endpoints)} did not answer {method} within "
            f"{budget:.1f}s (last error: {last_error!r}); check that a majority of the "
            "etcd members is running and reachable"
        )

    async def stream(
        self, method: str, body: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[JSON]:
        """POST ``body`` to a streaming RPC and yield each result as it arrives.

        Raises CoordinationUnavailableError when no member accepts the stream;
        ends (or raises aiohttp errors) when the stream breaks. A member has the
        request timeout to answer the request (etcd answers a watch at once, with its
        "created" message); one that accepted the connection and says nothing (hung,
        or not serving yet) is left for the next, not waited on forever."""
        session = self._require_session()
        response: aiohttp.ClientResponse | None = None
        last_error: BaseException | None = None
        for _ in range(len(self._endpoints)):
            index = self._current
            try:
                # no read timeout on the stream itself: a watch is quiet while nothing
                # changes; only the wait for the answer's head is bounded
                async with asyncio.timeout(self.request_timeout):
                    response = await session.post(
                        f"{self._endpoints[index]}/v3/{method}",
                        json=body,
                        headers=self._headers(headers),
                        timeout=aiohttp.ClientTimeout(
                            total=None, sock_connect=self.connect_timeout, sock_read=None
                        ),
                    )
                break
            except (aiohttp.ClientError, TimeoutError) as exc:
                last_error = exc
                self._rotate(index)
        if response is None:
            raise CoordinationUnavailableError(
                f"no etcd member of {', '.join(self._endpoints)} accepted a {method} stream "
                f"(last error: {last_error!r})"
            )
        decoder = json.JSONDecoder()
        buffer = ""
        try:
            async for chunk in response.content.iter_any():
                buffer += chunk.decode("utf-8")
                while True:
                    buffer = buffer.lstrip()
                    if not buffer:
                        break
                    try:
                        message, end = decoder.raw_decode(buffer)
                    except json.JSONDecodeError:
                        break  # an incomplete object: wait for more bytes
                    buffer = buffer[end:]
                    if not isinstance(message, dict):
                        raise CoordinationError(f"etcd sent a malformed {method} message")
                    if "error" in message:
                        error = message["error"]
                        text = str(error.get("message") if isinstance(error, dict) else error)
                        if self._login is not None and any(m in text for m in _TOKEN_MESSAGES):
                            # the caller resumes the stream; it goes with a new token
                            await self.authenticate(stale=self._token)
                        if isinstance(error, dict):
                            raise EtcdRequestError(
                                f"etcd {method} stream failed: {text}",
                                int(error.get("grpc_code") or error.get("code") or 0),
                            )
                        raise EtcdRequestError(f"etcd {method} stream failed: {error}", 0)
                    result = message.get("result", message)
                    if isinstance(result, dict):
                        yield result
        finally:
            response.release()
            response.close()


def _decode_single(raw: bytes, method: str) -> JSON:
    try:
        text = raw.decode("utf-8").strip()
        data, _ = json.JSONDecoder().raw_decode(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CoordinationError(
            f"etcd answered {method} with something that is not JSON: {raw[:200]!r}; "
            "is this an etcd v3 (>= 3.4) client URL?"
        ) from exc
    if not isinstance(data, dict):
        raise CoordinationError(f"etcd answered {method} with a malformed message")
    result = data.get("result")
    if isinstance(result, dict) and "error" not in data:
        return result
    return data
