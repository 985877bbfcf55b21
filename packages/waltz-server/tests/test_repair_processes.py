"""A damaged replica repairs itself from its peers, with real processes.

Three ``waltz storage`` processes (fs engine, small segments), one ``waltz
server``, the local coordination, ZeroMQ. A client commits records; one storage
node is killed (-9), a segment in the middle of its partition is damaged (cut
in the middle of a record), and the node restarts. Its recovery moves the
damaged bytes to the quarantine and keeps every later segment; the partition
reports the hole; the server's recovery copies the missing records from a
healthy replica into it before the replica votes; and the node ends with the
same log as its peers, every committed record in place, while the client keeps
committing throughout.
"""

from __future__ import annotations

import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest

from waltz_api.config import toml_document
from waltz_conformance.suites.system.clients import PartitionClient
from waltz_conformance.suites.system.harness import SystemHarness, wait_for
from waltz_conformance.suites.system.members import Member
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools

pytestmark = [pytest.mark.timeout(300), pytest.mark.system]

PARTITION = 0
STORAGE_OPTIONS = {"segment_size": 2048, "index_checkpoint_interval": 8}


class SmallSegments(SystemHarness):
    """The system harness, its storage nodes with small segments."""

    def _make_storage(self, index: int) -> Member:
        member = super()._make_storage(index)
        assert self.workdir is not None
        path = self.workdir / f"storage{index}.toml"
        config: dict[str, Any] = tomllib.loads(path.read_text())
        config["storage"]["options"] = STORAGE_OPTIONS
        path.write_text(toml_document(config))
        return member


async def commit(client: PartitionClient, count: int, tag: str) -> int:
    """Commit ``count`` records, ten at a time (the storage appends stay small, so the
    small segments roll); returns the high-water mark."""
    high = -1
    for first in range(0, count, 10):
        for i in range(first, min(first + 10, count)):
            await client.append(f"{tag}-{i}|".encode() * 12, -1)
        high = await client.flush()
    return high


async def test_a_damaged_replica_is_repaired_from_its_peers(tmp_path: Path) -> None:
    coordination = tmp_path / "coordination"
    coordination.mkdir()
    harness = SmallSegments(
        name="repair",
        coordination_uri=f"local://{coordination}?root=/waltz-{uuid.uuid4().hex[:8]}",
        transport="zmq",
        storage_engine="fs",
        processes=True,
        workdir=tmp_path,
        num_storage_nodes=3,
        num_servers=1,
        num_partitions=1,
    )
    await harness.start()
    try:
        client = await PartitionClient.connect(harness, PARTITION)
        high = await commit(client, 200, "before")
        assert high >= 199

        async def all_hold(mark: int) -> bool:
            logs = [await harness.replica_log(i, PARTITION) for i in range(3)]
            return all(len(log) > mark for log in logs)

        await wait_for(lambda: all_hold(high), 60, "every replica to hold the records")

        victim = 0
        await harness.kill_storage_node(victim)
        pdir = tmp_path / f"data{victim}" / str(PARTITION)
        firsts = tools.segment_firsts(pdir)
        assert len(firsts) >= 6, firsts
        middle = firsts[len(firsts) // 2]
        data = pdir / fmt.segment_file_name(middle, fmt.SEGMENT_SUFFIX)
        _, start, end = tools.find_record(tmp_path / f"data{victim}", PARTITION, middle + 2)
        with data.open("r+b") as f:  # cut inside a record, the segment's later records gone
            f.truncate((start + end) // 2)
        lost = list(range(middle + 2, firsts[firsts.index(middle) + 1]))

        # the others go on committing while the victim is down and while it comes back
        high = await commit(client, 50, "while-down")
        await harness.restart_storage_node(victim)
        high = await commit(client, 50, "after")

        async def repaired() -> bool:
            storage = await harness.storage_client(victim)
            try:
                session = 0
                try:
                    await storage.max_transaction_id(0, PARTITION)
                except Exception as exc:  # fenced: names the session the replica holds
                    session = getattr(exc, "highest_session_id", 0)
                if await storage.missing_range(session, PARTITION) is not None:
                    return False
            finally:
                await storage.close()
            logs = [await harness.replica_log(i, PARTITION) for i in range(3)]
            return len(logs[victim]) > high and logs[victim][: high + 1] == logs[1][: high + 1]

        await wait_for(repaired, 120, "the damaged replica to be repaired and caught up")
        logs = [await harness.replica_log(i, PARTITION) for i in range(3)]
        assert logs[0][: high + 1] == logs[1][: high + 1] == logs[2][: high + 1]
        for t in lost:
            assert logs[victim][t] == logs[1][t]
        # later segments were never deleted: they are where they were, the damaged bytes
        # are in the quarantine, and the node's log says what it did
        assert set(firsts) <= set(tools.segment_firsts(pdir))
        (entry,) = tools.list_quarantine(tmp_path / f"data{victim}")
        assert entry.partition_id == PARTITION and data.name in entry.readme
        log = (tmp_path / f"storage{victim}.log").read_text()
        assert f"repaired transactions {middle + 2}" in log
    finally:
        await harness.close()
