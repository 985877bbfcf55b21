"""Every replica connection implements the whole ReplicaConnection contract: each call
with the contract's parameters, and only capabilities the contract knows. mypy proves
it for the source modules (the storage client's StorageReplica is a ReplicaConnector's
result in server/main.py); the test fakes are not type-checked, so this checks them
(and the storage client) by their signatures."""

from __future__ import annotations

import inspect

import pytest
from fakes import FakeReplicaConnection, FakeStorageNode
from test_repair import DamagedConnection, DamagedNode

from waltz_api.capabilities import PREFIX, REPAIR
from waltz_api.errors import StorageError
from waltz_server.server.replica import REPLICA_CAPABILITIES, ReplicaConnection
from waltz_server.storage_node.client import StorageReplica

IMPLEMENTATIONS = [StorageReplica, FakeReplicaConnection, DamagedConnection]

CONTRACT = {
    name: member
    for name, member in vars(ReplicaConnection).items()
    if not name.startswith("_") and (callable(member) or isinstance(member, property))
}


def _parameters(member: object) -> list[tuple[str, object, object]]:
    function = member.fget if isinstance(member, property) else member
    assert callable(function)
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_contract_holds_every_call_of_the_store_session_and_recovery() -> None:
    assert {
        "storage_node",
        "capabilities",
        "start_append",
        "read_block",
        "missing_range",
        "repair",
        "local_log",
        "prune",
    } <= set(CONTRACT)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_an_implementation_has_every_call_of_the_contract(implementation: type) -> None:
    for name, member in CONTRACT.items():
        assert hasattr(implementation, name), f"{implementation.__name__} lacks {name}"
        theirs = inspect.getattr_static(implementation, name)
        if isinstance(member, property):
            continue  # a property or a plain attribute both satisfy a read-only one
        assert _parameters(theirs) == _parameters(member), name
        assert inspect.iscoroutinefunction(theirs) == inspect.iscoroutinefunction(member), name


async def test_the_declared_capabilities_are_the_contracts() -> None:
    assert {REPAIR, PREFIX} == REPLICA_CAPABILITIES
    assert FakeReplicaConnection.capabilities == frozenset()
    assert DamagedConnection.capabilities == {REPAIR}
    node, damaged = FakeStorageNode("a"), DamagedNode("b")
    plain = await node.connect(0, 1)
    assert await plain.missing_range() is None  # no damage to report
    with pytest.raises(StorageError, match="PREFIX"):
        await plain.prune(3)
    replica: ReplicaConnection = await damaged.connect(0, 1)
    damaged.damage(2, 4)
    assert await replica.missing_range() == (2, 4)
