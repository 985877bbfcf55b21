"""The system conformance suite: a whole cluster (N storage nodes, M servers) built from
a plugin combination (coordination, transport, storage engine, lock table), checked
against the safety invariants of DESIGN.md section 5 through the raw client protocol.

A combination is run by subclassing :class:`SystemSuite` and providing a
class-scoped ``harness`` fixture (one cluster serves every test of the class;
the tests leave it running and healthy), e.g. at module level::

    @pytest_asyncio.fixture(scope="class", loop_scope="class")
    async def harness(tmp_path_factory):
        harness = SystemHarness(name="mine", coordination_uri=..., transport="zmq",
                                storage_engine="fs", processes=True,
                                workdir=tmp_path_factory.mktemp("mine"))
        await harness.start()
        yield harness
        await harness.close()

    class TestMine(SystemSuite):
        pass

With ``processes=True`` every storage node and server is a real child process
(``waltz storage`` / ``waltz server``), killed with SIGKILL and restarted by
pid, and the harness declares the capability ``"processes"``. Otherwise they
run in the test's event loop: a storage node "crash" drops its transport
without a goodbye, a server "kill" drops its connections the same way and
stops its tasks (a graceful deregistration, so its partitions move at once).

A new system test makes its change to the cluster under load and then checks::

    async with under_load(harness) as writers:
        await writers.progress(30, TIMEOUT, "first acknowledgements")
        await harness.kill_owner(0)
        await writers.progress(30, TIMEOUT, "progress after the move")
    await check_invariants(harness, writers.writers)

The modules: ``harness`` (the cluster, its faults and membership changes),
``members`` (a storage node or server, as a process or in the loop), ``clients``
(raw protocol clients and the committed log), ``load`` (writers and
:func:`under_load`), ``checks`` (the invariants), ``suites`` (the tests).

The suite needs the Waltz server package (``waltz_server``): it is the system
under test.
"""

from waltz_api.capabilities import PROCESSES, RECOVERY_CASES, VOTER_SWEEP
from waltz_conformance.suites.system.checks import (
    check_invariants,
    check_no_fork,
    check_replicas_converge,
    fenced_everywhere,
)
from waltz_conformance.suites.system.clients import PartitionClient, read_log
from waltz_conformance.suites.system.harness import (
    RANGE_READ_TIMEOUT,
    TIMEOUT,
    SystemHarness,
    gather_all,
    start_all,
    wait_for,
)
from waltz_conformance.suites.system.load import Writer, Writers, under_load
from waltz_conformance.suites.system.suites import LockingSuite, SystemSuite

__all__ = [
    "PROCESSES",
    "RANGE_READ_TIMEOUT",
    "RECOVERY_CASES",
    "TIMEOUT",
    "VOTER_SWEEP",
    "LockingSuite",
    "PartitionClient",
    "SystemHarness",
    "SystemSuite",
    "Writer",
    "Writers",
    "check_invariants",
    "check_no_fork",
    "check_replicas_converge",
    "fenced_everywhere",
    "gather_all",
    "read_log",
    "start_all",
    "under_load",
    "wait_for",
]
