"""Registers the in-memory reference implementations as plugins named ``memory``.

They exist for the conformance suite and for simulation; a system test never
uses them as a stand-in for a real component. Light on purpose: each model is
imported only when it is chosen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from waltz_api.capabilities import AVAILABILITY, EXACT, PEER_FAULTS, PREFIX, REOPEN
from waltz_api.hookspecs import (
    CoordinationDescriptor,
    CoordinationFactory,
    LockTableDescriptor,
    LockTableFactory,
    StorageEngineDescriptor,
    TransportDescriptor,
    TransportFactory,
    hookimpl,
)

if TYPE_CHECKING:
    from waltz_api.contracts.storage import StorageEngine


def load_lock_table() -> LockTableFactory:
    from waltz_conformance.reference.locktable import MemoryLockTable

    return MemoryLockTable


def load_transport() -> TransportFactory:
    from waltz_conformance.reference.transport import create_memory_transport

    return create_memory_transport


def load_coordination() -> CoordinationFactory:
    from waltz_conformance.reference.coordination import memory_coordination_factory

    return memory_coordination_factory


def load_storage() -> type[StorageEngine]:
    from waltz_conformance.reference.storage import MemoryStorageEngine

    return MemoryStorageEngine


@hookimpl
def waltz_lock_tables() -> list[LockTableDescriptor]:
    return [
        LockTableDescriptor(
            name="memory",
            load=load_lock_table,
            capabilities=frozenset({EXACT}),
            description="exact reference model (unbounded memory); for tests",
            conformance_harness="waltz_conformance.reference.conformance:locktable",
        )
    ]


@hookimpl
def waltz_transports() -> list[TransportDescriptor]:
    return [
        TransportDescriptor(
            name="memory",
            load=load_transport,
            capabilities=frozenset({PEER_FAULTS}),
            description="in-process reference transport (memory://NAME); for tests",
            uri_schemes=("memory",),
            conformance_harness="waltz_conformance.reference.conformance:transport",
        )
    ]


@hookimpl
def waltz_coordinators() -> list[CoordinationDescriptor]:
    return [
        CoordinationDescriptor(
            name="memory",
            load=load_coordination,
            description="in-process reference coordination (memory://SERVICE/ROOT); for tests",
            uri_schemes=("memory",),
            conformance_harness="waltz_conformance.reference.conformance:coordination",
        )
    ]


@hookimpl
def waltz_storage_engines() -> list[StorageEngineDescriptor]:
    return [
        StorageEngineDescriptor(
            name="memory",
            load=load_storage,
            capabilities=frozenset({REOPEN, AVAILABILITY, PREFIX}),
            description="in-process reference storage (not durable); for tests",
            conformance_harness="waltz_conformance.reference.conformance:storage",
        )
    ]
