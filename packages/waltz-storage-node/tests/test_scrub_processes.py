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
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from waltz_api.config import toml_document
from waltz_cli import main
from waltz_conformance.suites.system.clients import PartitionClient
from waltz_conformance.suites.system.harness import SystemHarness, wait_for
from waltz_conformance.suites.system.members import Member
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools

pytestmark = [pytest.mark.timeout(300), pytest.mark.system]

PARTITION = 0
STORAGE_OPTIONS = {"segment_size": 2048, "index_checkpoint_interval": 8}
SCRUB = {"interval": 0.5, "rate_bytes_per_second": 16 * 1024 * 1024}


class ScrubbingNodes(SystemHarness):
    """The system harness, its storage nodes with small segments and a frequent scrub."""

    def _make_storage(self, index: int) -> Member:
        member = super()._make_storage(index)
        assert self.workdir is not None
        path = self.workdir / f"storage{index}.toml"
        config: dict[str, Any] = tomllib.loads(path.read_text())
        config["storage"]["options"] = STORAGE_OPTIONS
        config["storage"]["scrub"] = SCRUB
        path.write_text(toml_document(config))
        return member


async def commit(client: PartitionClient, count: int, tag: str) -> int:
    """Commit ``count`` records, ten at a time (the small segments roll); returns the
    high-water mark."""
    high = -1
    for first in range(0, count, 10):
        for i in range(first, min(first + 10, count)):
            await client.append(f"{tag}-{i}|".encode() * 12, -1)
        high = await client.flush()
    return high


async def test_damage_a_running_nodes_scrub_finds_is_repaired_from_its_peers(
    tmp_path: Path,
) -> None:
    coordination = tmp_path / "coordination"
    coordination.mkdir()
    harness = ScrubbingNodes(
        name="scrub",
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
        high = await commit(client, 50, "after")

        async def repaired() -> bool:
            storage = await harness.storage_client(victim_node)
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
            return len(logs[victim_node]) > high and (
                logs[victim_node][: high + 1] == logs[1][: high + 1]
            )

        await wait_for(repaired, 120, "the damaged replica to be repaired from its peers")
        logs = [await harness.replica_log(i, PARTITION) for i in range(3)]
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
