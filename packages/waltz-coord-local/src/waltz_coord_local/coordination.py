"""The Coordination contract, embedded: a SQLite file shared by the processes of one machine.

Each client owns one SQLite connection for its reads, used by one worker thread
(every blocking call runs there, off the event loop), a store in the writer
process of its file for its writes (:mod:`waltz_coord_local.writer`: a stopped
client process holds no write lock), a session row it heartbeats
every ``session_timeout / 3`` (at most every 2 s), and one poll loop for all of
its watches, which reads the global change log every ``poll_interval``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import urllib.parse
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from waltz_api.contracts.coordination import (
    ChildrenCallback,
    Coordination,
    DataCallback,
    SessionListener,
    SessionState,
    Versioned,
    Watch,
)
from waltz_api.coordination_support import Notifier, SessionStateTracker, check_path, seconds_option
from waltz_api.errors import (
    BadVersionError,
    ClusterNotFoundError,
    ConfigError,
    CoordinationError,
    CoordinationUnavailableError,
    NodeExistsError,
    SessionLostError,
)
from waltz_coord_local.store import LocalStore, NodeState, PollResult, SessionGone
from waltz_coord_local.writer import WriterClient

log = logging.getLogger(__name__)

# The clients of each database file in this process: a write wakes their watch
# polls at once (other processes see it at their next poll).
_clients_by_file: dict[Path, weakref.WeakSet[LocalCoordination]] = {}
_clients_lock = threading.Lock()

T = TypeVar("T")

DB_FILE_NAME = "coordination.sqlite3"
DB_SUFFIXES = (".db", ".sqlite", ".sqlite3")
DEFAULT_SESSION_TIMEOUT = 10.0
DEFAULT_POLL_INTERVAL = 0.02
DEFAULT_BUSY_TIMEOUT = 10.0


def parse_location(connect: str | Path, *, create: bool = True) -> tuple[Path, str | None]:
    """The database file and the root named by ``local:///dir?root=/waltz``.

    The location is ``local:///path`` (or a plain path): a directory (existing,
    or a path without a .db/.sqlite/.sqlite3 suffix) holds
    ``coordination.sqlite3`` and is created when missing; otherwise it is the
    database file itself. The optional ``root`` query parameter is the path
    prefix of the client (the ``root`` option wins over it). Without ``create``, a
    database file that does not exist is refused (ClusterNotFoundError, naming it)
    and nothing is created: a client that joins a cluster, where a mistyped path
    would otherwise make an empty one."""
    text = str(connect).strip()
    root: str | None = None
    if text.startswith("local:"):
        text = text[len("local://") :] if text.startswith("local://") else text[len("local:") :]
        text, _, query = text.partition("?")
        for name, values in urllib.parse.parse_qs(query, keep_blank_values=True).items():
            if name != "root":
                raise ConfigError(
                    f"unknown parameter {name!r} in {connect!r}; the only one is root "
                    "(local:///path/to/dir?root=/waltz)",
                    key="coordination.connect",
                )
            root = values[-1]
    elif "://" in text:
        raise ConfigError(
            f"local coordination location {connect!r} has the wrong scheme; use "
            "local:///path/to/dir (or a plain path)",
            key="coordination.connect",
        )
    if not text:
        raise ConfigError(
            "the local coordination location is empty; use local:///path/to/dir",
            key="coordination.connect",
        )
    path = Path(text).expanduser()
    if path.is_dir() or (not path.exists() and path.suffix not in DB_SUFFIXES):
        directory, file = path, path / DB_FILE_NAME
    else:
        directory, file = path.parent, path
    if not create and not file.is_file():
        missing = file if directory.is_dir() else directory
        raise ClusterNotFoundError(
            f"no Waltz cluster at {connect}: {missing} does not exist (a mistyped path? "
            "`waltz dev` makes a cluster there, `waltz cluster create` a new one)"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the local coordination directory {directory}: {exc}",
            key="coordination.connect",
        ) from exc
    return file.resolve(), root


def resolve_location(connect: str | Path) -> Path:
    """The database file of a ``local`` location (see :func:`parse_location`)."""
    return parse_location(connect)[0]


def _normalise_root(root: Any) -> str:
    if not isinstance(root, str) or not root.startswith("/"):
        raise ConfigError(
            f"coordination option root must be an absolute path like /waltz, got {root!r}",
            key="coordination.root",
        )
    return "".join("/" + s for s in root.split("/") if s)


class _LocalWatch(Watch):
    def __init__(self, owner: LocalCoordination, kind: str, full_path: str) -> None:
        self.owner = owner
        self.kind = kind
        self.full_path = full_path
        self.notifier: Notifier[Any] | None = None

    def cancel(self) -> None:
        if self.notifier is not None:
            self.notifier.close()
        self.owner._watches.discard(self)


class LocalCoordination(Coordination):
    """A client of the embedded coordination service in a SQLite file.

    Options: ``root`` (the path prefix of this client; default the URI's
    ``?root=`` or ``/``),
    ``session_timeout`` (seconds without a heartbeat after which the session
    and its ephemeral entries expire; default 10), ``poll_interval`` (seconds
    between two reads of the change log while watches exist; default 0.02),
    ``busy_timeout`` (seconds to wait for another process's write lock;
    default 10), ``create`` (make the directory and the database when missing;
    default true; false refuses a location that does not exist, naming it).
    """

    def __init__(self, connect: str | Path, options: Mapping[str, Any] | None = None) -> None:
        options = dict(options or {})
        create = options.get("create", True)
        if not isinstance(create, bool):
            raise ConfigError(
                f"coordination option create must be true or false, got {create!r}",
                key="coordination.create",
            )
        self.db_path, uri_root = parse_location(connect, create=create)
        self._top = _normalise_root(options.get("root", uri_root or "/"))
        self._session_timeout = seconds_option(options, "session_timeout", DEFAULT_SESSION_TIMEOUT)
        self._poll_interval = seconds_option(options, "poll_interval", DEFAULT_POLL_INTERVAL)
        self._busy_timeout = seconds_option(options, "busy_timeout", DEFAULT_BUSY_TIMEOUT)
        self._executor: ThreadPoolExecutor | None = None
        self._store: LocalStore | None = None  # reads, in this process
        self._writer: WriterClient | None = None  # writes, in the writer process
        # Not started yet: LOST until the session begins; listeners are called inline.
        self._session = SessionStateTracker(
            None,
            SessionState.LOST,
            inline=True,
            describe=lambda: f"local session {self._session_id}",
        )
        self._session_id = 0
        self._started = False
        self._closing = False
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._poll_task: asyncio.Task[None] | None = None
        self._poll_seq: int | None = None
        self._watches: set[_LocalWatch] = set()
        self._last_heartbeat = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    # -- plumbing ---------------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._executor is None:
            raise CoordinationError("the local coordination client is not started")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._executor, functools.partial(fn, *args, **kwargs)
            )
        except SessionGone as exc:
            self._lose_session("another process found it expired")
            raise SessionLostError(
                f"the local coordination session {self._session_id} expired and its "
                "ephemeral entries are gone; close this client and start a new one"
            ) from exc

    async def _write(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run the store write ``name`` in this client's writer process."""
        writer = self._writer
        if writer is None:
            raise CoordinationError("the local coordination client is not started")
        return await self._run(writer.call, name, *args, **kwargs)

    def _written(self) -> None:
        """Wake the watch polls of this process's clients of the same file."""
        with _clients_lock:
            peers = list(_clients_by_file.get(self.db_path, ()))
        for peer in peers:
            if peer._watches and peer._loop is not None and peer._wake is not None:
                with contextlib.suppress(RuntimeError):  # its loop is closed
                    peer._loop.call_soon_threadsafe(peer._wake.set)

    def _full(self, path: str) -> str:
        check_path(path)
        if path == "/":
            return self._top or "/"
        return self._top + path

    def _store_or_raise(self) -> LocalStore:
        if not self._started or self._closing or self._store is None:
            raise CoordinationError(
                "the local coordination client is not started or was closed; start a new one"
            )
        if self._session.state is SessionState.LOST:
            raise SessionLostError(
                f"the local coordination session {self._session_id} was lost and its "
                "ephemeral entries are gone; close this client and start a new one"
            )
        return self._store

    # -- session ------------------------------------------------------------------------

    async def start(self) -> None:
        if self._closing:
            raise CoordinationError("this local coordination client was closed; start a new one")
        if self._started:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="waltz-local-coord")
        try:
            # The writer first: it creates the database and its schema.
            self._writer = await self._run(
                WriterClient, self.db_path, busy_timeout=self._busy_timeout
            )
            self._store = await self._run(LocalStore, self.db_path, busy_timeout=self._busy_timeout)
            self._store.reap_expired = functools.partial(self._writer.call, "reap")
            self._session_id = await self._write("open_session", self._session_timeout)
            self._store.session_id = self._session_id
        except BaseException:
            for closing in (self._store, self._writer):
                if closing is not None:
                    with contextlib.suppress(Exception):
                        await self._run(closing.close)
            self._executor.shutdown(wait=False)
            self._executor = None
            raise
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._wake = asyncio.Event()
        with _clients_lock:
            _clients_by_file.setdefault(self.db_path, weakref.WeakSet()).add(self)
        self._last_heartbeat = loop.time()
        self._started = True
        self._session.set_state(SessionState.CONNECTED)
        self._heartbeat_task = loop.create_task(
            self._heartbeat_loop(), name="waltz-local-coord-heartbeat"
        )
        log.info(
            "local coordination session %d opened on %s (timeout %.1fs)",
            self._session_id,
            self.db_path,
            self._session_timeout,
        )

    async def close(self) -> None:
        if self._closing or not self._started:
            self._closing = True
            return
        self._closing = True
        with _clients_lock:
            _clients_by_file.get(self.db_path, weakref.WeakSet()).discard(self)
        for task in (self._heartbeat_task, self._poll_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for watch in list(self._watches):
            watch.cancel()
            if watch.notifier is not None:
                await watch.notifier.wait_closed()
        store = self._store
        if store is not None:
            if self._session.state is not SessionState.LOST:
                try:
                    await self._write("end_session")
                    self._written()
                except CoordinationError as exc:
                    log.warning(
                        "could not end local session %d on close (%s); its ephemeral entries "
                        "expire within %.1fs",
                        self._session_id,
                        exc,
                        self._session_timeout,
                    )
            with contextlib.suppress(Exception):
                await self._run(store.close)
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await self._run(self._writer.close)
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        self._session.close(final=SessionState.LOST)  # closed on purpose: no notification

    @property
    def session_state(self) -> SessionState:
        return self._session.state

    @property
    def session_id(self) -> int:
        return self._session_id

    def add_session_listener(self, listener: SessionListener) -> None:
        self._session.add_listener(listener)

    def _lose_session(self, reason: str) -> None:
        if self._closing or self._session.state is SessionState.LOST:
            return
        log.warning(
            "local coordination session %d is lost (%s); its ephemeral entries are gone",
            self._session_id,
            reason,
        )
        self._session.set_state(SessionState.LOST)
        for watch in list(self._watches):
            watch.cancel()

    async def _heartbeat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        interval = min(self._session_timeout / 3, 2.0)
        while not self._closing and self._session.state is not SessionState.LOST:
            await asyncio.sleep(interval)
            store = self._store
            if store is None:
                return
            sent = loop.time()
            try:
                alive = await self._write("heartbeat", self._session_timeout)
            except Exception as exc:  # any failure to heartbeat counts, never ends the loop
                log.warning("local coordination heartbeat failed: %s", exc)
                if self._session.state is SessionState.CONNECTED:
                    self._session.set_state(SessionState.SUSPENDED)
                if loop.time() - self._last_heartbeat > self._session_timeout:
                    self._lose_session("no heartbeat for longer than the session timeout")
                continue
            if not alive:
                self._lose_session("it expired before this heartbeat")
                return
            self._last_heartbeat = sent
            self._session.set_state(SessionState.CONNECTED)

    # -- operations ---------------------------------------------------------------------

    async def get(self, path: str) -> Versioned | None:
        store = self._store_or_raise()
        if check_path(path) == "/":
            return None
        state = await self._run(store.get, self._full(path))
        return _versioned(state)

    async def create(
        self, path: str, value: bytes = b"", *, ephemeral: bool = False, make_parents: bool = True
    ) -> int:
        self._store_or_raise()
        if check_path(path) == "/":
            raise NodeExistsError("the root always exists")
        version = await self._write(
            "create",
            self._full(path),
            bytes(value),
            ephemeral=ephemeral,
            make_parents=make_parents,
            top=self._top,
        )
        self._written()
        return int(version)

    async def set(self, path: str, value: bytes, *, expected_version: int | None = None) -> int:
        self._store_or_raise()
        if check_path(path) == "/":
            raise CoordinationError("the root holds no value; set a path below it")
        version, current = await self._write(
            "set", self._full(path), bytes(value), expected_version
        )
        self._written()
        if current is not None:
            raise BadVersionError(
                f"compare-and-set of {path!r} lost: expected version {expected_version}, "
                f"current version {current}; read it again"
            )
        return int(version)

    async def delete(
        self, path: str, *, expected_version: int | None = None, recursive: bool = False
    ) -> None:
        self._store_or_raise()
        if check_path(path) == "/":
            raise CoordinationError("the root cannot be deleted; delete the paths below it")
        current = await self._write("delete", self._full(path), expected_version, recursive)
        self._written()
        if current is not None:
            raise BadVersionError(
                f"versioned delete of {path!r} lost: expected version {expected_version}, "
                f"current version {current}"
            )

    async def children(self, path: str) -> list[str]:
        store = self._store_or_raise()
        return await self._run(store.children, self._full(path))

    async def increment(self, path: str) -> int:
        self._store_or_raise()
        if check_path(path) == "/":
            raise CoordinationError("the root cannot be a counter")
        value = await self._write("increment", self._full(path), self._top)
        self._written()
        return int(value)

    # -- watches ----------------------------------------------------------------------------

    async def watch(self, path: str, callback: DataCallback) -> Watch:
        store = self._store_or_raise()
        check_path(path)
        handle = _LocalWatch(self, "data", self._full(path))
        notifier: Notifier[Versioned | None] = Notifier(callback, f"data of {path}")
        handle.notifier = notifier
        if path == "/":  # the root never holds a value
            await notifier.deliver_initial(None, 0)
            return handle
        # Register before the initial read: a poll that runs in between offers
        # its (older or newer) state, which the notifier orders by sequence.
        self._register(handle)
        snapshot = await self._run(store.snapshot, [handle.full_path], [])
        await notifier.deliver_initial(_versioned(snapshot.data[handle.full_path]), snapshot.seq)
        return handle

    async def watch_children(self, path: str, callback: ChildrenCallback) -> Watch:
        store = self._store_or_raise()
        check_path(path)
        handle = _LocalWatch(self, "children", self._full(path))
        notifier: Notifier[list[str]] = Notifier(callback, f"children of {path}")
        handle.notifier = notifier
        self._register(handle)
        snapshot = await self._run(store.snapshot, [], [handle.full_path])
        await notifier.deliver_initial(snapshot.children[handle.full_path], snapshot.seq)
        return handle

    def _register(self, handle: _LocalWatch) -> None:
        self._watches.add(handle)
        if self._poll_task is None or self._poll_task.done():
            self._poll_seq = None  # the first poll reads every watched path
            self._poll_task = asyncio.get_running_loop().create_task(
                self._poll_loop(), name="waltz-local-coord-watches"
            )

    async def _poll_loop(self) -> None:
        """One loop per client serves all of its watches; it ends with the last watch."""
        while self._watches and not self._closing:
            assert self._wake is not None
            try:
                async with asyncio.timeout(self._poll_interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            store = self._store
            if store is None or self._session.state is SessionState.LOST:
                return
            watches = list(self._watches)
            data = {w.full_path for w in watches if w.kind == "data"}
            children = {w.full_path for w in watches if w.kind == "children"}
            try:
                result: PollResult = await self._run(store.poll, self._poll_seq, data, children)
            except CoordinationUnavailableError as exc:
                log.debug("watch poll failed, retrying: %s", exc)
                continue
            except Exception:  # never let the watches die silently: log, then poll again
                log.exception("watch poll failed")
                continue
            self._poll_seq = result.seq
            for watch in watches:
                if watch.notifier is None:
                    continue
                if watch.kind == "data" and watch.full_path in result.data:
                    watch.notifier.offer(_versioned(result.data[watch.full_path]), result.seq)
                elif watch.kind == "children" and watch.full_path in result.children:
                    watch.notifier.offer(result.children[watch.full_path], result.seq)

    # -- administration -----------------------------------------------------------------

    async def expire_session_of(self, session_id: int) -> int:
        """Expire another session now, as if it had stopped heartbeating (tests,
        operators); returns how many ephemeral entries went with it."""
        self._store_or_raise()
        count = await self._write("expire_session", session_id)
        self._written()
        return int(count)


def _versioned(state: NodeState | None) -> Versioned | None:
    return None if state is None else Versioned(state.value, state.version)
