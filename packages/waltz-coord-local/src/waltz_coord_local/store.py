"""The SQLite store behind the ``local`` coordination plugin (blocking; one thread per client).

One database file (WAL mode, ``synchronous=FULL``) is shared by every process
on the machine that uses the same location:

- ``nodes``: one row per path (full path including the client's root), its
  parent, value, version and, for an ephemeral entry, the owning session;
- ``sessions``: one row per live client, with the deadline by which it must
  heartbeat again, measured on the machine's monotonic clock of the current
  boot (so a reboot expires every session of the previous boot, and wall
  clock jumps expire none);
- ``changes``: a log of changed paths by sequence number, trimmed to a
  window; watchers poll it;
- ``meta``: the global sequence (every write transaction takes the next
  number; it is the version of every node the transaction wrote, so versions
  never repeat, not even across delete and re-create) and the trim mark.

Every write runs in ``BEGIN IMMEDIATE`` (SQLite's single writer lock), so a
compare-and-set is a read and a write under one lock: atomic across
threads and processes. A client's writes run in its writer process
(:mod:`waltz_coord_local.writer`), its reads in its own process.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from waltz_api.errors import (
    CoordinationError,
    CoordinationUnavailableError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

SCHEMA_VERSION = 1
CHANGE_LOG_WINDOW = 10_000
_BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    path TEXT PRIMARY KEY,
    parent TEXT NOT NULL,
    value BLOB NOT NULL,
    version INTEGER NOT NULL,
    owner INTEGER
);
CREATE INDEX IF NOT EXISTS nodes_by_parent ON nodes (parent);
CREATE INDEX IF NOT EXISTS nodes_by_owner ON nodes (owner) WHERE owner IS NOT NULL;
CREATE TABLE IF NOT EXISTS sessions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    boot_id TEXT NOT NULL,
    expires_at REAL NOT NULL,
    timeout REAL NOT NULL,
    pid INTEGER NOT NULL,
    host TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS changes (
    seq INTEGER NOT NULL,
    path TEXT NOT NULL,
    parent TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS changes_by_seq ON changes (seq);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta (key, value) VALUES ('seq', 0), ('trimmed', 0), ('schema', 1);
"""


def boot_id() -> str:
    """An id of the current boot (the monotonic clock restarts with it)."""
    try:
        return _BOOT_ID_FILE.read_text().strip()
    except OSError:
        return "no-boot-id"


def now() -> float:
    """The machine-wide monotonic clock (CLOCK_MONOTONIC is shared by all processes)."""
    return time.monotonic()


def parent_of(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


@dataclass(frozen=True)
class NodeState:
    value: bytes
    version: int


@dataclass(frozen=True)
class PollResult:
    seq: int
    data: dict[str, NodeState | None]
    children: dict[str, list[str]]


class SessionGone(CoordinationError):
    """Internal: this store's session row is gone (reaped) or expired."""


class LocalStore:
    """One client's connection to the database file, used from one thread at a time."""

    def __init__(self, db_path: Path, *, busy_timeout: float) -> None:
        self.db_path = db_path
        self.busy_timeout = busy_timeout
        self.boot = boot_id()
        self.session_id = 0
        self._seq: int | None = None  # the sequence number of the open write transaction
        # How a read that finds expired sessions has them reaped first: a write here,
        # or (in a client's process, which never writes) a request to its writer.
        self.reap_expired: Callable[[], object] = self.reap
        try:
            self.conn = sqlite3.connect(
                str(db_path), timeout=busy_timeout, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise CoordinationError(
                f"cannot open the coordination database {db_path}: {exc}; check that the "
                "directory exists and is writable"
            ) from exc

    # -- plumbing ---------------------------------------------------------------------

    def setup(self) -> None:
        """Create the schema (idempotent, safe with concurrent processes)."""
        with _errors(self.db_path):
            mode = self.conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise CoordinationError(
                    f"{self.db_path} could not be switched to WAL mode (got {mode}); "
                    "put it on a local file system"
                )
            self.conn.execute("PRAGMA synchronous=FULL")
            self.conn.execute("PRAGMA foreign_keys=OFF")
            # executescript commits any open transaction, then runs this as one.
            self.conn.executescript("BEGIN IMMEDIATE;\n" + SCHEMA + "\nCOMMIT;")
            schema = self.conn.execute("SELECT value FROM meta WHERE key='schema'").fetchone()[0]
            if int(schema) != SCHEMA_VERSION:
                raise CoordinationError(
                    f"{self.db_path} has coordination schema {schema}, this version "
                    f"understands {SCHEMA_VERSION}; upgrade waltz-coord-local"
                )

    def close(self) -> None:
        with _errors(self.db_path):
            self.conn.close()

    def _write(self, body: Callable[[], T], *, reap: bool = True) -> T:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            self._seq = None
            if reap and self._reap():
                # Our own session had expired: commit the reaping, then report it.
                self.conn.execute("COMMIT")
                raise SessionGone(f"session {self.session_id} expired")
            result = body()
            if self.conn.in_transaction:
                self.conn.execute("COMMIT")
            return result
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        finally:
            self._seq = None

    def _read(self, body: Callable[[], T]) -> T:
        self.conn.execute("BEGIN")
        try:
            return body()
        finally:
            if self.conn.in_transaction:
                self.conn.execute("COMMIT")

    def _next_seq(self) -> int:
        if self._seq is None:
            row = self.conn.execute(
                "UPDATE meta SET value = value + 1 WHERE key = 'seq' RETURNING value"
            ).fetchall()[0]  # fetchall: run a RETURNING statement to completion
            self._seq = int(row[0])
        return self._seq

    def _changed(self, path: str, parent: str) -> int:
        seq = self._next_seq()
        self.conn.execute(
            "INSERT INTO changes (seq, path, parent) VALUES (?, ?, ?)", (seq, path, parent)
        )
        return seq

    def _current_seq(self) -> int:
        return int(self.conn.execute("SELECT value FROM meta WHERE key='seq'").fetchone()[0])

    # -- sessions -------------------------------------------------------------------------

    def _expired_clause(self) -> tuple[str, tuple[object, ...]]:
        return "boot_id != ? OR expires_at < ?", (self.boot, now())

    def _reap(self) -> bool:
        """Delete expired sessions and their ephemeral entries (inside a write txn);
        True when this store's own session was among them."""
        clause, args = self._expired_clause()
        expired = [r[0] for r in self.conn.execute(f"SELECT id FROM sessions WHERE {clause}", args)]
        for session in expired:
            owned = self.conn.execute(
                "SELECT path, parent FROM nodes WHERE owner = ?", (session,)
            ).fetchall()
            for path, parent in owned:
                self._changed(path, parent)
            self.conn.execute("DELETE FROM nodes WHERE owner = ?", (session,))
            self.conn.execute("DELETE FROM sessions WHERE id = ?", (session,))
            log.info(
                "reaped expired coordination session %d (%d ephemeral entries)",
                session,
                len(owned),
            )
        return bool(self.session_id) and self.session_id in expired

    def has_expired_sessions(self) -> bool:
        clause, args = self._expired_clause()
        return (
            self.conn.execute(f"SELECT 1 FROM sessions WHERE {clause} LIMIT 1", args).fetchone()
            is not None
        )

    def open_session(self, timeout: float) -> int:
        def body() -> int:
            row = self.conn.execute(
                "INSERT INTO sessions (boot_id, expires_at, timeout, pid, host) "
                "VALUES (?, ?, ?, ?, ?) RETURNING id",
                (self.boot, now() + timeout, timeout, os.getpid(), socket.gethostname()),
            ).fetchall()[0]
            return int(row[0])

        with _errors(self.db_path):
            self.session_id = self._write(body)
        return self.session_id

    def heartbeat(self, timeout: float) -> bool:
        """Extend this session; False when it is gone or already expired (then LOST).

        Also reaps the other expired sessions and trims the change log."""

        def body() -> bool:
            alive = self.conn.execute(
                "UPDATE sessions SET expires_at = ? WHERE id = ? AND boot_id = ? "
                "AND expires_at >= ?",
                (now() + timeout, self.session_id, self.boot, now()),
            ).rowcount
            self._reap_others()
            self._trim()
            return alive == 1

        with _errors(self.db_path):
            return self._write(body, reap=False)

    def _reap_others(self) -> None:
        # Our own row too, if expired: the caller's UPDATE has already reported it.
        self._reap()

    def _trim(self) -> None:
        seq = self._current_seq()
        trimmed = int(self.conn.execute("SELECT value FROM meta WHERE key='trimmed'").fetchone()[0])
        if seq - trimmed > 2 * CHANGE_LOG_WINDOW:
            mark = seq - CHANGE_LOG_WINDOW
            self.conn.execute("DELETE FROM changes WHERE seq <= ?", (mark,))
            self.conn.execute("UPDATE meta SET value = ? WHERE key = 'trimmed'", (mark,))

    def end_session(self) -> None:
        """Delete this session and its ephemeral entries (close)."""

        def body() -> None:
            owned = self.conn.execute(
                "SELECT path, parent FROM nodes WHERE owner = ?", (self.session_id,)
            ).fetchall()
            for path, parent in owned:
                self._changed(path, parent)
            self.conn.execute("DELETE FROM nodes WHERE owner = ?", (self.session_id,))
            self.conn.execute("DELETE FROM sessions WHERE id = ?", (self.session_id,))

        with _errors(self.db_path):
            self._write(body, reap=False)

    def expire_session(self, session_id: int) -> int:
        """Expire ``session_id`` now, as if it stopped heartbeating; returns how many
        ephemeral entries went with it."""

        def body() -> int:
            self.conn.execute("UPDATE sessions SET expires_at = -1 WHERE id = ?", (session_id,))
            count = self.conn.execute(
                "SELECT count(*) FROM nodes WHERE owner = ?", (session_id,)
            ).fetchone()[0]
            self._reap_others()
            return int(count)

        with _errors(self.db_path):
            return self._write(body, reap=False)

    # -- operations ---------------------------------------------------------------------------

    def reap(self) -> None:
        """Reap the expired sessions now (one write transaction); raises SessionGone
        when this store's own session was among them."""
        with _errors(self.db_path):
            self._write(lambda: None)

    def _maybe_reap(self) -> None:
        if self.has_expired_sessions():
            self.reap_expired()

    def get(self, path: str) -> NodeState | None:
        with _errors(self.db_path):
            self._maybe_reap()
            return self._get(path)

    def _get(self, path: str) -> NodeState | None:
        row = self.conn.execute(
            "SELECT value, version FROM nodes WHERE path = ?", (path,)
        ).fetchone()
        return None if row is None else NodeState(bytes(row[0]), int(row[1]))

    def create(
        self, path: str, value: bytes, *, ephemeral: bool, make_parents: bool, top: str
    ) -> int:
        """Create ``path``; parents up to (not including) ``top`` when ``make_parents``."""

        def body() -> int:
            if self.conn.execute("SELECT 1 FROM nodes WHERE path = ?", (path,)).fetchone():
                raise NodeExistsError(f"{path!r} already exists")
            parent = parent_of(path)
            missing: list[str] = []
            ancestor = parent
            while ancestor not in (top, "/") and len(ancestor) > len(top):
                row = self.conn.execute(
                    "SELECT owner FROM nodes WHERE path = ?", (ancestor,)
                ).fetchone()
                if row is not None:
                    if ancestor == parent and row[0] is not None:
                        raise CoordinationError(
                            f"cannot create {path!r}: its parent is ephemeral, and an "
                            "ephemeral entry can have no children"
                        )
                    break
                missing.append(ancestor)
                ancestor = parent_of(ancestor)
            if missing and not make_parents:
                raise NoNodeError(
                    f"cannot create {path!r}: its parent {parent!r} does not exist "
                    "(create it first, or pass make_parents=True)"
                )
            if ephemeral:
                self._require_own_session()
            for ancestor in reversed(missing):
                seq = self._changed(ancestor, parent_of(ancestor))
                self.conn.execute(
                    "INSERT INTO nodes (path, parent, value, version, owner) "
                    "VALUES (?, ?, ?, ?, NULL)",
                    (ancestor, parent_of(ancestor), b"", seq),
                )
            seq = self._changed(path, parent)
            self.conn.execute(
                "INSERT INTO nodes (path, parent, value, version, owner) VALUES (?, ?, ?, ?, ?)",
                (path, parent, value, seq, self.session_id if ephemeral else None),
            )
            return seq

        with _errors(self.db_path):
            return self._write(body)

    def _require_own_session(self) -> None:
        clause, args = self._expired_clause()
        row = self.conn.execute(
            f"SELECT 1 FROM sessions WHERE id = ? AND NOT ({clause})", (self.session_id, *args)
        ).fetchone()
        if row is None:
            raise SessionGone(f"session {self.session_id} is gone")

    def set(self, path: str, value: bytes, expected_version: int | None) -> tuple[int, int | None]:
        """Returns (new version, None), or (0, current version) when the CAS lost.

        Raises NoNodeError when ``path`` is absent."""

        def body() -> tuple[int, int | None]:
            current = self._get(path)
            if current is None:
                raise NoNodeError(f"cannot set {path!r}: it does not exist (create it first)")
            if expected_version is not None and current.version != expected_version:
                return 0, current.version
            seq = self._changed(path, parent_of(path))
            self.conn.execute(
                "UPDATE nodes SET value = ?, version = ? WHERE path = ?", (value, seq, path)
            )
            return seq, None

        with _errors(self.db_path):
            return self._write(body)

    def delete(self, path: str, expected_version: int | None, recursive: bool) -> int | None:
        """Returns None when deleted (or absent), else the current version (CAS lost)."""

        def body() -> int | None:
            current = self._get(path)
            if current is None:
                if expected_version is not None:
                    raise NoNodeError(
                        f"cannot delete {path!r} at version {expected_version}: it is absent"
                    )
                return None
            if expected_version is not None and current.version != expected_version:
                return current.version
            has_children = self.conn.execute(
                "SELECT 1 FROM nodes WHERE parent = ? LIMIT 1", (path,)
            ).fetchone()
            if has_children and not recursive:
                raise NotEmptyError(
                    f"cannot delete {path!r}: it has children (delete them, or pass recursive=True)"
                )
            doomed = [(path, parent_of(path))]
            if has_children:
                # Every path below: between "<path>/" and "<path>0" ('0' follows '/').
                doomed += self.conn.execute(
                    "SELECT path, parent FROM nodes WHERE path > ? AND path < ?",
                    (path + "/", path + "0"),
                ).fetchall()
            for doomed_path, doomed_parent in doomed:
                self._changed(doomed_path, doomed_parent)
            self.conn.executemany("DELETE FROM nodes WHERE path = ?", [(p,) for p, _ in doomed])
            return None

        with _errors(self.db_path):
            return self._write(body)

    def children(self, path: str) -> list[str]:
        with _errors(self.db_path):
            self._maybe_reap()
            return self._children(path)

    def _children(self, path: str) -> list[str]:
        prefix = len(path.rstrip("/")) + 1
        rows = self.conn.execute("SELECT path FROM nodes WHERE parent = ?", (path,)).fetchall()
        return sorted(row[0][prefix:] for row in rows)

    def increment(self, path: str, top: str) -> int:
        def body() -> int:
            current = self._get(path)
            if current is None:
                self._write_missing_parents(path, top)
                seq = self._changed(path, parent_of(path))
                self.conn.execute(
                    "INSERT INTO nodes (path, parent, value, version, owner) "
                    "VALUES (?, ?, ?, ?, NULL)",
                    (path, parent_of(path), b"1", seq),
                )
                return 1
            try:
                value = int(current.value.decode("ascii") or "0") + 1
            except (UnicodeDecodeError, ValueError) as exc:
                raise CoordinationError(
                    f"{path!r} holds {current.value[:40]!r}, which is not a counter"
                ) from exc
            seq = self._changed(path, parent_of(path))
            self.conn.execute(
                "UPDATE nodes SET value = ?, version = ? WHERE path = ?",
                (str(value).encode(), seq, path),
            )
            return value

        with _errors(self.db_path):
            return self._write(body)

    def _write_missing_parents(self, path: str, top: str) -> None:
        missing: list[str] = []
        ancestor = parent_of(path)
        while ancestor not in (top, "/") and len(ancestor) > len(top):
            row = self.conn.execute(
                "SELECT owner FROM nodes WHERE path = ?", (ancestor,)
            ).fetchone()
            if row is not None:
                if row[0] is not None:
                    raise CoordinationError(f"cannot create {path!r} under an ephemeral entry")
                break
            missing.append(ancestor)
            ancestor = parent_of(ancestor)
        for item in reversed(missing):
            seq = self._changed(item, parent_of(item))
            self.conn.execute(
                "INSERT INTO nodes (path, parent, value, version, owner) VALUES (?, ?, ?, ?, NULL)",
                (item, parent_of(item), b"", seq),
            )

    # -- watches ----------------------------------------------------------------------------

    def snapshot(self, data: Iterable[str], children: Iterable[str]) -> PollResult:
        """The current state of ``data`` paths and ``children`` lists, with the sequence."""
        data, children = list(data), list(children)

        def body() -> PollResult:
            return PollResult(
                self._current_seq(),
                {p: self._get(p) for p in data},
                {p: self._children(p) for p in children},
            )

        with _errors(self.db_path):
            self._maybe_reap()
            return self._read(body)

    def poll(self, since: int | None, data: Iterable[str], children: Iterable[str]) -> PollResult:
        """What changed after sequence ``since`` among the watched paths (all of them
        when ``since`` is None or older than the trimmed change log)."""
        data, children = list(data), list(children)

        def body() -> PollResult:
            seq = self._current_seq()
            if since is not None and seq == since:
                return PollResult(seq, {}, {})
            trimmed = int(
                self.conn.execute("SELECT value FROM meta WHERE key='trimmed'").fetchone()[0]
            )
            if since is None or since < trimmed:
                wanted_data, wanted_children = data, children
            else:
                changed_paths: set[str] = set()
                changed_parents: set[str] = set()
                for path, parent in self.conn.execute(
                    "SELECT path, parent FROM changes WHERE seq > ? AND seq <= ?", (since, seq)
                ):
                    changed_paths.add(path)
                    changed_parents.add(parent)
                wanted_data = [p for p in data if p in changed_paths]
                wanted_children = [p for p in children if p in changed_parents]
            return PollResult(
                seq,
                {p: self._get(p) for p in wanted_data},
                {p: self._children(p) for p in wanted_children},
            )

        with _errors(self.db_path):
            return self._read(body)


class _errors:
    """Map SQLite errors to the Waltz error hierarchy."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is None or not isinstance(exc, sqlite3.Error):
            return
        message = str(exc)
        if isinstance(exc, sqlite3.OperationalError) and ("locked" in message or "busy" in message):
            raise CoordinationUnavailableError(
                f"the coordination database {self.db_path} stayed locked by another process "
                f"({message}); retry, or look for a process stuck holding it"
            ) from exc
        raise CoordinationError(f"coordination database {self.db_path} failed: {message}") from exc
