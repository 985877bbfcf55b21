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

from pathlib import Path

import pytest

from waltz_conformance.suites.system.clients import PartitionClient
from waltz_conformance.suites.system.harness import SystemHarness, wait_for
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools

pytestmark = [pytest.mark.timeout(300), pytest.mark.system]

PARTITION = 0
STORAGE_OPTIONS = {"segment_size": 2048, "index_checkpoint_interval": 8}


def records(count: int, tag: str) -> list[bytes]:
    """Committed ten at a time: the storage appends stay small, so the small segments
    roll."""
    return [f"{tag}-{i}|".encode() * 12 for i in range(count)]


async def test_a_damaged_replica_is_repaired_from_its_peers(tmp_path: Path) -> None:
    harness = SystemHarness.of_processes(
        tmp_path, "repair", num_servers=1, storage_options=STORAGE_OPTIONS
    )
    await harness.start()
    try:
        client = await PartitionClient.connect(harness, PARTITION)
        high = await client.commit(records(200, "before"), 10)
        assert high >= 199
        await harness.wait_held(PARTITION, high, 60)

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
        high = await client.commit(records(50, "while-down"), 10)
        await harness.restart_storage_node(victim)
        high = await client.commit(records(50, "after"), 10)

        async def repaired() -> bool:
            if await harness.replica_missing(victim, PARTITION) is not None:
                return False
            logs = await harness.replica_logs(PARTITION)
            return len(logs[victim]) > high and logs[victim][: high + 1] == logs[1][: high + 1]

        await wait_for(repaired, 120, "the damaged replica to be repaired and caught up")
        logs = await harness.replica_logs(PARTITION)
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
