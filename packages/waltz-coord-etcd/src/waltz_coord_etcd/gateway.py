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
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

from waltz_api.errors import CoordinationError, CoordinationUnavailableError

log = logging.getLogger(__name__)

GRPC_NOT_FOUND = 5
GRPC_UNAVAILABLE = 14

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
    ) -> None:
        if not endpoints:
            raise CoordinationError("no etcd endpoint given")
        self._endpoints = list(endpoints)
        self._current = 0
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    async def open(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, force_close=False),
                json_serialize=json.dumps,
            )

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
    ) -> JSON:
        """POST ``body`` to ``/v3/<method>`` and return the decoded answer."""
        session = self._require_session()
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
            client_timeout = aiohttp.ClientTimeout(
                total=remaining, sock_connect=min(self.connect_timeout, remaining)
            )
            try:
                async with session.post(url, json=body, timeout=client_timeout) as response:
                    raw = await response.read()
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
            data = _decode_single(raw, method)
            if "error" in data or ("code" in data and "message" in data):
                code = int(data.get("code", 0))
                message = str(data.get("message") or data.get("error"))
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
        ends (or raises aiohttp errors) when the stream breaks."""
        session = self._require_session()
        response: aiohttp.ClientResponse | None = None
        last_error: BaseException | None = None
        for _ in range(len(self._endpoints)):
            index = self._current
            try:
                response = await session.post(
                    f"{self._endpoints[index]}/v3/{method}",
                    json=body,
                    headers=dict(headers or {}),
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
                        if isinstance(error, dict):
                            raise EtcdRequestError(
                                f"etcd {method} stream failed: {error.get('message')}",
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
