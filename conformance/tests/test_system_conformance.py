"""The system suite against the built-in combinations: the in-process ``memory`` one
(memory coordination, transport and storage engine; real StorageNode and server
objects in the test's loop), and real processes for {zk, etcd, local} x zmq x fs.

One cluster per class (the class-scoped ``harness`` fixture below reads the
combination from the class)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from waltz_api.contracts.coordination import SessionState
from waltz_conformance.reference.coordination import MemoryCoordination
from waltz_conformance.suites.system import (
    PROCESSES,
    RECOVERY_CASES,
    VOTER_SWEEP,
    LockingSuite,
    SystemHarness,
    SystemSuite,
)
from waltz_conformance.suites.system_failover import FailoverSuite

pytestmark = pytest.mark.timeout(600)


def coordination_uri(request: pytest.FixtureRequest, kind: str, workdir: Path) -> str:
    root = f"/waltz-{uuid.uuid4().hex[:8]}"
    if kind == "zk":
        uri: str = request.getfixturevalue("zookeeper_server").uri(root)
        return uri
    if kind == "etcd":
        uri = request.getfixturevalue("etcd_cluster").uri(root)
        return uri
    directory = workdir / "coordination"
    directory.mkdir()
    return f"local://{directory}?root={root}"


def memory_harness(**settings: Any) -> SystemHarness:
    """The in-process combination: memory coordination, transport and storage."""
    return SystemHarness(
        name="memory",
        coordination_uri=f"memory://system-{uuid.uuid4().hex[:8]}/waltz",
        transport="memory",
        storage_engine="memory",
        session_timeout=2.0,
        **settings,
    )


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def harness(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SystemHarness]:
    coordination: str = request.cls.coordination
    # The recovery cases run on every combination (about 50 s each with processes).
    # The 1/2/4/5-voter sweep runs in-process and on ZooKeeper only: the voting it
    # checks does not depend on the coordination plugin, and with processes it costs
    # a minute per combination; etcd and local skip it visibly.
    capabilities = {RECOVERY_CASES}
    if coordination in ("memory", "zk"):
        capabilities.add(VOTER_SWEEP)
    if coordination == "memory":
        made = memory_harness(
            lock_table=getattr(request.cls, "lock_table", "hwm-array"),
            capabilities=frozenset(capabilities),
        )
    else:
        workdir = tmp_path_factory.mktemp(f"system-{coordination}")
        made = SystemHarness(
            name=f"{coordination}-zmq-fs",
            coordination_uri=coordination_uri(request, coordination, workdir),
            transport="zmq",
            storage_engine="fs",
            processes=True,
            workdir=workdir,
            capabilities=frozenset(capabilities),
        )
    await made.start()
    try:
        yield made
    finally:
        await made.close()


class TestMemorySystem(SystemSuite, FailoverSuite):
    coordination = "memory"


class TestMemoryExactLockTable(LockingSuite):
    """The feed and locking tests once more with the ``exact`` lock table (in-process)."""

    coordination = "memory"
    lock_table = "exact"


@pytest.mark.system
@pytest.mark.slow
class TestZooKeeperProcesses(SystemSuite, FailoverSuite):
    """ZooKeeper, 3 `waltz storage` (fs) and 2 `waltz server` processes over zmq."""

    coordination = "zk"


@pytest.mark.system
@pytest.mark.slow
class TestEtcdProcesses(SystemSuite, FailoverSuite):
    """etcd (3 members), 3 `waltz storage` (fs) and 2 `waltz server` processes over zmq."""

    coordination = "etcd"


@pytest.mark.system
@pytest.mark.slow
class TestLocalProcesses(SystemSuite, FailoverSuite):
    """The embedded local coordination, 3 `waltz storage` (fs), 2 `waltz server`, zmq."""

    coordination = "local"


def test_a_process_harness_declares_processes(tmp_path: Path) -> None:
    made = SystemHarness(name="p", processes=True, workdir=tmp_path)
    assert PROCESSES in made.capabilities
    assert PROCESSES not in SystemHarness(name="m").capabilities


async def test_the_harness_replaces_its_lost_coordination_client() -> None:
    """A test that stalls the coordination service past the harness's own session
    timeout costs that test, not every later test of the class (a CI run lost 24
    tests of one class to one stalled session before the harness reconnected)."""
    made = memory_harness()
    await made.start()
    try:
        lost = made.coordination
        assert isinstance(lost, MemoryCoordination)
        owner = await made.owner(0)
        lost.service.expire_session(lost.session_id)
        assert lost.session_state is SessionState.LOST
        assert await made.owner(0) == owner  # through a new client
        assert made.coordination is not lost
        assert made.coordination is not None
        assert made.coordination.session_state is SessionState.CONNECTED
    finally:
        await made.close()
