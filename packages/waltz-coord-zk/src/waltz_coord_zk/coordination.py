"""The Coordination contract on ZooKeeper, through kazoo.

kazoo runs its own threads (a connection thread and a callback thread). This
module is an asyncio facade over kazoo's ``*_async`` calls: each result is
handed to the event loop with ``loop.call_soon_threadsafe``; watches and
session listeners are delivered on the loop through
:mod:`waltz_api.coordination_support`.

Mapping of the contract:

- root: every path is prefixed with the URI's root (a chroot done here, so
  the root is created on start when missing);
- version: the znode's data version (``stat.version``). A znode that is
  deleted and created again restarts at version 0: never delete a znode a
  fencing CAS rests on (see :class:`waltz_api.contracts.Versioned`);
- ephemeral entries: ephemeral znodes of this client's ZooKeeper session;
- watches: kazoo's DataWatch for values; children watches re-arm a
  ZooKeeper child watch (or an exists watch while the path is absent) after
  every event and always re-read, so the final state is never missed;
- counters: the data version of the counter znode, bumped by an
  unconditional ``setData`` (one round trip, no CAS retries under
  contention; ZooKeeper versions are 32-bit, so a counter ends at 2**31-1);
- sessions: kazoo's CONNECTED / SUSPENDED / LOST. After LOST the kazoo client
  is stopped (it would otherwise open a new session silently) and every
  operation raises SessionLostError.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

from kazoo import exceptions as kz
from kazoo.client import KazooClient, KazooState
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.recipe.watchers import DataWatch

from waltz_api.contracts.coordination import (
    ChildrenCallback,
    DataCallback,
    SessionState,
    Versioned,
    Watch,
    join_path,
)
from waltz_api.coordination_support import (
    DeliveryWatch,
    LoopDelivery,
    SessionStateTracker,
    TrackedSessionCoordination,
    rooted_path,
)
from waltz_api.errors import (
    AuthenticationError,
    BadVersionError,
    ConfigError,
    CoordinationError,
    CoordinationUnavailableError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    SessionLostError,
)
from waltz_coord_zk.handshake import bounded_kazoo_client
from waltz_coord_zk.security import SECURITY_KEYS, ZkSecurity

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SESSION_TIMEOUT = 10.0
DEFAULT_CONNECT_TIMEOUT = 15.0
DEFAULT_ROOT = "/waltz"
MAX_RECURSIVE_DELETE_ATTEMPTS = 20
MAX_CHILDREN_REFRESH_ATTEMPTS = 100


def parse_zk_uri(uri: str) -> tuple[str, str, dict[str, str]]:
    """Split ``zk://h1:p1,h2:p2/root?session_timeout=10`` into (hosts, root, options).

    A bare connect string ``h1:p1,h2:p2/root`` is accepted too. The root
    defaults to ``/waltz``."""
    text = uri if "://" in uri else f"zk://{uri}"
    parts = urlsplit(text)
    if parts.scheme not in ("zk", "zookeeper"):
        raise ConfigError(
            f"a ZooKeeper coordination URI looks like zk://host:port[,host:port]/root, got {uri!r}",
            key="coordination",
        )
    hosts = parts.netloc
    if not hosts:
        raise ConfigError(
            f"no ZooKeeper host in {uri!r}; write zk://host:port[,host:port]/root",
            key="coordination",
        )
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ConfigError(
                f"ZooKeeper address {host!r} in {uri!r} is not host:port", key="coordination"
            )
    root = join_path(parts.path) if parts.path.strip("/") else DEFAULT_ROOT
    return hosts, root, dict(parse_qsl(parts.query))


def _float_option(options: Mapping[str, Any], key: str, default: float) -> float:
    raw = options.get(key, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ConfigError(
            f"coordination option {key} must be a number of seconds, got {raw!r}", key=key
        ) from None
    if value <= 0:
        raise ConfigError(f"coordination option {key} must be positive, got {raw!r}", key=key)
    return value


OPTION_KEYS = ("session_timeout", "connect_timeout", *SECURITY_KEYS)
STOP_WAIT = 1.0
"""Seconds a failed start waits for kazoo to stop (the rest happens in the background)."""
DIAGNOSE_TIMEOUT = 3.0
"""Seconds the diagnosis of a failed connection may take (at most the connect timeout)."""


def create_zk_coordination(
    connect: str, options: Mapping[str, Any] | None = None
) -> ZooKeeperCoordination:
    """The plugin factory: ``connect`` is a ``zk://`` URI; options (or URI query
    parameters) ``session_timeout`` and ``connect_timeout`` are in seconds; TLS, the
    login and the ACLs are :mod:`waltz_coord_zk.security`'s."""
    hosts, root, query = parse_zk_uri(connect)
    merged: dict[str, Any] = {**query, **dict(options or {})}
    unknown = sorted(set(merged) - set(OPTION_KEYS))
    if unknown:
        raise ConfigError(
            f"unknown zk coordination option(s) {', '.join(unknown)}; valid: "
            f"{', '.join(OPTION_KEYS)}",
            key=f"coordination.{unknown[0]}",
        )
    return ZooKeeperCoordination(
        hosts,
        root,
        session_timeout=_float_option(merged, "session_timeout", DEFAULT_SESSION_TIMEOUT),
        connect_timeout=_float_option(merged, "connect_timeout", DEFAULT_CONNECT_TIMEOUT),
        security=ZkSecurity.from_options(merged),
    )


def _translate(exc: BaseException, what: str) -> BaseException:
    """A kazoo exception as the Waltz error of the contract."""
    if isinstance(exc, kz.NodeExistsError):
        return NodeExistsError(f"{what}: the path already exists")
    if isinstance(exc, kz.NoNodeError):
        return NoNodeError(f"{what}: the path (or its parent) does not exist")
    if isinstance(exc, kz.BadVersionError):
        return BadVersionError(
            f"{what}: the version changed (someone else wrote it); re-read and decide again"
        )
    if isinstance(exc, kz.NotEmptyError):
        return NotEmptyError(f"{what}: the path has children; delete them or use recursive")
    if isinstance(exc, kz.NoChildrenForEphemeralsError):
        return CoordinationError(f"{what}: an ephemeral entry can have no children")
    if isinstance(exc, kz.SessionExpiredError):
        return SessionLostError(f"{what}: the ZooKeeper session expired; start a new client")
    if isinstance(exc, kz.NoAuthError):
        return CoordinationError(
            f"{what}: ZooKeeper refused it (the znode's ACL does not allow this client's "
            "identity): use the cluster's coordination username and password "
            "(auth, username, password_file)"
        )
    if isinstance(exc, kz.AuthFailedError):
        return AuthenticationError(
            f"{what}: ZooKeeper refused this client's login (auth failed): check the "
            "coordination username and password"
        )
    unreachable = (
        kz.ConnectionLoss,
        kz.ConnectionClosedError,
        kz.OperationTimeoutError,
        KazooTimeoutError,
    )
    if isinstance(exc, unreachable):
        return CoordinationUnavailableError(
            f"{what}: ZooKeeper unreachable ({type(exc).__name__}); for a write the outcome "
            "is unknown: re-read before deciding"
        )
    if isinstance(exc, kz.KazooException):
        return CoordinationError(f"{what}: ZooKeeper error {type(exc).__name__}: {exc}")
    return exc


class _ChildrenWatcher:
    """Keeps a children list current: re-arms a ZooKeeper watch after every event.

    Runs in kazoo's threads. While the path is absent an exists-watch waits
    for it; every refresh re-reads, so the last state is always delivered."""

    def __init__(self, client: KazooClient, path: str, push: Callable[[list[str]], None]) -> None:
        self._client = client
        self._path = path
        self._push = push
        self._lock = threading.Lock()
        self.stopped = False

    def refresh(self, event: object = None) -> None:
        with self._lock:
            for _ in range(MAX_CHILDREN_REFRESH_ATTEMPTS):
                if self.stopped:
                    return
                try:
                    children = self._client.retry(
                        self._client.get_children, self._path, watch=self.refresh
                    )
                except kz.NoNodeError:
                    try:
                        stat = self._client.retry(
                            self._client.exists, self._path, watch=self.refresh
                        )
                    except kz.KazooException as exc:
                        self._give_up(exc)
                        return
                    if stat is not None:
                        continue  # created between the two reads: read its children
                    children = []
                except kz.KazooException as exc:
                    self._give_up(exc)
                    return
                self._push(sorted(children))
                return
            log.error("children watch on %s gave up: the path kept flapping", self._path)

    def _give_up(self, exc: BaseException) -> None:
        if not self.stopped:
            log.warning("children watch on %s stopped: %s", self._path, _translate(exc, "watch"))


class ZooKeeperCoordination(TrackedSessionCoordination):
    """A Coordination client on a ZooKeeper ensemble, rooted at ``root``."""

    def __init__(
        self,
        hosts: str,
        root: str = DEFAULT_ROOT,
        *,
        session_timeout: float = DEFAULT_SESSION_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        operation_timeout: float | None = None,
        security: ZkSecurity | None = None,
    ) -> None:
        self.hosts = hosts
        self.security = security or ZkSecurity()
        self.root = join_path(root)
        self.session_timeout = session_timeout
        self.connect_timeout = connect_timeout
        # Long enough to ride out a SUSPENDED period that ends before the session expires.
        self.operation_timeout = operation_timeout or (session_timeout + connect_timeout)
        self._client: KazooClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tracker: SessionStateTracker | None = None
        self._session_id = 0
        self._closed = False
        self._watches: set[DeliveryWatch] = set()
        self._stop_task: asyncio.Future[None] | None = None
        self._suspension_timer: asyncio.TimerHandle | None = None

    # -- plumbing -----------------------------------------------------------------------

    @property
    def kazoo_client(self) -> KazooClient:
        """The underlying kazoo client (tests and tools; not part of the contract)."""
        if self._client is None:
            raise CoordinationError("the ZooKeeper client is not started; await start()")
        return self._client

    def _full(self, path: str) -> str:
        return rooted_path(self.root, path)

    def _check(self) -> KazooClient:
        if self._closed:
            raise CoordinationError("this coordination client is closed; start a new one")
        if self._client is None or self._tracker is None:
            raise CoordinationError("this coordination client is not started; await start()")
        if self._tracker.lost:
            raise SessionLostError(
                f"the ZooKeeper session {self._session_id:#x} was lost; start a new client"
            )
        return self._client

    async def _call(self, what: str, start: Callable[[], Any]) -> Any:
        """Run one kazoo ``*_async`` call and await its result on this loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def transfer(outcome: tuple[bool, Any]) -> None:
            if future.done():
                return
            ok, payload = outcome
            if ok:
                future.set_result(payload)
            else:
                future.set_exception(payload)

        def on_done(result: Any) -> None:  # in a kazoo thread
            try:
                outcome: tuple[bool, Any] = (True, result.get_nowait())
            except BaseException as exc:  # handed to the awaiting coroutine
                outcome = (False, exc)
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(transfer, outcome)

        try:
            start().rawlink(on_done)
            return await asyncio.wait_for(future, self.operation_timeout)
        except TimeoutError:
            self._raise_if_lost()
            raise CoordinationUnavailableError(
                f"{what}: no answer from ZooKeeper ({self.hosts}) within "
                f"{self.operation_timeout:.0f}s; for a write the outcome is unknown"
            ) from None
        except (kz.KazooException, KazooTimeoutError) as exc:
            if isinstance(exc, kz.SessionExpiredError | kz.ConnectionClosedError):
                self._raise_if_lost()
            raise _translate(exc, what) from exc

    def _raise_if_lost(self) -> None:
        if self._tracker is not None and self._tracker.lost:
            raise SessionLostError(
                f"the ZooKeeper session {self._session_id:#x} was lost; start a new client"
            )

    async def _read(self, what: str, start: Callable[[], Any]) -> Any:
        """A read: retried while the connection is merely suspended (bounded)."""
        deadline = time.monotonic() + self.operation_timeout
        while True:
            try:
                return await self._call(what, start)
            except CoordinationUnavailableError:
                self._raise_if_lost()
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, fn)

    # -- session ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._client is not None:
            return
        if self._closed:
            raise CoordinationError("this coordination client is closed; start a new one")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._tracker = SessionStateTracker(loop)
        # kazoo would wait the whole session timeout for a handshake that is never
        # answered: the handshake module bounds it (see its docstring)
        client = bounded_kazoo_client(
            hosts=self.hosts,
            timeout=self.session_timeout,
            connection_retry={"max_tries": -1, "delay": 0.1, "backoff": 2, "max_delay": 1.0},
            command_retry={
                "max_tries": 50,
                "delay": 0.1,
                "backoff": 2,
                "max_delay": 1.0,
                "ignore_expire": False,
            },
            **self.security.kazoo_options(),
        )
        client.add_listener(self._on_kazoo_state)
        try:
            await self._in_thread(functools.partial(_start, client, self.connect_timeout))
        except (KazooTimeoutError, kz.KazooException, OSError) as exc:
            # kazoo's connection thread may sit in a connect handshake a host does not
            # answer (a few seconds, see handshake): its stop is left to finish in the
            # background
            await _in_daemon_thread(functools.partial(_stop_quietly, client), STOP_WAIT)
            self._tracker.close()
            self._tracker = None
            if isinstance(exc, kz.AuthFailedError):
                raise _translate(exc, f"connect to ZooKeeper at {self.hosts}") from exc
            wait = min(DIAGNOSE_TIMEOUT, self.connect_timeout)
            hint = await _in_daemon_thread(functools.partial(self._diagnose, wait), wait + 0.5)
            if hint is None:
                hint = f"is it running? (no answer within {wait:g}s)"
            raise CoordinationUnavailableError(
                f"could not connect to ZooKeeper at {self.hosts} within "
                f"{self.connect_timeout:.0f}s ({type(exc).__name__}); {hint}"
            ) from exc
        self._client = client
        self._session_id = int(client.client_id[0])
        if self.root != "/":
            with contextlib.suppress(NodeExistsError):
                await self._call(
                    f"create root {self.root}",
                    lambda: client.create_async(self.root, b"", makepath=True),
                )
        if self.security.acl != "open":
            await self._check_root_acl(client)
        log.debug("ZooKeeper session %#x open on %s%s", self._session_id, self.hosts, self.root)

    async def _check_root_acl(self, client: KazooClient) -> None:
        """Warn when the root znode (made before the cluster was secured) lets anyone
        write: znodes created from now on get the ACL, older ones keep theirs."""
        try:
            acls, _ = await self._read(
                f"read the ACL of {self.root}", lambda: client.get_acls_async(self.root)
            )
        except CoordinationError as exc:
            log.warning("could not read the ACL of %s: %s", self.root, exc)
            return
        for acl in acls:
            if acl.id.scheme == "world" and acl.perms & ~1:  # more than READ
                log.warning(
                    "the ZooKeeper root %s lets anyone change it (%s): it was created before "
                    "auth was configured; restrict it and everything below it (zkCli: "
                    "setAcl -R %s digest:USER:HASH:cdrwa,world:anyone:r)",
                    self.root,
                    ",".join(acl.acl_list),
                    self.root,
                )
                return

    def _diagnose(self, timeout: float = DIAGNOSE_TIMEOUT) -> str:
        """Why a connection failed, as far as one TLS handshake with the first host tells
        within ``timeout`` seconds (blocking: run it in a thread)."""
        host, _, port = self.hosts.split(",")[0].rpartition(":")
        host = host.strip("[]")
        tls = self.security.tls
        context = tls.context() if tls is not None else ssl.create_default_context()
        if tls is None:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        try:
            with (
                socket.create_connection((host, int(port)), timeout=timeout) as raw,
                context.wrap_socket(raw, server_hostname=host) as wrapped,
            ):
                wrapped.sendall(b"ruok")
                wrapped.recv(16)
        except ssl.SSLError as exc:
            if tls is None:
                if "WRONG_VERSION_NUMBER" in str(exc) or "record layer" in str(exc):
                    return "is it running?"
                return (
                    "the port speaks TLS: set tls=true and tls_ca (and tls_cert/tls_key if it "
                    "requires client certificates)"
                )
            return (
                f"the TLS handshake failed ({exc.reason or exc}): check tls_ca (the CA of the "
                "server's certificate), tls_cert/tls_key (a client certificate the server "
                "trusts) and that the port is ZooKeeper's secureClientPort"
            )
        except OSError as exc:
            return f"is it running? ({exc})"
        if tls is None:
            return (
                "the port speaks TLS: set tls=true and tls_ca (and tls_cert/tls_key if it "
                "requires client certificates)"
            )
        return "the TLS handshake works; is the ensemble serving (a quorum up)?"

    def _on_kazoo_state(self, state: str) -> None:
        """kazoo's listener (its connection thread): must not block."""
        tracker, loop = self._tracker, self._loop
        if tracker is None or loop is None or self._closed:
            return
        if state == KazooState.SUSPENDED:
            if tracker.set_state(SessionState.SUSPENDED):
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._arm_suspension_timer)
        elif state == KazooState.CONNECTED:
            client = self._client
            if client is not None and int(client.client_id[0]) != self._session_id:
                # kazoo silently opened a new session: ours is gone.
                self._mark_lost(loop, tracker)
            elif tracker.set_state(SessionState.CONNECTED):
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(self._disarm_suspension_timer)
        elif state == KazooState.LOST:
            self._mark_lost(loop, tracker)

    def _mark_lost(self, loop: asyncio.AbstractEventLoop, tracker: SessionStateTracker) -> None:
        if tracker.set_state(SessionState.LOST):
            log.warning("ZooKeeper session %#x lost", self._session_id)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._after_loss)

    def _arm_suspension_timer(self) -> None:
        """SUSPENDED for longer than the session timeout counts as LOST: the server
        has expired the session, or will as soon as it hears from us."""
        if self._suspension_timer is not None or self._loop is None:
            return
        self._suspension_timer = self._loop.call_later(
            self.session_timeout, self._suspension_expired
        )

    def _suspension_expired(self) -> None:
        self._suspension_timer = None
        tracker, loop = self._tracker, self._loop
        if tracker is None or loop is None or self._closed:
            return
        if tracker.state is SessionState.SUSPENDED:
            log.warning(
                "ZooKeeper session %#x: suspended for longer than the session timeout "
                "(%.1fs); treating it as lost",
                self._session_id,
                self.session_timeout,
            )
            self._mark_lost(loop, tracker)

    def _disarm_suspension_timer(self) -> None:
        if self._suspension_timer is not None:
            self._suspension_timer.cancel()
            self._suspension_timer = None

    def _after_loss(self) -> None:
        self._disarm_suspension_timer()
        for watch in list(self._watches):
            watch.cancel()
        client = self._client
        if client is not None and self._loop is not None and self._stop_task is None:
            # Stop kazoo, or it would reconnect with a new session behind our back.
            self._stop_task = self._loop.run_in_executor(
                None, functools.partial(_stop_quietly, client)
            )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._disarm_suspension_timer()
        for watch in list(self._watches):
            watch.cancel()
        if self._tracker is not None:
            self._tracker.close()
        client = self._client
        if client is not None:
            if self._stop_task is not None:
                with contextlib.suppress(Exception):
                    await self._stop_task
            await self._in_thread(functools.partial(_stop_quietly, client))

    # -- operations -------------------------------------------------------------------------

    async def get(self, path: str) -> Versioned | None:
        client = self._check()
        full = self._full(path)
        try:
            data, stat = await self._read(f"get {path}", lambda: client.get_async(full))
        except NoNodeError:
            return None
        return Versioned(bytes(data or b""), int(stat.version))

    async def exists(self, path: str) -> bool:
        client = self._check()
        full = self._full(path)
        stat = await self._read(f"exists {path}", lambda: client.exists_async(full))
        return stat is not None

    async def create(
        self, path: str, value: bytes = b"", *, ephemeral: bool = False, make_parents: bool = True
    ) -> int:
        client = self._check()
        full = self._full(path)
        _created, stat = await self._call(
            f"create {path}",
            lambda: client.create_async(
                full, bytes(value), ephemeral=ephemeral, makepath=make_parents, include_data=True
            ),
        )
        return int(stat.version)

    async def set(self, path: str, value: bytes, *, expected_version: int | None = None) -> int:
        client = self._check()
        full = self._full(path)
        version = -1 if expected_version is None else int(expected_version)
        if expected_version is not None and version < 0:
            raise BadVersionError(f"set {path}: no version is {expected_version}")
        stat = await self._call(
            f"set {path}", lambda: client.set_async(full, bytes(value), version=version)
        )
        return int(stat.version)

    async def delete(
        self, path: str, *, expected_version: int | None = None, recursive: bool = False
    ) -> None:
        client = self._check()
        full = self._full(path)
        if full == "/":
            raise CoordinationError("the ZooKeeper root cannot be deleted")
        version = -1 if expected_version is None else int(expected_version)
        for _ in range(MAX_RECURSIVE_DELETE_ATTEMPTS):
            if recursive:
                for child in await self.children(path):
                    await self._delete_tree(client, join_path(full, child))
            try:
                await self._call(
                    f"delete {path}", lambda: client.delete_async(full, version=version)
                )
                return
            except NoNodeError:
                if expected_version is not None:
                    raise
                return
            except NotEmptyError:
                if not recursive:
                    raise
                # A child appeared while deleting the subtree: go again.
        raise CoordinationError(
            f"delete {path}: children kept appearing while deleting the subtree"
        )

    async def _delete_tree(self, client: KazooClient, full: str) -> None:
        for _ in range(MAX_RECURSIVE_DELETE_ATTEMPTS):
            try:
                children = await self._read(
                    f"children {full}", lambda: client.get_children_async(full)
                )
            except NoNodeError:
                return
            for child in children:
                await self._delete_tree(client, join_path(full, child))
            try:
                await self._call(f"delete {full}", lambda: client.delete_async(full))
                return
            except NoNodeError:
                return
            except NotEmptyError:
                continue
        raise CoordinationError(f"delete {full}: children kept appearing")

    async def children(self, path: str) -> list[str]:
        client = self._check()
        full = self._full(path)
        try:
            names = await self._read(f"children {path}", lambda: client.get_children_async(full))
        except NoNodeError:
            return []
        return sorted(names)

    async def increment(self, path: str) -> int:
        client = self._check()
        full = self._full(path)
        for _ in range(3):
            try:
                stat = await self._call(
                    f"increment {path}", lambda: client.set_async(full, b"", version=-1)
                )
                return int(stat.version)
            except NoNodeError:
                with contextlib.suppress(NodeExistsError):
                    await self._call(
                        f"create counter {path}",
                        lambda: client.create_async(full, b"", makepath=True),
                    )
        raise CoordinationError(f"increment {path}: the counter znode keeps disappearing")

    # -- watches ------------------------------------------------------------------------------

    async def watch(self, path: str, callback: DataCallback) -> Watch:
        client = self._check()
        full = self._full(path)
        delivery: LoopDelivery[Versioned | None] = LoopDelivery(
            asyncio.get_running_loop(), callback, name=f"watch {path}"
        )

        def on_data(data: bytes | None, stat: Any) -> bool | None:  # in a kazoo thread
            if delivery.stopped:
                return False  # tells kazoo to stop watching
            delivery.push(None if stat is None else Versioned(bytes(data or b""), stat.version))
            return None

        try:
            await self._in_thread(lambda: DataWatch(client, full, on_data))
        except kz.KazooException as exc:
            delivery.stop()
            raise _translate(exc, f"watch {path}") from exc
        return self._track(DeliveryWatch(delivery))

    async def watch_children(self, path: str, callback: ChildrenCallback) -> Watch:
        client = self._check()
        full = self._full(path)
        delivery: LoopDelivery[list[str]] = LoopDelivery(
            asyncio.get_running_loop(), callback, name=f"children watch {path}"
        )
        watcher = _ChildrenWatcher(client, full, delivery.push)

        def stop() -> None:
            watcher.stopped = True

        await self._in_thread(watcher.refresh)
        return self._track(DeliveryWatch(delivery, stop))

    def _track(self, watch: DeliveryWatch) -> DeliveryWatch:
        self._watches.add(watch)
        return watch


def _start(client: KazooClient, timeout: float) -> None:
    """``client.start(timeout)`` but for its stop on a time-out (kazoo's waits for its
    connection thread, which may read from a host that does not answer for the whole
    session timeout): the caller stops it (:func:`_in_daemon_thread`)."""
    client.start_async().wait(timeout=timeout)
    if not client.connected:
        raise KazooTimeoutError("Connection time-out")


async def _in_daemon_thread(fn: Callable[[], T], wait: float) -> T | None:
    """``fn()`` in a daemon thread, awaited at most ``wait`` seconds (None past it: the
    thread finishes in the background, and never holds up the process's exit as an
    executor's thread would)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not done.done():
            outcome()

    def work() -> None:
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, lambda: done.set_exception(error))
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, lambda: done.set_result(result))

    threading.Thread(target=work, name="waltz-zk-background", daemon=True).start()
    try:
        async with asyncio.timeout(wait):
            return await asyncio.shield(done)
    except TimeoutError:
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        return None


def _stop_quietly(client: KazooClient) -> None:
    try:
        client.stop()
        client.close()
    except Exception:  # stopping a broken client must not raise on the way out
        log.debug("stopping a kazoo client failed", exc_info=True)
