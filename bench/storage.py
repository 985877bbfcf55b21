"""Benchmark of the fs storage engine: durable appends, range reads, recovery, memory.

Prints figures; never a pass/fail test. Usage::

    python bench/storage.py [--dir DIR] [--seconds 3]
                            [--recovery-mb 1024 | --skip-recovery]

- Durable append records/s and MB/s at batches of 1, 10, 100 and 1000 records
  of 100 B and 1 KiB (one appender awaiting each append), beside a bare
  ``write`` + ``fdatasync`` loop writing the same bytes (records plus their
  40-byte framing) on the same disk in the same run (the physical limit),
  turn by turn (one bare flush, one append, ...), and the ratio of the two.
- The same with 4 partitions appending concurrently (group commit).
- The latency of an append (p50, p99) of one appender awaiting each, and of appends
  arriving at a steady rate on one partition whatever the answers (open loop: 500
  and 2,000 appends/s of 10 x 100 B; each arrival while a flush is under way waits
  for the next group).
- Range reads (read_records of 1000) in records/s.
- Start-up recovery time of a partition of ``--recovery-mb`` MB: with its
  index intact (scan from the last checkpoint) and with its index deleted
  (a full rescan), and the peak Python memory (tracemalloc) of each.
- Peak RSS of the process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import shutil
import tempfile
import time
import tracemalloc
import uuid
from pathlib import Path

import crc32c

from waltz_api.types import Record, ReqId
from waltz_storage_fs import format as fmt
from waltz_storage_fs.engine import FsStorageEngine

KEY = uuid.uuid4()
REQ = ReqId(1, 1, 0, 0)


def records(first: int, count: int, payload: bytes, checksum: int) -> list[Record]:
    return [Record(t, REQ, 0, payload, checksum) for t in range(first, first + count)]


async def paired(directory: Path, batch: int, size: int, seconds: float) -> tuple[float, float]:
    """(bare records/s, engine records/s), measured turn by turn.

    Each turn does one bare ``write`` + ``fdatasync`` of the bytes one batch
    takes on disk (records and their framing) in a file of its own, then one
    engine ``append`` of the batch, timing each: both see the same disk at the
    same moments (this machine's disk is shared, its latency varies a lot).
    """
    location = directory / f"paired-{batch}-{size}"
    engine = await FsStorageEngine.open(str(location), cluster_key=KEY, num_partitions=1)
    payload = os.urandom(size)
    checksum = crc32c.crc32c(payload)
    blob = os.urandom(batch * (size + fmt.RECORD_OVERHEAD))
    fd = os.open(directory / "bare.dat", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        part = await engine.add_partition(0)
        bare_time = engine_time = 0.0
        next_id = 0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            os.write(fd, blob)
            os.fdatasync(fd)
            bare_time += time.perf_counter() - started
            # making the Record objects is the caller's work (the wire decoder's)
            batch_records = records(next_id, batch, payload, checksum)
            started = time.perf_counter()
            await part.append(batch_records)
            engine_time += time.perf_counter() - started
            next_id += batch
        return next_id / bare_time, next_id / engine_time
    finally:
        os.close(fd)
        (directory / "bare.dat").unlink()
        await engine.close()
        shutil.rmtree(location)


async def engine_appends(
    directory: Path, batch: int, size: int, seconds: float, partitions: int = 1
) -> float:
    """Records/s of durable appends: time spent in ``append`` for one partition,
    wall-clock time (Record creation included) for several appending at once."""
    location = directory / f"append-{batch}-{size}-{partitions}"
    engine = await FsStorageEngine.open(str(location), cluster_key=KEY, num_partitions=partitions)
    payload = os.urandom(size)
    checksum = crc32c.crc32c(payload)
    try:
        parts = [await engine.add_partition(p) for p in range(partitions)]
        counts = [0] * partitions
        in_append = [0.0] * partitions

        async def writer(index: int) -> None:
            part = parts[index]
            deadline = time.perf_counter() + seconds
            next_id = 0
            while time.perf_counter() < deadline:
                # making the Record objects is the caller's work (the wire decoder's)
                batch_records = records(next_id, batch, payload, checksum)
                started = time.perf_counter()
                await part.append(batch_records)
                in_append[index] += time.perf_counter() - started
                next_id += batch
            counts[index] = next_id

        start = time.perf_counter()
        await asyncio.gather(*(writer(i) for i in range(partitions)))
        elapsed = time.perf_counter() - start
        if partitions == 1:
            return counts[0] / in_append[0]
        return sum(counts) / elapsed
    finally:
        await engine.close()
        shutil.rmtree(location)


async def append_latency(
    directory: Path, batch: int, size: int, seconds: float, rate: float | None = None
) -> tuple[float, float, float]:
    """(records/s, p50 ms, p99 ms) of appends to one partition: one appender awaiting
    each (``rate`` None), or one started every ``1 / rate`` s whatever the answers."""
    location = directory / f"latency-{batch}-{size}-{rate}"
    engine = await FsStorageEngine.open(str(location), cluster_key=KEY, num_partitions=1)
    payload = os.urandom(size)
    checksum = crc32c.crc32c(payload)
    latencies: list[float] = []
    try:
        part = await engine.add_partition(0)

        async def timed(first: int) -> None:
            started = time.perf_counter()
            await part.append(records(first, batch, payload, checksum))
            latencies.append(time.perf_counter() - started)

        start = time.perf_counter()
        appends = 0
        pending: list[asyncio.Future[None]] = []
        while (now := time.perf_counter()) < start + seconds:
            if rate is None:
                await timed(appends * batch)
            else:
                due = start + appends / rate
                if due > now:
                    await asyncio.sleep(due - now)
                pending.append(asyncio.ensure_future(timed(appends * batch)))
            appends += 1
        await asyncio.gather(*pending)
        elapsed = time.perf_counter() - start
        latencies.sort()
        p50 = latencies[len(latencies) // 2] * 1000
        p99 = latencies[len(latencies) * 99 // 100] * 1000
        return appends * batch / elapsed, p50, p99
    finally:
        await engine.close()
        shutil.rmtree(location)


async def range_reads(directory: Path, count: int, size: int) -> tuple[float, float]:
    """(records/s, peak traced MB) of reading ``count`` records in ranges of 1000."""
    location = directory / "reads"
    engine = await FsStorageEngine.open(str(location), cluster_key=KEY, num_partitions=1)
    payload = os.urandom(size)
    checksum = crc32c.crc32c(payload)
    try:
        part = await engine.add_partition(0)
        for first in range(0, count, 1000):
            await part.append(records(first, min(1000, count - first), payload, checksum))
        start = time.perf_counter()
        got = 0
        while got < count:
            chunk = await part.read_records(got, 1000)
            got += len(chunk)
        elapsed = time.perf_counter() - start
        # peak memory in a second pass: tracing slows Python down several times
        tracemalloc.start()
        got = 0
        while got < count:
            got += len(await part.read_records(got, 1000))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return count / elapsed, peak / 1e6
    finally:
        await engine.close()
        shutil.rmtree(location)


async def recovery(directory: Path, megabytes: int, segment_size: int) -> None:
    location = directory / "recovery"
    size = 1024
    count = megabytes * 1024 * 1024 // (size + fmt.RECORD_OVERHEAD)
    payload = os.urandom(size)
    checksum = crc32c.crc32c(payload)
    options = {"segment_size": segment_size}
    engine = await FsStorageEngine.open(
        str(location), cluster_key=KEY, num_partitions=1, options=options
    )
    start = time.perf_counter()
    try:
        part = await engine.add_partition(0)
        for first in range(0, count, 1000):
            await part.append(records(first, min(1000, count - first), payload, checksum))
        # records past the last index checkpoint, as after a crash
        await part.append(records(count, 777, payload, checksum))
    finally:
        await engine.close()
    total = count + 777
    build = time.perf_counter() - start
    on_disk = sum(f.stat().st_size for f in (location / "0").iterdir())
    print(
        f"recovery: built a partition of {total} records of 1 KiB, {on_disk / 1e6:.0f} MB on "
        f"disk, {len(list((location / '0').glob('*.seg')))} segment(s), in {build:.1f} s "
        f"({total / build:,.0f} records/s)"
    )
    for label in ("index intact (scan from the last checkpoint)", "index deleted (full rescan)"):
        if label.startswith("index deleted"):
            for index in (location / "0").glob("*.idx"):
                index.unlink()
        start = time.perf_counter()
        engine = await FsStorageEngine.open(str(location), options=options)
        elapsed = time.perf_counter() - start
        assert engine.partition(0).max_transaction_id() == total - 1
        await engine.close()
        # peak memory of the same recovery, traced (tracing slows it down)
        if label.startswith("index deleted"):
            for index in (location / "0").glob("*.idx"):
                index.unlink()
        tracemalloc.start()
        engine = await FsStorageEngine.open(str(location), options=options)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        await engine.close()
        print(
            f"recovery: {label}: open took {elapsed * 1000:,.1f} ms, "
            f"peak traced memory {peak / 1e6:.1f} MB"
        )
    shutil.rmtree(location)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--seconds", type=float, default=3.0, help="per append case")
    parser.add_argument("--recovery-mb", type=int, default=1024)
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--segment-size", type=int, default=1 << 30)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="  (log) %(levelname)s %(name)s: %(message)s")
    directory = Path(tempfile.mkdtemp(prefix="waltz-bench-storage-", dir=args.dir))
    try:
        print(f"directory: {directory} (fdatasync'd; {os.cpu_count()} CPUs)")
        print(
            f"{'batch':>6} {'size':>6} | {'bare rec/s':>12} {'bare MB/s':>10} | "
            f"{'engine rec/s':>12} {'engine MB/s':>11} | {'ratio':>6}"
        )
        for size in (100, 1024):
            for batch in (1, 10, 100, 1000):
                bare, engine = await paired(directory, batch, size, args.seconds)
                mb = size / 1e6
                print(
                    f"{batch:>6} {size:>6} | {bare:>12,.0f} {bare * mb:>10.1f} | "
                    f"{engine:>12,.0f} {engine * mb:>11.1f} | {engine / bare:>6.0%}"
                )
        for size in (100, 1024):
            concurrent = await engine_appends(directory, 100, size, args.seconds, partitions=4)
            print(
                f"4 partitions appending concurrently, batches of 100 x {size} B: "
                f"{concurrent:,.0f} records/s ({concurrent * size / 1e6:.1f} MB/s)"
            )
        for batch, offered in ((1, None), (100, None), (10, 500.0), (10, 2000.0)):
            rate, p50, p99 = await append_latency(directory, batch, 100, args.seconds, offered)
            how = "one appender" if offered is None else f"{offered:,.0f} appends/s arriving"
            print(
                f"append latency, {how}, batches of {batch} x 100 B: p50 {p50:.2f} ms, "
                f"p99 {p99:.2f} ms ({rate:,.0f} records/s)"
            )
        for size in (100, 1024):
            rate, peak = await range_reads(directory, 100_000, size)
            print(
                f"range reads (read_records of 1000) of {size} B records: {rate:,.0f} records/s, "
                f"peak traced memory {peak:.1f} MB"
            )
        if not args.skip_recovery:
            await recovery(directory, args.recovery_mb, args.segment_size)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"peak RSS of the benchmark process: {rss:.0f} MB")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
