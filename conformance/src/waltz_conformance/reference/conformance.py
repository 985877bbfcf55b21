"""Conformance harnesses of the in-memory reference plugins (``memory``).

Each attribute named in a descriptor's ``conformance_harness`` is a callable
returning the harness of that contract's suite.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from waltz_conformance.suites.coordination import CoordinationHarness
from waltz_conformance.suites.locktable import EXACT, LockTableHarness


def locktable(options: Mapping[str, Any] | None = None) -> LockTableHarness:
    """The harness of the reference lock table (exact: no false positives)."""
    from waltz_conformance.reference.locktable import MemoryLockTable

    return LockTableHarness(
        name="memory",
        factory=MemoryLockTable,
        capabilities=frozenset({EXACT}),
        options=dict(options or {}),
    )


def coordination(options: Mapping[str, Any] | None = None) -> CoordinationHarness:
    """The harness of the reference coordination (a fresh in-process service)."""
    from waltz_conformance.reference.coordination import MemoryCoordinationHarness

    timeout = float(dict(options or {}).get("session_timeout", 2.0))
    return MemoryCoordinationHarness(name="memory", session_timeout=timeout)


def transport(options: Mapping[str, Any] | None = None) -> Any:
    """The harness of the reference transport (peers in-process, faults simulated)."""
    from waltz_conformance.reference.transport_harness import MemoryTransportHarness

    return MemoryTransportHarness(
        name="memory",
        capabilities=frozenset({"peer_faults"}),
        options={"failure_detection_bound": 1.0, **dict(options or {})},
    )


def storage(options: Mapping[str, Any] | None = None, root: Any = None) -> Any:
    """The harness of the reference storage engine (locations are keys in memory).

    It declares ``reopen`` and ``availability`` only: nothing survives the process,
    and there are no files to damage (so no hole to repair) or segments to roll."""
    import uuid
    from pathlib import Path

    from waltz_conformance.reference.storage import MemoryStorageEngine
    from waltz_conformance.suites.storage import StorageHarness

    return StorageHarness(
        name="memory",
        capabilities=frozenset({"reopen", "availability", "prefix"}),
        engine_class=MemoryStorageEngine,
        root=Path(root) if root is not None else Path(f"memory-storage-{uuid.uuid4()}"),
        options=dict(options or {}),
    )
