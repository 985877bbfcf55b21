"""A running storage node's scrub finds damage under it, and the replica is repaired from
its peers, with real processes.

Three ``waltz storage`` processes (fs engine, small segments, a scrub pass every half
second), one ``waltz server``, the local coordination, ZeroMQ. A client commits records;
then a byte of a record in a sealed segment of one node is flipped on disk while that
node runs (its start-up recovery never saw it: only a read finds it). The node's scrub
finds it, moves the damaged bytes aside and closes the server's connection; the server's
replica rejoins its store session, which copies the missing record from a peer; and the
record reads back from that node identical to what was committed, while the client keeps
committing throughout.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from waltz_cli import main
from waltz_conformance.suites.system.clients import PartitionClient
from waltz_conformance.suites.system.harness import SystemHarness, wait_for
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools

pytestmark = [pytest.mark.timeout(300), pytest.mark.system]

PARTITION = 0
STORAGE_OPTIONS = {"segment_size": 2048, "index_checkpoint_interval": 8}
SCRUB = {"interval": 0.5, "rate_bytes_per_second": 16 * 1024 * 1024}


def records(count: int, tag: str) -> list[bytes]:
    """Committed ten at a time: the small segments roll."""
    return [f"{tag}-{i}|".encode() * 12 for i in range(count)]


async def test_damage_a_running_nodes_scrub_finds_is_repaired_from_its_peers(
    tmp_path: Path,
) -> None:
    # small segments and a frequent scrub
    harness = SystemHarness.of_processes(
        tmp_path,
        "scrub",
        num_servers=1,
        storage_options=STORAGE_OPTIONS,
        storage_settings={"scrub": SCRUB},
    )
    await harness.start()
    try:
        client = await PartitionClient.connect(harness, PARTITION)
        high = await client.commit(records(200, "before"), 10)
        assert high >= 199
        await harness.wait_held(PARTITION, high, 60)
        committed = (await harness.replica_log(1, PARTITION))[: high + 1]

        victim_node = 0
        data_dir = tmp_path / f"data{victim_node}"
        firsts = tools.segment_firsts(data_dir / str(PARTITION))
        assert len(firsts) >= 6, firsts
        middle = firsts[len(firsts) // 2]  # a sealed segment
        victim = middle + 2
        path, start, _ = tools.find_record(data_dir, PARTITION, victim)
        assert path.name == fmt.segment_file_name(middle, fmt.SEGMENT_SUFFIX)
        with path.open("r+b") as f:  # one byte of its data, under the running node
            f.seek(start + fmt.RECORD_HEAD.size + 3)
            byte = f.read(1)[0]
            f.seek(start + fmt.RECORD_HEAD.size + 3)
            f.write(bytes([byte ^ 0x01]))
        node_log = tmp_path / f"storage{victim_node}.log"

        async def found() -> bool:
            return f"the scrub found transactions {victim}..{victim} damaged" in (
                node_log.read_text(errors="replace")
            )

        await wait_for(found, 60, "the node's scrub to find the damaged record")
        # the others go on committing while the damaged replica rejoins and is repaired
        high = await client.commit(records(50, "after"), 10)

        async def repaired() -> bool:
            if await harness.replica_missing(victim_node, PARTITION) is not None:
                return False
            logs = await harness.replica_logs(PARTITION)
            return len(logs[victim_node]) > high and (
                logs[victim_node][: high + 1] == logs[1][: high + 1]
            )

        await wait_for(repaired, 120, "the damaged replica to be repaired from its peers")
        logs = await harness.replica_logs(PARTITION)
        assert logs[0][: high + 1] == logs[1][: high + 1] == logs[2][: high + 1]
        assert logs[victim_node][victim] == committed[victim]
        assert logs[victim_node][: len(committed)] == committed
        text = node_log.read_text(errors="replace")
        assert f"repaired transactions {victim}..{victim} from a peer" in text
        (entry,) = tools.list_quarantine(data_dir)
        assert f"a scrub found transactions {victim}..{victim}" in entry.readme

        # `waltz storage scrub` asks the running node for a pass now: nothing is left
        def scrub_now() -> tuple[int, str]:
            endpoint = harness.storage_endpoint(victim_node)
            result = CliRunner().invoke(
                main, ["storage", "scrub", "--endpoint", endpoint, "--rate", "0", "-o", "json"]
            )
            return result.exit_code, result.output

        code, out = await asyncio.get_running_loop().run_in_executor(None, scrub_now)
        assert code == 0, out
        (row,) = json.loads(out)["partitions"]
        assert row["complete"] and row["records"] > 100 and row["damaged"] == []
    finally:
        await harness.close()
