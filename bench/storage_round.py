"""Benchmark of one durable storage round: today's fs engine against the designs of
issue 31 ("one durable round per storage node, not one per partition").

Prints figures; never a pass/fail test. Usage::

    python bench/storage_round.py [--dir DIR] [--seconds 2] [--partitions 1,4,8]
                                  [--records 1,8,64] [--designs journal,files]

A *round* makes K records of 100 B (plus their 40-byte framing and an 8-byte index
entry each) in each of P partitions durable, as one storage node's committer does for
one group of appends; rounds run back to back (one round in flight: the latency of a
round is the time an append waits for its durability). For each P and K, each design
runs in turn in slices of 0.2 s (so that they all see the same moments of this shared
disk), ``--seconds`` each in all, and prints rounds/s, records/s and the p50 / p99 of a
round's latency:

- ``a engine``: today's ``fs`` engine itself (P partitions, one append of K records
  each per round, awaited together): each touched segment file ``fdatasync``'d at once
  in its sync threads, then the control file (the acknowledged ends) flushed.
- ``a files``: the same file calls without the engine (its floor): P growing segment
  files and index files written, the P segment files ``fdatasync``'d concurrently
  (a thread each), then the control structs written and the control file
  ``fdatasync``'d.
- ``b syncfs``: group commit without a format change: the same writes, one
  ``syncfs`` for all the files, then the control flush (it must follow: an end made
  durable before its data would make a torn tail read as a lost acknowledged one).
  Durable on ext4 (it commits the journal and flushes the disk cache), but it flushes
  every dirty page of the whole file system, other processes' too.
- ``b sync_file_range``: the same with ``sync_file_range(WAIT_BEFORE | WRITE |
  WAIT_AFTER)`` per file instead of ``fdatasync``: NOT durable (it neither writes the
  file size nor flushes the disk's write cache); shown as the floor of what skipping
  the flush would give.
- ``c journal``: one shared journal file per node, preallocated and zero-filled: the
  round's records of every partition are one entry written at the journal's end and
  one ``fdatasync``; the segment (and index) files are written behind it and never
  flushed by a round; a checkpoint (every segment and index file ``fdatasync``'d, in a
  thread of its own, while the rounds go on) after each 4 MiB of the journal frees
  that part of it before it is written again.
- ``c+d journal+prealloc``: the journal with preallocated, zero-filled segment and
  index files behind it (written over from their start once full): the segments' writes
  then change no file size either, so the file system's own journal has nothing of
  theirs to commit with the journal's flush.
- ``c' journal, deferred``: the journal with the segment writes held in memory and
  done at the checkpoint only (readers would read the newest records from memory):
  between checkpoints the file system has nothing but the journal to write.
- ``d prealloc``: today's round (``a files``) over preallocated, zero-filled segment
  files, so that an ``fdatasync`` need not also write the file's size.

Every flush of a round runs in a pool thread while the round's thread waits, as the
engine's sync threads do (``--inline-flushes``: a lone flush in the round's thread): on
this loaded 2-core VM a thread that waited in ``fdatasync`` itself often woke a
scheduler tick later than one woken by another thread, which hid every other
difference.

Then the cost of one ``fdatasync`` of one appended 4 KiB block on its own: a growing
file, a file preallocated with ``fallocate`` (unwritten extents), and a zero-filled
one, each flushed by a pool thread and by the writing thread (in turn, p50 / p99).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import functools
import os
import shutil
import statistics
import struct
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import crc32c

from waltz_api.types import Record, ReqId
from waltz_storage_fs import format as fmt
from waltz_storage_fs.engine import FsStorageEngine

PAYLOAD = bytes(range(100))
RECORD_BYTES = len(PAYLOAD) + fmt.RECORD_OVERHEAD
SLICE = 0.2
PREALLOCATED = 32 << 20
"""Bytes of each preallocated file (segments and the journal); written over from the
start again once full (no size change either way)."""
CHECKPOINT_BYTES = 4 << 20
"""The journal's segments are checkpointed after each this many bytes of entries."""
CONTROL_STRUCT = 56
CHUNK = 1 << 20

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_SFR_ALL = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | WRITE | WAIT_AFTER


def syncfs(fd: int) -> None:
    if _libc.syncfs(fd) != 0:
        raise OSError(ctypes.get_errno(), "syncfs")


def sync_file_range(fd: int) -> None:
    if _libc.sync_file_range(fd, ctypes.c_int64(0), ctypes.c_int64(0), _SFR_ALL) != 0:
        raise OSError(ctypes.get_errno(), "sync_file_range")


INLINE = False
"""``--inline-flushes``: a round's thread runs a lone flush itself."""


def flush(pool: ThreadPoolExecutor, sync: Callable[[int], None], fds: list[int]) -> None:
    """Flush ``fds`` at once, each in a pool thread while the caller waits (as the
    engine's sync threads do); a lone one in the caller with ``--inline-flushes``."""
    if INLINE and len(fds) == 1:
        sync(fds[0])
        return
    for future in [pool.submit(sync, fd) for fd in fds]:
        future.result()


def zero_filled(path: Path, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    zeros = bytes(CHUNK)
    for offset in range(0, size, CHUNK):
        os.pwrite(fd, zeros, offset)
    os.fsync(fd)
    return fd


class FileRound:
    """Designs a, b and d: P segment files (and their index files) and a control file."""

    def __init__(
        self, directory: Path, partitions: int, pool: ThreadPoolExecutor, how: str
    ) -> None:
        self.pool = pool
        self.how = how
        self.partitions = partitions
        directory.mkdir()
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        if how == "prealloc":
            self.segments = [
                zero_filled(directory / f"{p}.seg", PREALLOCATED) for p in range(partitions)
            ]
        else:
            self.segments = [
                os.open(directory / f"{p}.seg", flags, 0o644) for p in range(partitions)
            ]
        self.indexes = [os.open(directory / f"{p}.idx", flags, 0o644) for p in range(partitions)]
        self.control = zero_filled(directory / "control", 4096)
        self.offsets = [0] * partitions
        self.index_offsets = [0] * partitions
        self.rounds = 0

    def write(self, blob: bytes, index: bytes) -> None:
        for p in range(self.partitions):
            if self.how == "prealloc" and self.offsets[p] + len(blob) > PREALLOCATED:
                self.offsets[p] = 0
            os.pwrite(self.segments[p], blob, self.offsets[p])
            os.pwrite(self.indexes[p], index, self.index_offsets[p])
            self.offsets[p] += len(blob)
            self.index_offsets[p] += len(index)

    def round(self, blob: bytes, index: bytes) -> None:
        self.write(blob, index)
        sync = sync_file_range if self.how == "sync_file_range" else os.fdatasync
        if self.how == "syncfs":
            flush(self.pool, syncfs, self.segments[:1])
        else:
            flush(self.pool, sync, self.segments)
        self.rounds += 1
        struct_bytes = self.rounds.to_bytes(8, "big") * (CONTROL_STRUCT // 8)
        for p in range(self.partitions):
            slot = (self.rounds & 1) * CONTROL_STRUCT
            os.pwrite(self.control, struct_bytes, 128 + p * 2 * CONTROL_STRUCT + slot)
        flush(self.pool, sync, [self.control])

    def close(self) -> None:
        for fd in [*self.segments, *self.indexes, self.control]:
            os.close(fd)


_ENTRY_HEAD = struct.Struct(">qiI")  # round, length, crc
_PART_HEAD = struct.Struct(">iqi")  # partition, first id, count


class JournalRound:
    """Design c: a shared, preallocated, zero-filled journal; segments written behind
    (``how``: ``behind`` each round, ``prealloc`` each round over preallocated segments,
    ``deferred`` only at the checkpoint, from memory)."""

    def __init__(
        self, directory: Path, partitions: int, pool: ThreadPoolExecutor, how: str
    ) -> None:
        directory.mkdir()
        self.pool = pool
        self.partitions = partitions
        self.preallocated = how == "prealloc"
        self.deferred = how == "deferred"
        self.held: list[tuple[int, bytes, bytes]] = []
        """Deferred: the segment writes not done yet."""
        self.journal = zero_filled(directory / "journal", PREALLOCATED)
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        if self.preallocated:
            self.segments = [
                zero_filled(directory / f"{p}.seg", PREALLOCATED) for p in range(partitions)
            ]
            self.indexes = [
                zero_filled(directory / f"{p}.idx", PREALLOCATED // 16) for p in range(partitions)
            ]
        else:
            self.segments = [
                os.open(directory / f"{p}.seg", flags, 0o644) for p in range(partitions)
            ]
            self.indexes = [
                os.open(directory / f"{p}.idx", flags, 0o644) for p in range(partitions)
            ]
        self.offsets = [0] * partitions
        self.index_offsets = [0] * partitions
        self.position = 0
        self.rounds = 0
        self.region = CHECKPOINT_BYTES
        self.regions = PREALLOCATED // CHECKPOINT_BYTES
        self.checkpoints: list[Future[None] | None] = [None] * self.regions
        self.checkpoint_count = 0

    def checkpoint(self, held: list[tuple[int, bytes, bytes]]) -> None:
        for p, blob, index in held:
            self.write(p, blob, index)
        for fd in self.segments:
            os.fdatasync(fd)
        for fd in self.indexes:
            os.fdatasync(fd)

    def round(self, blob: bytes, index: bytes) -> None:
        self.rounds += 1
        body = b"".join(
            _PART_HEAD.pack(p, self.offsets[p], len(index) // 8) + blob
            for p in range(self.partitions)
        )
        entry = _ENTRY_HEAD.pack(self.rounds, len(body), crc32c.crc32c(body)) + body
        current = self.position // self.region
        if (self.position + len(entry) - 1) // self.region != current:
            # leaving this region: a checkpoint frees it; the next must have been freed
            held, self.held = self.held, []
            self.checkpoints[current] = self.pool.submit(self.checkpoint, held)
            self.checkpoint_count += 1
            following = (current + 1) % self.regions
            pending = self.checkpoints[following]
            if pending is not None:
                pending.result()
            self.position = following * self.region
        os.pwrite(self.journal, entry, self.position)
        flush(self.pool, os.fdatasync, [self.journal])
        self.position += len(entry)
        for p in range(self.partitions):  # behind the journal: no flush
            if self.deferred:
                self.held.append((p, blob, index))
            else:
                self.write(p, blob, index)

    def write(self, p: int, blob: bytes, index: bytes) -> None:
        if self.preallocated and self.offsets[p] + len(blob) > PREALLOCATED:
            self.offsets[p] = self.index_offsets[p] = 0
        os.pwrite(self.segments[p], blob, self.offsets[p])
        os.pwrite(self.indexes[p], index, self.index_offsets[p])
        self.offsets[p] += len(blob)
        self.index_offsets[p] += len(index)

    def close(self) -> None:
        for pending in self.checkpoints:
            if pending is not None:
                pending.result()
        for fd in [self.journal, *self.segments, *self.indexes]:
            os.close(fd)


class EngineRound:
    """Design a, the real thing: the fs engine, P partitions, one append each a round."""

    def __init__(self, engine: FsStorageEngine, partitions: list[object], records: int) -> None:
        self.engine = engine
        self.partitions = partitions
        self.records = records
        self.next_id = 0
        self.checksum = crc32c.crc32c(PAYLOAD)

    @classmethod
    async def open(cls, directory: Path, partitions: int, records: int) -> EngineRound:
        engine = await FsStorageEngine.open(
            str(directory), cluster_key=uuid.uuid4(), num_partitions=partitions
        )
        parts = [await engine.add_partition(p) for p in range(partitions)]
        return cls(engine, list(parts), records)

    async def round(self) -> None:
        first = self.next_id
        self.next_id += self.records
        req = ReqId(1, 1, 0, 0)
        batch = [
            Record(t, req, 0, PAYLOAD, self.checksum) for t in range(first, first + self.records)
        ]
        await asyncio.gather(*(p.append(batch) for p in self.partitions))  # type: ignore[attr-defined]

    async def close(self) -> None:
        await self.engine.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def row(label: str, latencies: list[float], spent: float, per_round: int) -> str:
    rounds = len(latencies) / spent
    return (
        f"  {label:<20} {rounds:>8,.0f} {rounds * per_round:>11,.0f} "
        f"{percentile(latencies, 0.5) * 1e3:>8.2f} {percentile(latencies, 0.99) * 1e3:>8.2f}"
    )


async def one_case(
    directory: Path,
    partitions: int,
    records: int,
    seconds: float,
    pool: ThreadPoolExecutor,
    *,
    designs: set[str],
) -> None:
    blob = b"".join(
        fmt.RECORD_HEAD.pack(t, 1, 1, 0, 0, 0, len(PAYLOAD), 0) + PAYLOAD + bytes(4)
        for t in range(records)
    )
    index = bytes(8 * records)
    case = directory / f"p{partitions}-k{records}"
    case.mkdir()
    engine = await EngineRound.open(case / "engine", partitions, records)
    raw: dict[str, Callable[[], None]] = {}
    closers: list[Callable[[], None]] = []
    for how in ("files", "syncfs", "sync_file_range", "prealloc"):
        design = FileRound(case / how, partitions, pool, how)
        raw[how] = functools.partial(design.round, blob, index)
        closers.append(design.close)
    journals = {
        name: JournalRound(case / name, partitions, pool, how)
        for name, how in (
            ("journal", "behind"),
            ("journal-prealloc", "prealloc"),
            ("journal-deferred", "deferred"),
        )
    }
    for name, journal in journals.items():
        raw[name] = functools.partial(journal.round, blob, index)
        closers.append(journal.close)
    labels = {
        "engine": "a engine",
        "files": "a files",
        "syncfs": "b syncfs",
        "sync_file_range": "b sync_file_range *",
        "journal": "c journal",
        "journal-prealloc": "c+d journal+prealloc",
        "journal-deferred": "c' journal, deferred",
        "prealloc": "d prealloc",
    }
    labels = {name: label for name, label in labels.items() if not designs or name in designs}
    latencies: dict[str, list[float]] = {name: [] for name in labels}
    spent = dict.fromkeys(labels, 0.0)
    try:
        names = list(labels)
        for turn in range(max(1, round(seconds / SLICE))):
            # each design in turn, starting with another one each time (what one leaves
            # behind, dirty pages or a busy disk, falls on each of the others alike)
            for name in names[turn % len(names) :] + names[: turn % len(names)]:
                end = time.perf_counter() + SLICE
                started = time.perf_counter()
                while started < end:
                    if name == "engine":
                        await engine.round()
                    else:
                        raw[name]()
                    done = time.perf_counter()
                    latencies[name].append(done - started)
                    started = done
        for name in labels:
            spent[name] = sum(latencies[name])
        print(f"P={partitions} partitions, K={records} records each per round")
        for name, label in labels.items():
            print(row(label, latencies[name], spent[name], partitions * records))
        counts = ", ".join(
            f"{labels[n]} {j.checkpoint_count}" for n, j in journals.items() if n in labels
        )
        print(f"  (checkpoints: {counts})")
    finally:
        await engine.close()
        for close in closers:
            close()
        shutil.rmtree(case, ignore_errors=True)


def flush_cost(directory: Path, seconds: float, pool: ThreadPoolExecutor) -> None:
    """One 4 KiB block appended and ``fdatasync``'d: growing, fallocate'd, zero-filled;
    each flushed by a pool thread and by the writing thread itself."""
    block = os.urandom(4096)
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    growing = os.open(directory / "growing", flags, 0o644)
    fallocated = os.open(directory / "fallocated", flags, 0o644)
    os.posix_fallocate(fallocated, 0, PREALLOCATED)
    os.fsync(fallocated)
    zeroed = zero_filled(directory / "zeroed", PREALLOCATED)
    fds = {"growing file": growing, "fallocate'd": fallocated, "zero-filled": zeroed}
    offsets = dict.fromkeys(fds, 0)
    times: dict[tuple[str, bool], list[float]] = {
        (name, inline): [] for name in fds for inline in (False, True)
    }
    deadline = time.perf_counter() + seconds * len(times)
    while time.perf_counter() < deadline:
        for (name, inline), spent in times.items():
            fd = fds[name]
            if offsets[name] + len(block) > PREALLOCATED:
                offsets[name] = 0
            started = time.perf_counter()
            os.pwrite(fd, block, offsets[name])
            if inline:
                os.fdatasync(fd)
            else:
                pool.submit(os.fdatasync, fd).result()
            spent.append(time.perf_counter() - started)
            offsets[name] += len(block)
    print("one 4 KiB block written and fdatasync'd (in turn):")
    for (name, inline), values in times.items():
        how = "by the writer" if inline else "by a pool thread"
        print(
            f"  {name:<14} {how:<17} p50 {statistics.median(values) * 1e3:.2f} ms, "
            f"p99 {percentile(values, 0.99) * 1e3:.2f} ms ({len(values)} flushes)"
        )
    for fd in fds.values():
        os.close(fd)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--seconds", type=float, default=2.0, help="per design and case")
    parser.add_argument("--partitions", default="1,4,8")
    parser.add_argument("--records", default="1,8,64")
    parser.add_argument(
        "--designs",
        default="",
        help="only these (comma-separated: engine, files, syncfs, sync_file_range, journal, "
        "journal-prealloc, journal-deferred, prealloc; default all)",
    )
    parser.add_argument("--skip-flush-cost", action="store_true")
    parser.add_argument(
        "--inline-flushes",
        action="store_true",
        help="a round's thread runs a lone flush itself (default: a pool thread runs it)",
    )
    args = parser.parse_args()
    global INLINE  # noqa: PLW0603
    INLINE = args.inline_flushes
    designs = set(filter(None, args.designs.split(",")))
    directory = Path(tempfile.mkdtemp(prefix="waltz-bench-round-", dir=args.dir))
    pool = ThreadPoolExecutor(max_workers=16)
    try:
        load = os.getloadavg()
        print(
            f"{time.strftime('%Y-%m-%d %H:%M')}, {directory}, {os.cpu_count()} CPUs, "
            f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
        )
        print(
            f"  {'design':<20} {'rounds/s':>8} {'records/s':>11} {'p50 ms':>8} {'p99 ms':>8}"
            "   (* not durable)"
        )
        for partitions in map(int, args.partitions.split(",")):
            for records in map(int, args.records.split(",")):
                await one_case(directory, partitions, records, args.seconds, pool, designs=designs)
        if not args.skip_flush_cost:
            flush_cost(directory, args.seconds, pool)
        load = os.getloadavg()
        print(f"load at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    finally:
        pool.shutdown()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
