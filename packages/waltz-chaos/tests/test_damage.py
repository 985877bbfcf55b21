"""The storage faults' file operations on real ``fs`` data directories, what the engine
finds at its next start, and the repair check against a real storage node (in this
process, on the memory transport)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from waltz_api.plugins import get_registry
from waltz_api.types import LOST_SESSION
from waltz_chaos import damage
from waltz_chaos.errors import ChaosError
from waltz_conformance.suites.storage import make_record
from waltz_storage_fs import format as fmt
from waltz_storage_fs import tools
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_node.config import load_storage_config
from waltz_storage_node.main import start_node

pytestmark = pytest.mark.timeout(120)

KEY = uuid.UUID("3c1f5a4e-2b7d-4e8a-9f60-1d2c3b4a5e6f")
PARTITIONS = 2
RECORDS = 60
OPTIONS = {"segment_size": 600}


async def fill(data: Path, records: int = RECORDS, **options: Any) -> None:
    engine = await FsStorageEngine.open(
        str(data), cluster_key=KEY, num_partitions=PARTITIONS, options={**OPTIONS, **options}
    )
    try:
        for pid in range(PARTITIONS):
            await engine.add_partition(pid)
            for t in range(records):
                await engine.partition(pid).append([make_record(t, pid)])
    finally:
        await engine.close()


async def reopen(data: Path, **options: Any) -> list[tuple[int, list[tuple[int, int]], int]]:
    """Each partition's (max id, missing ranges, low-water-mark session) after a start."""
    engine = await FsStorageEngine.open(
        str(data), cluster_key=KEY, num_partitions=PARTITIONS, options={**OPTIONS, **options}
    )
    try:
        found = []
        for pid in range(PARTITIONS):
            part = engine.partition(pid)
            found.append(
                (
                    part.max_transaction_id(),
                    part.missing_ranges(),
                    part.session_info().low_water_mark_session_id,
                )
            )
        return found
    finally:
        await engine.close()


def sizes(data: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in data.rglob(f"*{fmt.SEGMENT_SUFFIX}")}


@pytest.fixture
async def data(tmp_path: Path) -> Path:
    path = tmp_path / "data"
    await fill(path)
    return path


async def test_a_cut_tail_loses_records_without_a_trace(data: Path) -> None:
    before = sizes(data)
    what = damage.truncate_segment(data, random.Random(1))
    after = sizes(data)
    (cut,) = [p for p in before if after[p] != before[p]]
    assert cut.name == fmt.segment_file_name(tools.segment_firsts(cut.parent)[-1], ".seg")
    assert fmt.HEADER_SIZE <= after[cut] < before[cut] and f"cut from {before[cut]}" in what
    found = await reopen(data)
    pid = int(cut.parent.name)
    assert found[pid][0] < RECORDS - 1 and found[pid][1] == []  # taken for a torn tail
    assert found[1 - pid][0] == RECORDS - 1


async def test_a_flip_in_a_sealed_segment_is_a_hole_found_by_a_verifying_start(data: Path) -> None:
    before = {p: p.read_bytes() for p in sizes(data)}
    what = damage.flip_sealed(data, random.Random(2))
    (changed,) = [p for p, b in before.items() if p.read_bytes() != b]
    assert changed.name != fmt.segment_file_name(tools.segment_firsts(changed.parent)[-1], ".seg")
    assert str(changed.relative_to(data)) in what
    pid = int(changed.parent.name)
    assert (await reopen(data))[pid][1] == []  # the index vouches for it: unseen at start
    found = await reopen(data, verify_on_open=1)
    assert found[pid][1] and found[pid][0] == RECORDS - 1, found


@pytest.mark.parametrize("seed", range(6))
async def test_corrupt_bytes_are_found_at_a_verifying_start(data: Path, seed: int) -> None:
    before = {p: p.read_bytes() for p in sizes(data)}
    damage.corrupt_segment(data, random.Random(seed))
    (changed,) = [p for p, b in before.items() if p.read_bytes() != b]
    pid = int(changed.parent.name)
    found = (await reopen(data, verify_on_open=1))[pid]
    # a hole to repair, or a lost tail (a damaged last record)
    assert found[1] or found[2] == LOST_SESSION, found


async def test_nothing_to_damage_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    await fill(data, records=2)
    with pytest.raises(ChaosError, match="no sealed segment"):
        damage.flip_sealed(data, random.Random(0))
    with pytest.raises(ChaosError, match="no segment"):
        damage.corrupt_segment(tmp_path / "empty", random.Random(0))


async def test_copies_wipe_and_restore(data: Path, tmp_path: Path) -> None:
    copies = damage.Copies(tmp_path / "copies")
    assert copies.oldest("storage-0") is None
    for when in (1.0, 2.0, 3.0, 4.0):
        copies.take("storage-0", data, when)
    copies.take("storage-1", tmp_path / "absent", 5.0)  # a wiped node: nothing to copy
    assert copies.oldest("storage-1") is None
    oldest = copies.oldest("storage-0")
    assert oldest is not None and oldest[1] == 2.0  # the last KEEP_COPIES kept
    assert len(list((tmp_path / "copies").iterdir())) == damage.KEEP_COPIES
    original = sizes(data)
    assert damage.wipe(data) == f"{len(list(oldest[0].rglob('*.*')))} files removed"
    assert not await asyncio.to_thread(data.exists)
    damage.restore(data, oldest[0])
    assert {p.relative_to(data): s for p, s in sizes(data).items()} == {
        p.relative_to(data): s for p, s in original.items()
    }
    assert [f[0] for f in await reopen(data)] == [RECORDS - 1] * PARTITIONS


@contextlib.asynccontextmanager
async def serving(data: Path) -> AsyncIterator[tuple[Any, str, Any]]:
    """A storage node serving ``data`` (verifying every record at its start) on the memory
    transport: (the node, its endpoint, a client transport)."""
    endpoint = f"memory://chaos-damage-{uuid.uuid4().hex[:8]}:5500"
    config = {
        "storage": {
            "data_dir": str(data),
            "engine": "fs",
            "cluster_key": str(KEY),
            "num_partitions": PARTITIONS,
            "partitions": list(range(PARTITIONS)),
            "options": {**OPTIONS, "verify_on_open": 1},
            "scrub": {"enabled": False},  # passes run when a test asks
        },
        "transport": {"plugin": "memory", "endpoint": endpoint},
    }
    started = await start_node(load_storage_config(None, overrides=config))
    transport = get_registry().get("transport", "memory").factory({})
    try:
        yield started, endpoint, transport
    finally:
        await transport.close()
        await started.close()
        await started.transport.close()


def flip_record(data: Path, pid: int, transaction_id: int) -> None:
    """Damage the data of one record (its checksum fails)."""
    path, start, _ = tools.find_record(data, pid, transaction_id)
    with path.open("r+b") as f:
        f.seek(start + fmt.RECORD_HEAD.size + 1)
        byte = f.read(1)
        f.seek(start + fmt.RECORD_HEAD.size + 1)
        f.write(bytes([byte[0] ^ 0xFF]))


async def test_repaired_asks_the_node(data: Path) -> None:
    async with serving(data) as (started, endpoint, transport):
        assert await damage.repaired(transport, endpoint, {0: RECORDS - 1, 1: RECORDS - 1}) is None
        assert await damage.repaired(transport, endpoint, {0: RECORDS}) == (
            f"partition 0 at {RECORDS - 1} of {RECORDS}"
        )
        await started.close()
        await started.transport.close()
        missing = await damage.repaired(transport, endpoint, {0: 0})
        assert missing is not None and missing.startswith("not answering"), missing


async def test_repaired_sees_holes_and_lost_tails(data: Path) -> None:
    flip_record(data, 0, 3)  # in partition 0's first segment: a hole
    flip_record(data, 1, RECORDS - 1)  # partition 1's last record: a lost tail
    async with serving(data) as (_, endpoint, transport):
        hole = await damage.repaired(transport, endpoint, {0: 0})
        lost = await damage.repaired(transport, endpoint, {1: 0})
    assert hole == "partition 0 misses [[3, 3]]"
    assert lost == "partition 1 is LOST (not caught up)"


async def test_a_scrub_of_the_running_node_finds_a_flip(data: Path) -> None:
    """flip_sealed's heal: the damage in a sealed segment of a running node, unseen until
    read, is found by a scrub pass and becomes a hole (for the server to repair)."""
    async with serving(data) as (_, endpoint, transport):
        assert await damage.scrub(transport, endpoint) == "a scrub pass found no damage"
        flip_record(data, 0, 3)  # the node runs: its index vouches for the record
        assert await damage.repaired(transport, endpoint, {0: 0}) is None
        found = await damage.scrub(transport, endpoint)
        assert found == "a scrub pass found transactions 3..3 of partition 0 damaged"
        assert await damage.repaired(transport, endpoint, {0: 0}) == "partition 0 misses [[3, 3]]"
