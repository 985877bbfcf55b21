"""The committer thread is handed the appends of one loop iteration together.

``start_append`` hands an append to the committer without waiting; the appends started
in one iteration of the event loop (the requests of one received message, of every
partition) reach the committer thread in one put at the iteration's end, so they are one
round: at feature level 3, one journal entry and one ``fdatasync`` for all of them, even
when the iteration is slow (a loaded machine) and the thread would otherwise wake up
after the first one and flush it alone.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from waltz_conformance.records import make_records
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.files import Files

pytestmark = pytest.mark.timeout(60)

KEY = uuid.UUID("7b1f3c52-9d04-4e6a-a2c8-51f0e3d9b6a4")
PARTITIONS = 4


class CountingFiles(Files):
    """The real file system, counting the flushes of each fd."""

    def __init__(self) -> None:
        self.flushes: dict[int, int] = {}
        self._lock = threading.Lock()

    def fdatasync(self, fd: int) -> None:
        super().fdatasync(fd)
        with self._lock:
            self.flushes[fd] = self.flushes.get(fd, 0) + 1


@pytest.fixture
async def engine(
    tmp_path: Path, journal_level: int
) -> AsyncIterator[tuple[FsStorageEngine, CountingFiles]]:
    files = CountingFiles()
    opened = await FsStorageEngine.open(
        str(tmp_path / "node"),
        cluster_key=KEY,
        num_partitions=PARTITIONS,
        feature_level=journal_level,
        files=files,
    )
    try:
        for p in range(PARTITIONS):
            await opened.add_partition(p)
        yield opened, files
    finally:
        await opened.close()


async def test_the_appends_started_in_one_loop_iteration_are_one_round(
    engine: tuple[FsStorageEngine, CountingFiles],
) -> None:
    fs, files = engine
    assert fs.journal is not None
    journal_fd = fs.journal.fd
    before = files.flushes.get(journal_fd, 0)
    partitions = [fs.partition(p) for p in range(PARTITIONS)]
    futures = [partitions[0].start_append(make_records(0, 3, partition_id=0))]
    # a slow loop iteration (a loaded machine): the committer thread has all the time
    # it needs to take a job handed over at once and start a round with it alone
    time.sleep(0.2)  # noqa: ASYNC251 (blocking the loop is the point: a slow iteration)
    for p in range(1, PARTITIONS):
        futures.append(partitions[p].start_append(make_records(0, 3, partition_id=p)))
    await asyncio.wait_for(asyncio.gather(*futures), 30)
    assert files.flushes.get(journal_fd, 0) - before == 1, (
        "the appends of one loop iteration are one round: one journal flush"
    )
    for p in range(PARTITIONS):
        assert partitions[p].max_transaction_id() == 2
