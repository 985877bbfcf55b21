"""A whole Waltz cluster keeping its log in the ``sqlite`` engine: the SystemSuite.

Three real storage nodes (``waltz_storage_node``'s StorageNode, each with its own
SQLite database) and two servers run in the test's event loop over the
in-memory reference coordination and transport of ``waltz-conformance``,
and the shared :class:`SystemSuite` checks the design's safety invariants on
them: the feed, the locks, storage nodes and servers killed while appending,
fencing, and the recovery cases (capability ``recovery_cases``: an
undecidable recovery, a recovery after a failed one, a wiped replica,
idempotency, replicas added, removed and replaced; about 15 s more).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from waltz_conformance.suites.system import RECOVERY_CASES, SystemHarness, SystemSuite

pytestmark = pytest.mark.timeout(600)


@pytest_asyncio.fixture(scope="class", loop_scope="class")
async def harness(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SystemHarness]:
    made = SystemHarness(
        name="memory-memory-sqlite",
        coordination_uri=f"memory://sqlite-{uuid.uuid4().hex[:8]}/waltz",
        transport="memory",
        storage_engine="sqlite",
        workdir=tmp_path_factory.mktemp("cluster"),
        session_timeout=2.0,
        capabilities=frozenset({RECOVERY_CASES}),
    )
    await made.start()
    try:
        yield made
    finally:
        await made.close()


class TestSqliteCluster(SystemSuite):
    async def test_every_replica_is_a_sqlite_database(self, harness: SystemHarness) -> None:
        assert harness.workdir is not None
        data_dirs = sorted(harness.workdir.glob("data*"))
        assert len(data_dirs) >= harness.num_storage_nodes
        for data_dir in data_dirs:
            assert (data_dir / "waltz-storage.sqlite3").is_file(), data_dir
