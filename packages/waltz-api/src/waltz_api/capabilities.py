"""Capability names: the optional features a plugin declares (``PluginDescriptor``, a
conformance harness) and a conformance test requires (``@requires``).

Every name is here, once. An unknown name is an error wherever it appears (a
descriptor, a harness, a requirement): a misspelt requirement would otherwise skip its
test forever, and a misspelt declaration would silently skip the tests it was meant to
enable. A new optional feature adds its constant here, to the set of its plugin kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from waltz_api.errors import PluginError

# -- storage engines ---------------------------------------------------------------------
REOPEN: Final = "reopen"
"""The engine's data survives closing and opening it again (at the same location)."""
CRASH_REOPEN: Final = "crash_reopen"
"""It survives a crash (a killed process) as well, recovering at open."""
FILE_FAULTS: Final = "file_faults"
"""Its harness can damage its files (cut, flip, tear) for the recovery tests."""
SEGMENTS: Final = "segments"
"""The log is kept in segments that roll over (tests at segment boundaries)."""
AVAILABILITY: Final = "availability"
"""It keeps an administrator's partition availability across restarts."""
REPAIR: Final = "repair"
"""Start-up recovery keeps intact records after damaged ones and reports the damaged ones
as missing ranges, which ``repair`` fills (records copied from a peer)."""

SCRUB: Final = "scrub"
"""``scrub`` reads back sealed records and verifies them while the engine runs; damage it
finds becomes a missing range (as start-up recovery's), which ``repair`` fills. A storage
node scrubs only an engine that declares it."""

PREFIX: Final = "prefix"
"""Records at the start of the log can be deleted (they were archived elsewhere):
``log_start``, ``drop_prefix`` and ``local_extents``; an engine without it keeps every
record (a storage node then never deletes below the archive mark)."""

# -- coordination ------------------------------------------------------------------------
SERVER_RESTART: Final = "server_restart"
"""Its harness can restart the coordination service under connected clients."""
CROSS_PROCESS: Final = "cross_process"
"""Clients in other processes share its state (not an in-process model)."""

# -- transports --------------------------------------------------------------------------
PEER_FAULTS: Final = "peer_faults"
"""Its harness can kill, pause and cut a peer."""
PROCESSES: Final = "processes"
"""Peers (a transport's) or members (a system harness's) run as real processes."""
MALFORMED_INPUT: Final = "malformed_input"
"""Its harness can inject malformed frames at the byte level."""
CONTROL_FUZZ: Final = "control_fuzz"
"""Its harness can fuzz the transport's own control messages."""
AUTHENTICATED_PEERS: Final = "authenticated_peers"
"""A listener authenticates its clients and gives each accepted connection the identity it
accepted (``Connection.peer_identity``); the harness makes transports with distinct
client credentials (``TransportHarness.authenticated``)."""

# -- lock tables -------------------------------------------------------------------------
EXACT: Final = "exact"
"""No false positives: a check fails only for a real conflict."""
BOUNDED_MEMORY: Final = "bounded_memory"
"""Memory does not grow with the number of distinct locks."""

# -- the system harness (a whole cluster, not a plugin) ----------------------------------
VOTER_SWEEP: Final = "voter_sweep"
"""It may build extra clusters of 1, 2, 4 and 5 storage nodes (about a minute with real
processes). The voting logic does not depend on the plugin combination, so a suite run
may declare it for one combination only."""
RECOVERY_CASES: Final = "recovery_cases"
"""It runs the expensive recovery cases (undecidable wait, recovery after a failed
recovery, a wiped replica, idempotency, replicas added, removed and replaced; about half
a minute each with real processes). They exercise the server's recovery, which does not
depend on the plugin combination: a suite run may declare this for the in-process
combination and one combination of processes, and the others run the representative
rest (feed, locking, fencing, faults while appending)."""

BY_KIND: Final[Mapping[str, frozenset[str]]] = {
    "storage": frozenset(
        {REOPEN, CRASH_REOPEN, FILE_FAULTS, SEGMENTS, AVAILABILITY, REPAIR, PREFIX, SCRUB}
    ),
    "coordination": frozenset({SERVER_RESTART, CROSS_PROCESS}),
    "transport": frozenset(
        {PEER_FAULTS, PROCESSES, MALFORMED_INPUT, CONTROL_FUZZ, AUTHENTICATED_PEERS}
    ),
    "lock_table": frozenset({EXACT, BOUNDED_MEMORY}),
    "system": frozenset({PROCESSES, VOTER_SWEEP, RECOVERY_CASES}),
}
"""The capabilities of each plugin kind (``PluginKind`` values) and of the system harness."""

ALL: Final[frozenset[str]] = frozenset().union(*BY_KIND.values())


def check(capabilities: Iterable[str], kind: str | None = None, where: str = "") -> frozenset[str]:
    """``capabilities`` as a frozenset, once every name is known (for ``kind``, or for any
    kind); raises PluginError naming the unknown ones and the valid choices."""
    names = frozenset(capabilities)
    known = ALL if kind is None else BY_KIND.get(str(kind), frozenset())
    unknown = sorted(n for n in names if n not in known)
    if unknown:
        scope = f"of a {kind} plugin" if kind is not None else ""
        raise PluginError(
            f"unknown capabilit{'y' if len(unknown) == 1 else 'ies'} "
            f"{', '.join(repr(n) for n in unknown)}{' ' + where if where else ''}; the "
            f"capabilities {scope or 'known'}: {', '.join(sorted(known)) or 'none'} "
            "(a new one is added to waltz_api.capabilities)"
        )
    return names
