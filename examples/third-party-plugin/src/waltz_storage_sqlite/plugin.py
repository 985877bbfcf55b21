"""The plugin module (entry point ``waltz_storage_sqlite`` in the ``waltz`` group).

It implements one hook of :mod:`waltz_api.hookspecs` and imports the engine
lazily, so listing plugins costs nothing.
"""

from __future__ import annotations

from waltz_api.capabilities import AVAILABILITY, CRASH_REOPEN, REOPEN
from waltz_api.hookspecs import PluginDescriptor, PluginKind, hookimpl

NAME = "sqlite"
CAPABILITIES = frozenset({REOPEN, CRASH_REOPEN, AVAILABILITY})
"""What the conformance suite may check: acknowledged changes survive a close and
reopen, and a SIGKILL of the writing process; a partition's availability is kept.
(``file_faults``, ``segments`` and ``repair`` are about the ``fs`` file format and do
not apply: SQLite keeps its own pages, and a damaged database is refused whole.)"""


@hookimpl
def waltz_storage_engines() -> list[PluginDescriptor]:
    from waltz_storage_sqlite.engine import SqliteStorageEngine

    return [
        PluginDescriptor(
            kind=PluginKind.STORAGE,
            name=NAME,
            factory=SqliteStorageEngine,
            capabilities=CAPABILITIES,
            description="one SQLite database per storage directory (WAL, synchronous=FULL)",
            uri_schemes=("sqlite",),
        )
    ]
