"""The engine's runners: the committer and the reads on the event loop (``LoopRunner``).

Under ``LoopRunner`` the engine starts no thread and calls no executor; a round's
flush is requested, then waited for (``flush_wait``), and only then made durable,
so a committer cancelled in between (its process died) leaves the writes not
durable and the appends unanswered. Group commit is the same logic as with
threads: appends queued while a flush waits share the next round.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from waltz_conformance.suites.storage import make_record
from waltz_storage_fs.committer import LoopRunner
from waltz_storage_fs.engine import FsStorageEngine
from waltz_storage_fs.powerloss import PowerLossFiles

pytestmark = pytest.mark.timeout(60)

KEY = uuid.UUID("3d0c9a7e-58b1-4f26-8e3a-0b9c4d2e1f70")
ROOT = Path("/sim/store")


class NoThreadsLoop(asyncio.SelectorEventLoop):
    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> Any:  # type: ignore[override]
        raise AssertionError(f"run_in_executor({func!r}) under the loop runner")


class Gate:
    """A ``flush_wait`` that holds every flush until released (counts the waits)."""

    def __init__(self) -> None:
        self.waits = 0
        self.open = asyncio.Event()
        self.open.set()
        self._changed = asyncio.Condition()

    async def __call__(self) -> None:
        async with self._changed:
            self.waits += 1
            self._changed.notify_all()
        await self.open.wait()

    async def reached(self, waits: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.waits >= waits)


def run(main: Callable[[], Any]) -> Any:
    loop = NoThreadsLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


async def open_engine(files: PowerLossFiles, gate: Gate) -> FsStorageEngine:
    return await FsStorageEngine.open(
        str(ROOT),
        cluster_key=KEY,
        num_partitions=2,
        options={"segment_size": 400, "index_checkpoint_interval": 2},
        files=files,
        runner=LoopRunner(flush_wait=gate),
        feature_level=2,  # the flushes counted: a round's data, then the control file's
    )


def durable_data(files: PowerLossFiles) -> bytes:
    """Every durable byte of partition 0's segment files."""
    _, tree = next(iter(files.snapshot().states()))  # "durable"
    return b"".join(content for path, content in sorted(tree.items()) if path.startswith("0/"))


def test_no_thread_is_started_and_no_executor_used() -> None:
    before = threading.active_count()

    async def main() -> None:
        engine = await open_engine(PowerLossFiles(ROOT), Gate())
        part = await engine.add_partition(0)
        for t in range(30):  # several segments
            await part.append([make_record(t, 0, data=b"x" * 40)])
        await part.truncate(12)
        assert [r.transaction_id for r in await part.read_records(0, 100)] == list(range(13))
        assert threading.active_count() == before
        await engine.close()

    run(main)


def test_a_flush_is_durable_only_once_it_completed() -> None:
    async def main() -> None:
        files = PowerLossFiles(ROOT)
        gate = Gate()
        engine = await open_engine(files, gate)
        part = await engine.add_partition(0)
        await part.append([make_record(0, 0, data=b"first")])
        gate.open.clear()
        append = asyncio.ensure_future(part.append([make_record(1, 0, data=b"second")]))
        # add_partition's, the first append's two (data, then the control file), this one's
        await gate.reached(4)
        assert b"second" not in durable_data(files)
        assert not append.done()
        gate.open.set()
        await append
        assert b"second" in durable_data(files)
        await engine.close()

    run(main)


def test_a_committer_cancelled_during_the_flush_never_makes_it_durable() -> None:
    """The process dies while its flush is on the disk: the write stays in the page
    cache (a reopen finds it) but a power loss loses it."""

    async def main() -> None:
        files = PowerLossFiles(ROOT)
        gate = Gate()
        engine = await open_engine(files, gate)
        part = await engine.add_partition(0)
        await part.append([make_record(0, 0, data=b"first")])
        gate.open.clear()
        append = asyncio.ensure_future(part.append([make_record(1, 0, data=b"second")]))
        await gate.reached(4)
        committer = engine._runner._task  # type: ignore[attr-defined]
        committer.cancel()
        await asyncio.wait([committer])
        gate.open.set()
        for _ in range(10):
            await asyncio.sleep(0)
        assert not append.done()
        append.cancel()
        assert b"second" not in durable_data(files)
        assert b"second" in files.pread(
            files.open(ROOT / "0" / "0000000000000000000.seg", 0), 1 << 16, 0
        )

    run(main)


def test_appends_queued_during_a_flush_share_the_next_round() -> None:
    async def main() -> None:
        files = PowerLossFiles(ROOT)
        gate = Gate()
        engine = await open_engine(files, gate)
        parts = [await engine.add_partition(p) for p in (0, 1)]
        gate.open.clear()
        waits = gate.waits
        first = asyncio.ensure_future(parts[0].append([make_record(0, 0)]))
        await gate.reached(waits + 1)
        later = [asyncio.ensure_future(parts[0].append([make_record(t, 0)])) for t in range(1, 6)]
        later += [asyncio.ensure_future(parts[1].append([make_record(t, 1)])) for t in range(5)]
        for _ in range(10):
            await asyncio.sleep(0)
        assert gate.waits == waits + 1  # the later ones wait for the round under way
        gate.open.set()
        await asyncio.gather(first, *later)
        # the first one's data; then at once the control file covering it and the later
        # ones' data (all of them share it); then the control file covering them
        assert gate.waits == waits + 4
        assert parts[0].max_transaction_id() == 5
        assert parts[1].max_transaction_id() == 4
        await engine.close()

    run(main)
