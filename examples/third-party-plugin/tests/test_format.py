"""A database of format version 1 (before the low-water mark's session and the
availability columns) opens and is migrated in place."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

from waltz_storage_sqlite.engine import DB_FILE_NAME, FORMAT_VERSION, SqliteStorageEngine

from waltz_api.types import NO_SESSION, SessionInfo
from waltz_conformance.suites.storage import make_record

VERSION_1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE partitions (
    partition_id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL,
    low_water_mark INTEGER NOT NULL,
    local_low_water_mark INTEGER NOT NULL
);
CREATE TABLE records (
    partition_id INTEGER NOT NULL,
    transaction_id INTEGER NOT NULL,
    client_id INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    req_partition_id INTEGER NOT NULL,
    seq_num INTEGER NOT NULL,
    header INTEGER NOT NULL,
    checksum INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (partition_id, transaction_id)
);
"""


def write_version_1(directory: Path, key: uuid.UUID) -> None:
    directory.mkdir()
    connection = sqlite3.connect(directory / DB_FILE_NAME, isolation_level=None)
    try:
        connection.executescript(VERSION_1_SCHEMA)
        connection.executemany(
            "INSERT INTO meta VALUES (?, ?)",
            [("format_version", "1"), ("cluster_key", str(key)), ("num_partitions", "2")],
        )
        connection.execute("INSERT INTO partitions VALUES (1, 4, 2, 2)")
        for t in range(3):
            r = make_record(t, 1)
            q = r.req_id
            connection.execute(
                "INSERT INTO records VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    t,
                    q.client_id,
                    q.generation,
                    q.partition_id,
                    q.seq_num,
                    r.header,
                    r.checksum,
                    r.data,
                ),
            )
    finally:
        connection.close()


async def test_a_version_1_database_is_migrated(tmp_path: Path) -> None:
    key = uuid.uuid4()
    write_version_1(tmp_path / "db", key)
    engine = await SqliteStorageEngine.open(str(tmp_path / "db"), cluster_key=key)
    try:
        part = engine.partition(1)
        assert part.session_info() == SessionInfo(4, 2, 2, NO_SESSION)
        assert part.available()
        assert await part.read_records(0, 10) == [make_record(t, 1) for t in range(3)]
        await part.set_session_info(SessionInfo(5, 2, 2, 5))
        await part.set_available(False)
    finally:
        await engine.close()
    engine = await SqliteStorageEngine.open(str(tmp_path / "db"))
    try:
        assert engine.partition(1).session_info() == SessionInfo(5, 2, 2, 5)
        assert not engine.partition(1).available()
    finally:
        await engine.close()
    connection = sqlite3.connect(tmp_path / "db" / DB_FILE_NAME)
    try:
        version = connection.execute(
            "SELECT value FROM meta WHERE key = 'format_version'"
        ).fetchone()[0]
    finally:
        connection.close()
    assert int(version) == FORMAT_VERSION
