"""The console's HTTP server (aiohttp): the page and its assets, a JSON API over the
collector's views, a Server-Sent Events stream that tells the page when to refresh,
and the actions behind login and confirmation.

Routes (every ``/api`` answer is JSON; an error is ``{"error": "..."}`` with 400 for
bad input, 401/403 for a missing login or header, 404 for an unknown partition or
route, 502 when a process the console asks does not answer as it should, 503 while
the coordination service cannot be reached)::

    GET  /                                   the page (static/index.html)
    GET  /static/...                         its script, style sheet and icon
    GET  /api/overview                       cluster, servers, storage nodes, session
    GET  /api/partitions?offset&limit&q      a page of partitions
    GET  /api/partitions/{p}                 one partition, its clients and events
                                             (and ``started``: when the time line began)
    GET  /api/partitions/{p}/transactions?start&count   (or ?latest=1&count)
    GET  /api/charts[?partition=p]           the cluster's (a partition's) charts: commit
                                             rate, latency, replica lag, feed lag
    GET  /api/clients?offset&limit&q         a page of connected clients
    GET  /api/events?after&partition&limit   the time line (newest first)
    GET  /api/stream                         SSE: "update" after every refresh
    GET  /api/session                        whether this browser is logged in
    POST /api/login {"token"}  /api/logout
    POST /api/actions/{name} {"confirm": true, ...}   (login and X-Waltz-Console)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from waltz_api.contracts.transport import Transport
from waltz_api.errors import ConfigError, WaltzError
from waltz_console.actions import ACTIONS, ActionContext
from waltz_console.auth import CSRF_HEADER, SESSION_COOKIE, Sessions
from waltz_console.collector import Collector
from waltz_console.events import Event
from waltz_console.transactions import (
    MAX_RECORDS,
    RangeAnswer,
    ReadError,
    describe_record,
    read_range,
)
from waltz_console.views import DEFAULT_PAGE, page, parse_int
from waltz_server.cluster_admin import ClusterAdmin

log = logging.getLogger(__name__)

STREAM_KEEPALIVE = 15.0
MAX_BODY = 64 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def static_dir() -> Path:
    return Path(str(resources.files("waltz_console") / "static"))


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, default=str))


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bad input and failures answer a clear JSON error; nothing reaches the client as a
    traceback."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _json({"error": str(exc)}, exc.status)
    except ConfigError as exc:
        return _json({"error": str(exc)}, 400)
    except ReadError as exc:
        return _json({"error": str(exc)}, 502)
    except WaltzError as exc:
        return _json({"error": str(exc)}, 409)
    except web.HTTPException as exc:
        if request.path.startswith("/api/"):
            return _json({"error": f"{exc.reason}: {request.method} {request.path}"}, exc.status)
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("console: %s %s failed", request.method, request.path)
        return _json({"error": "internal error; see the console's log"}, 500)


@web.middleware
async def headers_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    response = await handler(request)
    # everything the page loads comes from this server: no CDN, no inline script
    response.headers.setdefault(
        "Content-Security-Policy",
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'",
    )
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    if request.path.startswith("/api/"):
        response.headers.setdefault("Cache-Control", "no-store")
    return response


class Console:
    """The web application around a :class:`Collector`."""

    def __init__(
        self,
        collector: Collector,
        sessions: Sessions,
        transport_factory: Callable[[], Transport],
        *,
        storage_endpoint: str = "tcp://{}",
        timeout: float = 5.0,
    ) -> None:
        self.collector = collector
        self.sessions = sessions
        self._transport_factory = transport_factory
        self._transport: Transport | None = None
        self.storage_endpoint = storage_endpoint
        self.timeout = timeout
        self._streams: set[web.StreamResponse] = set()
        self._closing = False
        self._action_lock = asyncio.Lock()

    def transport(self) -> Transport:
        if self._transport is None:
            self._transport = self._transport_factory()
        return self._transport

    async def close(self) -> None:
        if self._transport is not None:
            with contextlib.suppress(WaltzError, OSError):
                await self._transport.close()
            self._transport = None

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[headers_middleware, errors_middleware], client_max_size=MAX_BODY
        )
        app.router.add_get("/", self.index)
        app.router.add_get("/api/overview", self.overview)
        app.router.add_get("/api/partitions", self.partitions)
        app.router.add_get("/api/partitions/{partition}", self.partition)
        app.router.add_get("/api/partitions/{partition}/transactions", self.transactions)
        app.router.add_get("/api/charts", self.charts)
        app.router.add_get("/api/clients", self.clients)
        app.router.add_get("/api/events", self.events)
        app.router.add_get("/api/stream", self.stream)
        app.router.add_get("/api/session", self.session)
        app.router.add_post("/api/login", self.login)
        app.router.add_post("/api/logout", self.logout)
        app.router.add_post("/api/actions/{name}", self.action)
        app.router.add_route("*", "/api/{tail:.*}", self.unknown)
        app.router.add_static("/static", static_dir(), follow_symlinks=False)
        app.on_shutdown.append(self._on_shutdown)
        return app

    def end_streams(self) -> None:
        """End every open event stream now (a stopping console does not wait for them;
        the pages' EventSource reconnects to the next console)."""
        self._closing = True
        self.collector.wake()

    async def _on_shutdown(self, _app: web.Application) -> None:
        self.end_streams()

    # -- pages ----------------------------------------------------------------------------------

    async def index(self, _request: web.Request) -> web.StreamResponse:
        return web.FileResponse(static_dir() / "index.html")

    async def unknown(self, request: web.Request) -> web.Response:
        raise ApiError(404, f"no such API route: {request.method} {request.path}")

    def _authenticated(self, request: web.Request) -> bool:
        return self.sessions.valid(request.cookies.get(SESSION_COOKIE))

    async def overview(self, request: web.Request) -> web.Response:
        snap = self.collector.snapshot
        return _json(
            {
                "version": self.collector.version,
                "cluster": snap.cluster,
                "servers": snap.servers,
                "storage": snap.storage,
                "authenticated": self._authenticated(request),
                "last_event": self.collector.events[-1]["id"] if self.collector.events else 0,
            }
        )

    def _paging(self, request: web.Request) -> tuple[int, int, str]:
        q = request.query
        offset = parse_int(q.get("offset"), "offset", default=0)
        limit = parse_int(q.get("limit"), "limit", default=DEFAULT_PAGE, minimum=1)
        return offset, limit, q.get("q", "")

    async def partitions(self, request: web.Request) -> web.Response:
        offset, limit, query = self._paging(request)
        rows = self.collector.snapshot.partitions
        state = request.query.get("state", "")
        if state:
            rows = [r for r in rows if r["state"] == state]
        result = page(
            rows,
            offset=offset,
            limit=limit,
            query=query,
            fields=("partition", "owner", "owner_endpoint", "state"),
        )
        result["version"] = self.collector.version
        return _json(result)

    def _partition_id(self, request: web.Request) -> int:
        text = request.match_info["partition"]
        pid = parse_int(text, "partition")
        total = self.collector.snapshot.cluster["partitions"]
        if self.collector.snapshot.partition(pid) is None:
            raise ApiError(
                404,
                f"partition {pid} does not exist: the cluster has partitions 0..{total - 1}"
                if total
                else f"partition {pid} is unknown: the cluster metadata is not read yet",
            )
        return pid

    async def partition(self, request: web.Request) -> web.Response:
        pid = self._partition_id(request)
        snap = self.collector.snapshot
        return _json(
            {
                "version": self.collector.version,
                "partition": snap.partition(pid),
                "clients": [c for c in snap.clients if c["partition"] == pid],
                "events": [e for e in reversed(self.collector.events) if e["partition"] == pid][
                    :50
                ],
                "started": self.collector.started,
                "charts": self.collector.history.charts(pid, self.collector.wall_clock()),
            }
        )

    async def charts(self, request: web.Request) -> web.Response:
        """The geometry of the line charts (``waltz_console.history.chart``): the page
        makes the SVG elements from it."""
        pid = None
        if request.query.get("partition", "") != "":
            pid = parse_int(request.query.get("partition"), "partition")
            if self.collector.snapshot.partition(pid) is None:
                raise ApiError(404, f"partition {pid} does not exist")
        now = self.collector.wall_clock()
        return _json(
            {"version": self.collector.version, "charts": self.collector.history.charts(pid, now)}
        )

    async def clients(self, request: web.Request) -> web.Response:
        offset, limit, query = self._paging(request)
        rows = self.collector.snapshot.clients
        if request.query.get("partition", "") != "":
            pid = parse_int(request.query.get("partition"), "partition")
            rows = [r for r in rows if r["partition"] == pid]
        result = page(rows, offset=offset, limit=limit, query=query, fields=("partition", "client"))
        result["version"] = self.collector.version
        return _json(result)

    async def events(self, request: web.Request) -> web.Response:
        after = parse_int(request.query.get("after"), "after", default=0)
        limit = parse_int(request.query.get("limit"), "limit", default=200, minimum=1)
        rows = self.collector.recent_events(after)
        if request.query.get("partition", "") != "":
            pid = parse_int(request.query.get("partition"), "partition")
            rows = [e for e in rows if e["partition"] == pid]
        kind = request.query.get("kind", "")
        if kind:
            rows = [e for e in rows if e["kind"] == kind]
        return _json(
            {
                "events": list(reversed(rows))[:limit],
                "total": len(rows),
                "started": self.collector.started,
            }
        )

    async def transactions(self, request: web.Request) -> web.Response:
        pid = self._partition_id(request)
        q = request.query
        count = parse_int(q.get("count"), "count", default=20, minimum=1)
        if count > MAX_RECORDS:
            raise ApiError(400, f"count must be from 1 to {MAX_RECORDS}, got {count}")
        latest = q.get("latest", "") in ("1", "true", "yes")
        start = 0 if latest else parse_int(q.get("start"), "start", default=0)
        row = self.collector.snapshot.partition(pid)
        assert row is not None
        endpoint, generation = row["owner_endpoint"], row["generation"]
        if not row["owner_alive"] or not endpoint or generation is None:
            raise ApiError(
                503, f"partition {pid} has no live server now; its transactions cannot be read"
            )

        async def read(first: int, records: int) -> RangeAnswer:
            return await read_range(
                self.transport(),
                endpoint,
                pid,
                generation,
                start=first,
                count=records,
                timeout=self.timeout,
            )

        if latest:
            # the high-water mark first (any read answers it), then the range ending there
            top = (await read(0, 1)).high_water_mark
            start = max(0, top - count + 1)
        answer = await read(start, count)
        return _json(
            {
                "partition": pid,
                "high_water_mark": answer.high_water_mark,
                "start": start,
                "count": count,
                "transactions": [describe_record(r) for r in answer.records],
                "note": None
                if answer.records or start <= answer.high_water_mark
                else f"no transaction at {start}: the high-water mark is {answer.high_water_mark}",
            }
        )

    # -- the live stream --------------------------------------------------------------------------

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Server-Sent Events: one ``update`` (the version, the cluster summary and the
        events since the last one) after each refresh; a comment line keeps it open."""
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        self._streams.add(response)
        last_event = parse_int(request.query.get("after"), "after", default=0)
        version = -1
        try:
            while not self._closing:
                if self.collector.version != version:
                    version = self.collector.version
                    events = self.collector.recent_events(last_event)
                    if events:
                        last_event = events[-1]["id"]
                    data = json.dumps(
                        {
                            "version": version,
                            "cluster": self.collector.snapshot.cluster,
                            "events": events[-100:],
                        },
                        default=str,
                    )
                    await response.write(f"event: update\ndata: {data}\n\n".encode())
                new = await self.collector.wait_change(version, STREAM_KEEPALIVE)
                if new == version and not self._closing:
                    await response.write(b": keep-alive\n\n")
        except (ConnectionResetError, asyncio.CancelledError, RuntimeError):
            pass
        finally:
            self._streams.discard(response)
        return response

    # -- login and actions -----------------------------------------------------------------------

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body must be a JSON object") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    async def session(self, request: web.Request) -> web.Response:
        return _json({"authenticated": self._authenticated(request)})

    async def login(self, request: web.Request) -> web.Response:
        if request.headers.get(CSRF_HEADER) != "1":
            raise ApiError(403, f"the {CSRF_HEADER} header is required")
        body = await self._body(request)
        token = body.get("token")
        session = self.sessions.login(token) if isinstance(token, str) else None
        if session is None:
            log.warning("console: a login with a wrong token from %s", request.remote)
            raise ApiError(401, "wrong token: use the token the console printed at start")
        response = _json({"authenticated": True})
        response.set_cookie(
            SESSION_COOKIE,
            session,
            httponly=True,
            samesite="Strict",
            max_age=int(self.sessions.session_ttl),
            path="/",
        )
        return response

    async def logout(self, request: web.Request) -> web.Response:
        self.sessions.logout(request.cookies.get(SESSION_COOKIE))
        response = _json({"authenticated": False})
        response.del_cookie(SESSION_COOKIE, path="/")
        return response

    async def action(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not self._authenticated(request):
            raise ApiError(401, "log in first: actions need the console's token")
        if request.headers.get(CSRF_HEADER) != "1":
            raise ApiError(403, f"the {CSRF_HEADER} header is required")
        handler = ACTIONS.get(name)
        if handler is None:
            raise ApiError(404, f"no action {name!r}; actions: {', '.join(sorted(ACTIONS))}")
        body = await self._body(request)
        if body.get("confirm") is not True:
            raise ApiError(400, 'confirm the action: the body needs "confirm": true')
        metadata = self.collector.metadata
        if metadata is None:
            raise ApiError(
                503, f"the coordination service is not reachable: {self.collector.meta.error}"
            )
        admin = ClusterAdmin(metadata.coordination)
        context = ActionContext(admin, self.transport(), self.storage_endpoint, self.timeout)
        async with self._action_lock:
            log.info(
                "console: action %s %s", name, {k: v for k, v in body.items() if k != "confirm"}
            )
            result = await handler(context, body)
        if name != "verify":
            self.collector.add_events([Event("action", f"operator: {result['message']}")])
        return _json(result)
