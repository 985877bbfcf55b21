"""The writer process: the only holder of SQLite's write lock for a process's clients.

A client's own process never writes to the database. Every write transaction
(opening, heartbeating and ending a session, create, set, delete, increment,
reaping expired sessions) runs in a small child process, one per database file
per client process, reached over a pair of pipes. A client process stopped in
the middle of a write (SIGSTOP, a debugger, a long pause of the machine's
scheduler for that process) therefore holds no lock while it is stopped: its
writer finishes the transaction, and every other process of the machine goes
on. Before, a process stopped inside ``BEGIN IMMEDIATE`` held the lock for its
whole pause, every other process waited, and the sessions of all of them
expired together.

Reads stay in the client's process: a WAL reader blocks no writer, stopped or
not.

The writer process exits when its request pipe closes: all the clients of that
file closed, or the client process died. It starts in its own session, so a
Ctrl-C or a signal to the client's process group does not cut a transaction
short; the client's close ends it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import waltz_api
from waltz_api.errors import (
    CoordinationError,
    CoordinationUnavailableError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    WaltzError,
)
from waltz_coord_local.store import LocalStore, SessionGone

log = logging.getLogger(__name__)
store_log = logging.getLogger("waltz_coord_local.store")

WRITES = frozenset(
    {
        "open_session",
        "heartbeat",
        "end_session",
        "expire_session",
        "create",
        "set",
        "delete",
        "increment",
        "reap",
    }
)
"""The store methods a client asks its writer for (everything that writes)."""

_ERRORS: dict[str, type[CoordinationError]] = {
    cls.__name__: cls
    for cls in (
        CoordinationError,
        CoordinationUnavailableError,
        NodeExistsError,
        NoNodeError,
        NotEmptyError,
        SessionGone,
    )
}
ANSWER_MARGIN = 10.0
"""Seconds a client waits for its writer beyond the SQLite busy timeout."""
EXIT_WAIT = 5.0


class WriterGone(CoordinationUnavailableError):
    """The writer process exited; the next request starts a new one."""


class WriterProcess:
    """The parent's end of one writer process (shared by the clients of one file)."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        self.users = 0
        self.dead = False
        self._lock = threading.Lock()
        self._seq = 0
        self._handles = 0
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        # This package's and waltz_api's source roots (this file's own, not the
        # package's __init__: importing the package here would close a circle).
        roots = [
            str(Path(__file__).resolve().parents[1]),
            str(Path(waltz_api.__file__ or "").resolve().parents[1]),
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*roots, *filter(None, [env.get("PYTHONPATH")])])
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(request_read), str(reply_write)],
                pass_fds=(request_read, reply_write),
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        except OSError as exc:
            os.close(request_write)
            os.close(reply_read)
            raise CoordinationError(
                f"cannot start the writer process of {db_path}: {exc}; check that "
                f"{sys.executable} can run"
            ) from exc
        finally:  # the child's ends: it has its own copies now
            os.close(request_read)
            os.close(reply_write)
        self._requests = Connection(request_write, readable=False)
        self._replies = Connection(reply_read, writable=False)
        # Closing the request pipe ends the writer, also when nobody closed this object.
        self._finalizer = weakref.finalize(self, _close_pipes, self._requests, self._replies)
        log.debug("writer process %d started for %s", self.process.pid, db_path)

    def new_handle(self) -> int:
        with self._lock:
            self._handles += 1
            return self._handles

    def call(
        self, handle: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, wait: float
    ) -> Any:
        """Run ``name`` on the writer's store ``handle``; its answer, or its error raised."""
        if not self._lock.acquire(timeout=wait):
            raise CoordinationUnavailableError(
                f"the writer process {self.process.pid} of {self.db_path} stayed busy for "
                f"{wait:.0f} s; retry, or look for a stopped writer process"
            )
        try:
            if self.dead:
                raise WriterGone(self._gone_message())
            self._seq += 1
            seq = self._seq
            try:
                self._requests.send((seq, handle, name, args, kwargs))
            except OSError as exc:
                self.dead = True
                raise WriterGone(self._gone_message()) from exc
            deadline = time.monotonic() + wait
            while True:
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0 or not self._replies.poll(remaining):
                        raise CoordinationUnavailableError(
                            f"the writer process {self.process.pid} of {self.db_path} did not "
                            f"answer {name} within {wait:.0f} s; its outcome is unknown: read "
                            "the path again (look for a stopped writer process)"
                        )
                    answer_seq, ok, payload, records = self._replies.recv()
                except (EOFError, OSError) as exc:
                    self.dead = True
                    raise WriterGone(self._gone_message()) from exc
                for level, message in records:
                    store_log.log(level, "%s", message)
                if answer_seq != seq:
                    continue  # the late answer to a request given up on
                if ok:
                    return payload
                kind, message = payload
                raise _ERRORS.get(kind, CoordinationError)(message)
        finally:
            self._lock.release()

    def _gone_message(self) -> str:
        code = self.process.poll()
        return (
            f"the writer process {self.process.pid} of {self.db_path} exited"
            f"{'' if code is None else f' (code {code})'}; the outcome of the request is "
            "unknown and the next one starts a new writer"
        )

    def close(self) -> None:
        """End the writer: it finishes the request it is running, then exits."""
        self.dead = True
        self._finalizer()
        try:
            self.process.wait(EXIT_WAIT)
        except subprocess.TimeoutExpired:
            log.warning(
                "writer process %d of %s did not exit within %.0f s of its close; killing it",
                self.process.pid,
                self.db_path,
                EXIT_WAIT,
            )
            self.process.kill()
            self.process.wait()


def _close_pipes(*connections: Connection) -> None:
    for connection in connections:
        with contextlib.suppress(OSError):
            connection.close()


_writers: dict[tuple[int, Path], WriterProcess] = {}
_writers_lock = threading.Lock()


class WriterClient:
    """One client's store in the writer process of its file (blocking; call from a thread)."""

    def __init__(self, db_path: Path, *, busy_timeout: float) -> None:
        self.db_path = db_path
        self.busy_timeout = busy_timeout
        self.session_id = 0
        self._writer: WriterProcess | None = None
        self._handle = 0
        self._connect()

    def _connect(self) -> None:
        key = (os.getpid(), self.db_path)
        with _writers_lock:
            writer = _writers.get(key)
            if writer is None or writer.dead:
                writer = _writers[key] = WriterProcess(self.db_path)
            writer.users += 1
        self._writer, self._handle = writer, writer.new_handle()
        try:
            self._call("open", str(self.db_path), self.busy_timeout, self.session_id)
        except BaseException:
            self._release()
            raise

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if name not in WRITES:
            raise CoordinationError(f"{name!r} is not a write of the local coordination store")
        if self._writer is None or self._writer.dead:
            self._release()
            self._connect()  # a new writer process, the same session
        result = self._call(name, *args, **kwargs)
        if name == "open_session":
            self.session_id = int(result)
        return result

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        assert self._writer is not None
        return self._writer.call(
            self._handle, name, args, kwargs, wait=self.busy_timeout + ANSWER_MARGIN
        )

    def close(self) -> None:
        if self._writer is not None and not self._writer.dead:
            with contextlib.suppress(CoordinationError):
                self._call("close")
        self._release()

    def _release(self) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        with _writers_lock:
            writer.users -= 1
            last = writer.users <= 0
            if last and _writers.get((os.getpid(), self.db_path)) is writer:
                del _writers[(os.getpid(), self.db_path)]
        if last:
            writer.close()


# -- the writer process -------------------------------------------------------------------


class _Records(logging.Handler):
    """The writer's log records, sent back with each answer (its stderr is nobody's)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))


def serve(requests: Connection, replies: Connection) -> None:
    """Answer requests until the request pipe closes."""
    records = _Records()
    store_logger = logging.getLogger("waltz_coord_local.store")
    store_logger.addHandler(records)
    store_logger.setLevel(logging.DEBUG)
    store_logger.propagate = False
    stores: dict[int, LocalStore] = {}
    try:
        while True:
            try:
                seq, handle, name, args, kwargs = requests.recv()
            except (EOFError, OSError):
                return
            ok, payload = True, None
            try:
                payload = _answer(stores, handle, name, args, kwargs)
            except WaltzError as exc:
                ok, payload = False, (type(exc).__name__, str(exc))
            except Exception as exc:  # a bug here must reach the client, not end the writer
                ok, payload = False, ("CoordinationError", f"the writer process failed: {exc!r}")
            try:
                replies.send((seq, ok, payload, records.records))
            except OSError:
                return
            records.records = []
    finally:
        for store in stores.values():
            with contextlib.suppress(Exception):
                store.close()


def _answer(
    stores: dict[int, LocalStore],
    handle: int,
    name: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    if name == "open":
        db_path, busy_timeout, session_id = args
        opened = LocalStore(Path(db_path), busy_timeout=busy_timeout)
        try:
            opened.setup()
        except BaseException:
            opened.close()
            raise
        opened.session_id = session_id
        stores[handle] = opened
        return None
    store = stores.get(handle)
    if store is None:
        raise CoordinationError(f"the writer has no store {handle}; open it first")
    if name == "close":
        del stores[handle]
        store.close()
        return None
    if name not in WRITES:
        raise CoordinationError(f"{name!r} is not a write the writer process runs")
    return getattr(store, name)(*args, **kwargs)


def main(argv: list[str]) -> None:
    requests = Connection(int(argv[1]), writable=False)
    replies = Connection(int(argv[2]), readable=False)
    serve(requests, replies)


if __name__ == "__main__":
    main(sys.argv)
