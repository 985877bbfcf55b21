"""The HTTP endpoint of servers and storage nodes: ``/metrics``, ``/livez``, ``/readyz``,
``/health`` and the JSON routes (``/status``), and the health checks behind them
(see docs/observability.md for what each answers), and its config section
(:class:`HttpSection`, ``[http]`` of both config files). A small HTTP/1.1 server on
the process's event loop, standard library only but for ``prometheus-client``, which
renders ``/metrics`` (``pip install 'waltz-api[metrics]'``); :func:`http_get` is its
client (tests, ``waltz console``)."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from waltz_api.errors import ArgumentTypeError, ConfigError, InvalidArgumentError, WaltzError

log = logging.getLogger(__name__)


@dataclass
class HttpSection:
    """The health (``/health``) and Prometheus metrics (``/metrics``) endpoint."""

    enabled: bool = field(default=False, metadata={"help": "serve /livez, /readyz and /metrics"})
    host: str = field(default="127.0.0.1", metadata={"help": "address of the HTTP endpoint"})
    port: int = field(
        default=0,
        metadata={"min": 0, "max": 65535, "help": "port of the HTTP endpoint (0: any free)"},
    )

    def __post_init__(self) -> None:
        if not self.host.strip():
            raise ConfigError(
                "config key 'http.host' must be an address to listen on (e.g. '127.0.0.1')",
                "http.host",
            )


# -- health -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Check:
    """The outcome of one health check."""

    ok: bool
    detail: str = ""


HealthCheck = Callable[[], Check | Awaitable[Check]]
JsonRoute = Callable[[], Any]
"""A callable returning a JSON-able value, served as ``application/json``."""


async def run_checks(
    checks: Mapping[str, HealthCheck], timeout: float = 5.0
) -> tuple[bool, dict[str, dict[str, Any]]]:
    """Run every check (each bounded by ``timeout`` seconds); (all ok, per-check results)."""
    results: dict[str, dict[str, Any]] = {}
    for name, check in checks.items():
        try:
            outcome = check()
            if inspect.isawaitable(outcome):
                outcome = await asyncio.wait_for(outcome, timeout)
            if not isinstance(outcome, Check):
                raise ArgumentTypeError(f"returned {type(outcome).__name__}, not a Check")
            result = outcome
        except TimeoutError:
            result = Check(False, f"no answer within {timeout:g}s")
        except Exception as exc:
            log.warning("health check %r failed: %s", name, exc)
            result = Check(False, f"{type(exc).__name__}: {exc}")
        results[name] = {"ok": result.ok, "detail": result.detail}
    return all(r["ok"] for r in results.values()), results


# -- the HTTP endpoint -----------------------------------------------------------------------------


def validate_http_address(host: str, port: int, key: str = "http") -> None:
    """ConfigError naming ``key.host`` / ``key.port`` when the address cannot be bound."""
    if not host.strip():
        raise ConfigError(
            f"config key '{key}.host' must be an address to listen on (e.g. '127.0.0.1')",
            f"{key}.host",
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(
            f"config key '{key}.port' must be a TCP port from 0 to 65535 (0 picks a free "
            f"one), got {port!r}",
            f"{key}.port",
        )


MAX_REQUEST_HEAD = 8192
"""Bytes of a request line and headers accepted (a probe's are a few hundred)."""
REQUEST_TIMEOUT = 10.0
"""Seconds a client has to send its request."""

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
_REASONS[503] = "Service Unavailable"


class HttpEndpoint:
    """Serves ``/metrics``, ``/livez``, ``/readyz`` and ``/health`` on ``host:port``
    (port 0 picks a free one): HTTP/1.1, one request per connection, GET and HEAD."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        checks: Mapping[str, HealthCheck] | None = None,
        live_checks: Mapping[str, HealthCheck] | None = None,
        check_timeout: float = 5.0,
        config_key: str = "http",
        json_routes: Mapping[str, JsonRoute] | None = None,
    ) -> None:
        """``checks``: what ``/readyz`` (and ``/health``) runs; ``live_checks``: what
        ``/livez`` runs (none by default: answering proves the loop is alive);
        ``json_routes``: path -> a callable whose JSON-able result the path serves
        (``/status``)."""
        validate_http_address(host, port, config_key)
        self.registry = registry
        self.host = host
        self.requested_port = port
        self.checks: dict[str, HealthCheck] = dict(checks or {})
        self.live_checks: dict[str, HealthCheck] = dict(live_checks or {})
        self.check_timeout = check_timeout
        self.json_routes: dict[str, JsonRoute] = dict(json_routes or {})
        self._config_key = config_key
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise WaltzError("the HTTP endpoint is not started")
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def add_check(self, name: str, check: HealthCheck) -> None:
        """A readiness check (``/readyz``, ``/health``)."""
        self.checks[name] = check

    async def start(self) -> None:
        try:
            server = await asyncio.start_server(
                self._handle, self.host, self.requested_port, reuse_address=True
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot serve health and metrics on {self.host}:{self.requested_port}: "
                f"{exc.strerror or exc}; choose another '{self._config_key}.port' or "
                f"'{self._config_key}.host'",
                f"{self._config_key}.port",
            ) from exc
        self._server = server
        self._port = int(server.sockets[0].getsockname()[1])
        log.info("health and metrics on %s (/livez, /readyz, /metrics)", self.url)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        with suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 5)

    async def __aenter__(self) -> HttpEndpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                return
            if len(head) > MAX_REQUEST_HEAD:
                await _reply(writer, 400, "text/plain; charset=utf-8", b"request too large\n")
                return
            method, path = _request_line(head)
            if method not in ("GET", "HEAD"):
                status, ctype, body = 405, "text/plain; charset=utf-8", b"GET or HEAD only\n"
            else:
                status, ctype, body = await self._route(path)
            await _reply(writer, status, ctype, b"" if method == "HEAD" else body, len(body))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            with suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)
            if task is not None:
                self._handlers.discard(task)

    async def _route(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if path in ("/readyz", "/health"):
            return await self._checks(self.checks)
        if path == "/livez":
            return await self._checks(self.live_checks)
        route = self.json_routes.get(path)
        if route is not None:
            try:
                body = json.dumps(route(), separators=(",", ":")).encode()
            except Exception as exc:  # a status that cannot be computed is an answer too
                log.warning("computing %s failed: %s", path, exc)
                return 503, "application/json", json.dumps({"error": str(exc)}).encode()
            return 200, "application/json", body
        return 404, "text/plain; charset=utf-8", b"not found: try /metrics, /livez, /readyz\n"

    async def _checks(self, checks: Mapping[str, HealthCheck]) -> tuple[int, str, bytes]:
        ok, results = await run_checks(checks, self.check_timeout)
        body = json.dumps({"status": "ok" if ok else "failing", "checks": results}).encode()
        return (200 if ok else 503), "application/json", body


def _request_line(head: bytes) -> tuple[str, str]:
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3:
        return "", ""
    return parts[0].upper(), urlsplit(parts[1]).path


async def _reply(
    writer: asyncio.StreamWriter,
    status: int,
    content_type: str,
    body: bytes,
    length: int | None = None,
) -> None:
    reason = _REASONS.get(status, "")
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body) if length is None else length}\r\n"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")
    writer.write(head + body)
    await writer.drain()


@dataclass(frozen=True, slots=True)
class HttpReply:
    status: int
    content_type: str
    body: str


async def http_get(url: str, timeout: float = 10.0) -> HttpReply:
    """GET ``url`` (``http://host:port/path``, as served by :class:`HttpEndpoint`).

    Raises OSError (ConnectionRefusedError, ...) or TimeoutError when it cannot."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None or parts.port is None:
        raise InvalidArgumentError(f"not an http://host:port/ URL: {url!r}")

    async def get() -> HttpReply:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            host = parts.netloc
            request = f"GET {parts.path or '/'} HTTP/1.1\r\nHost: {host}\r\n"
            writer.write((request + "Connection: close\r\n\r\n").encode("latin-1"))
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
            with suppress(Exception):
                await writer.wait_closed()
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status_parts = lines[0].split(" ", 2)
        if len(status_parts) < 2 or not status_parts[1].isdigit():
            raise ConnectionError(f"{url}: not an HTTP answer")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
        }
        return HttpReply(
            int(status_parts[1]), headers.get("content-type", ""), body.decode("utf-8", "replace")
        )

    return await asyncio.wait_for(get(), timeout)
