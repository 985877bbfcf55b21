"""The four contracts every Waltz plugin fulfils.

Each is an abstract class whose docstrings are the semantics the shared
conformance suite (``waltz_conformance``) checks.
"""

from waltz_api.contracts.coordination import (
    Coordination,
    SessionListener,
    SessionState,
    Versioned,
    Watch,
)
from waltz_api.contracts.locktable import LockTable
from waltz_api.contracts.storage import StorageEngine, StoragePartition
from waltz_api.contracts.transport import Connection, ConnectionHandler, Listener, Transport

__all__ = [
    "Connection",
    "ConnectionHandler",
    "Coordination",
    "Listener",
    "LockTable",
    "SessionListener",
    "SessionState",
    "StorageEngine",
    "StoragePartition",
    "Transport",
    "Versioned",
    "Watch",
]
