"""The plugin module (entry point ``waltz_storage_sqlite`` in the ``waltz`` group).

It implements one hook of :mod:`waltz_api.hookspecs` and hands over a ``load``
function instead of the engine: reading the descriptor (``waltz plugins list``,
every process that looks for a plugin) imports nothing but this module, and the
engine is imported when ``sqlite`` is chosen. The typed descriptor lets mypy check
that ``load`` returns a StorageEngine subclass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from waltz_api.capabilities import AVAILABILITY, CRASH_REOPEN, REOPEN
from waltz_api.hookspecs import StorageEngineDescriptor, hookimpl

if TYPE_CHECKING:
    from waltz_api.contracts.storage import StorageEngine

NAME = "sqlite"
CAPABILITIES = frozenset({REOPEN, CRASH_REOPEN, AVAILABILITY})
"""What the conformance suite may check: acknowledged changes survive a close and
reopen, and a SIGKILL of the writing process; a partition's availability is kept.
(``file_faults``, ``segments`` and ``repair`` are about the ``fs`` file format and do
not apply: SQLite keeps its own pages, and a damaged database is refused whole.)"""


def load_engine() -> type[StorageEngine]:
    from waltz_storage_sqlite.engine import SqliteStorageEngine

    return SqliteStorageEngine


@hookimpl
def waltz_storage_engines() -> list[StorageEngineDescriptor]:
    return [
        StorageEngineDescriptor(
            name=NAME,
            load=load_engine,
            capabilities=CAPABILITIES,
            description="one SQLite database per storage directory (WAL, synchronous=FULL)",
            uri_schemes=("sqlite",),
        )
    ]
