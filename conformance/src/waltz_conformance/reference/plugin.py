"""Registers the in-memory reference implementations as plugins named ``memory``.

They exist for the conformance suite and for simulation; a system test never
uses them as a stand-in for a real component.
"""

from __future__ import annotations

from waltz_api.hookspecs import PluginDescriptor, PluginKind, hookimpl


@hookimpl
def waltz_lock_tables() -> list[PluginDescriptor]:
    from waltz_conformance.reference.locktable import MemoryLockTable

    return [
        PluginDescriptor(
            kind=PluginKind.LOCK_TABLE,
            name="memory",
            factory=MemoryLockTable,
            capabilities=frozenset({"exact"}),
            description="exact reference model (unbounded memory); for tests",
            conformance_harness="waltz_conformance.reference.conformance:locktable",
        )
    ]


@hookimpl
def waltz_transports() -> list[PluginDescriptor]:
    from waltz_conformance.reference.transport import create_memory_transport

    return [
        PluginDescriptor(
            kind=PluginKind.TRANSPORT,
            name="memory",
            factory=create_memory_transport,
            capabilities=frozenset({"peer_faults"}),
            description="in-process reference transport (memory://NAME); for tests",
            uri_schemes=("memory",),
            conformance_harness="waltz_conformance.reference.conformance:transport",
        )
    ]


@hookimpl
def waltz_coordinators() -> list[PluginDescriptor]:
    from waltz_conformance.reference.coordination import memory_coordination_factory

    return [
        PluginDescriptor(
            kind=PluginKind.COORDINATION,
            name="memory",
            factory=memory_coordination_factory,
            description="in-process reference coordination (memory://SERVICE/ROOT); for tests",
            uri_schemes=("memory",),
            conformance_harness="waltz_conformance.reference.conformance:coordination",
        )
    ]


@hookimpl
def waltz_storage_engines() -> list[PluginDescriptor]:
    from waltz_conformance.reference.storage import MemoryStorageEngine

    return [
        PluginDescriptor(
            kind=PluginKind.STORAGE,
            name="memory",
            factory=MemoryStorageEngine,
            capabilities=frozenset({"reopen", "availability"}),
            description="in-process reference storage (not durable); for tests",
            conformance_harness="waltz_conformance.reference.conformance:storage",
        )
    ]
