"""Tiered storage with real processes (docs/archive.md): three ``waltz storage``
processes (fs engine, small segments), one ``waltz server`` archiving its partition,
the local coordination, ZeroMQ, and the archive in a local directory or on a real
S3-compatible server (moto's, started on loopback, driven through s3fs).

- A local directory and S3 (the same test on each): archive under load, the replicas
  delete their archived segments, a client mounting from 0 gets the whole log exactly
  once and in order, an archived transaction's data is fetched, a range read crosses
  the seam; a replica added after archiving starts at the archive mark (never holds id
  0); a storage node wiped and restored (`waltz archive restore --storage-node`) starts
  at the mark and catches up; `waltz archive status` and `verify`.
- A whole cluster lost (storage nodes and coordination) and restored from the archive
  alone (`waltz archive restore --url` before the new cluster's servers start); the
  client library's feed from 0 and its lazy data fetch read that archived log.
- S3: archive under load, the archive frozen mid-run (appends go on, nothing is
  deleted, the mark stays), then back (archiving resumes); an archived object
  corrupted in the bucket is reported, with its range and name, by `waltz archive
  verify` and by the server's read.
- Metrics (the storage nodes and the server in this loop, /metrics over HTTP): the
  archive mark, lag, local bytes, records and bytes archived say what the archive and
  the replicas hold; a new owner's reads below the mark are timed; the archive
  directory replaced by a file mid-run: failures counted, appends go on, the mark
  stays, nothing deleted, then archiving resumes.
- A cluster restored from the archive of a lost one whose server uploaded a range and
  died before its manifest (issue 28): the restore sets the range aside, the new
  cluster's archiver sets aside the same upload arriving late, and the archive serves
  the new cluster's records above the restored mark.

About 65 s for the seven on the loaded 2-core machine (each S3 one 5-14 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from waltz_api.cluster import ArchiveMark
from waltz_api.messages import (
    ErrorResponse,
    RangeReadRequest,
    TransactionDataRequest,
    TransactionDataResponse,
)
from waltz_api.types import ReqId
from waltz_archive import layout
from waltz_archive.store import ArchiveStore
from waltz_archive.testing import S3Server
from waltz_archive.tools import load_manifest
from waltz_client import AsyncWaltzClient, ClientConfig, Transaction, WaltzClientCallbacks
from waltz_conformance.suites.system.clients import PartitionClient, read_log
from waltz_conformance.suites.system.harness import SystemHarness, wait_for
from waltz_server.observability import http_get
from waltz_server.server.replica import LocalLog
from waltz_server.server.testing import RawClient

pytestmark = [pytest.mark.timeout(600), pytest.mark.system]

PARTITION = 0
DEADLINE = 120.0
LABEL = f'{{partition="{PARTITION}"}}'


def archive_settings(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "archive": {
            "url": url,
            "min_range_bytes": 1,
            "max_range_bytes": 6_000,
            "max_local_bytes": 0,
            "max_local_age": 0,
            "keep_local_transactions": 60,
            "row_group_bytes": 4096,
            "interval": 0.2,
            "timeout": 5.0,
            "cache_bytes": 200_000,
            **extra,
        }
    }


def harness(tmp_path: Path, url: str, processes: bool = True, **extra: Any) -> SystemHarness:
    return SystemHarness.of_processes(
        tmp_path,
        "archive",
        processes=processes,
        num_servers=1,
        storage_options={"segment_size": 4096, "index_checkpoint_interval": 8},
        server_settings=archive_settings(url, **extra),
    )


def payload(tag: str, i: int) -> bytes:
    return f"{tag}-{i}|".encode() * (3 + i % 7)


async def commit(client: PartitionClient, tag: str, count: int) -> int:
    """Commit ``count`` records, 20 per flush; returns the high-water mark."""
    return await client.commit((payload(tag, i) for i in range(count)), 20)


async def mark(h: SystemHarness) -> ArchiveMark:
    assert h.metadata is not None
    return (await h.metadata.archive_mark(PARTITION)).value


async def local_log(h: SystemHarness, index: int) -> tuple[int, int]:
    """(log start, max id) of a storage node's replica, from its admin command."""
    from waltz_storage_node import StorageAdminClient

    client = await h.storage_client(index)
    try:
        found = await StorageAdminClient(client).local_log(PARTITION)
    finally:
        await client.close()
    return found.log_start, found.max_transaction_id


async def waltz(h: SystemHarness, *args: str) -> subprocess.CompletedProcess[str]:
    """``waltz archive ...`` in its own process (in a thread: the loop, and the harness's
    coordination session, go on meanwhile)."""
    command = [sys.executable, "-m", "waltz_cli", "archive", *args]
    return await asyncio.to_thread(
        subprocess.run,
        [*command, "--coordination", h.coordination_uri],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
    )


def marked(pattern: str, output: str) -> int:
    """The id a command's output names (``pattern`` has one group)."""
    found = re.search(pattern, output)
    assert found is not None, f"{pattern!r} not in {output!r}"
    return int(found.group(1))


async def everything_in_order(h: SystemHarness, high: int, expected: dict[int, bytes]) -> None:
    """A client mounting from 0 gets each id once, in order; a range read from 0 gets
    the same records; a lazy data fetch of an archived transaction works."""
    client = await PartitionClient.connect(h, PARTITION, -1)
    try:
        feed = await client.feed_until(high)
        ids = [f.transaction_id for f in feed]
        assert ids[: high + 1] == list(range(high + 1)), "not every id once and in order"
        assert client.raw is not None
        await client.raw.send(TransactionDataRequest(client.rid(), 3))
        (answer,) = await client.raw.wait(TransactionDataResponse, timeout=DEADLINE)
        assert answer.success and answer.data == expected[3], answer
    finally:
        await client.close()
    records = await read_log(h, PARTITION)
    assert [r.transaction_id for r in records[: high + 1]] == list(range(high + 1))
    for record in records[: high + 1]:
        if record.transaction_id in expected:
            assert record.data == expected[record.transaction_id]


@pytest.mark.parametrize("where", ["directory", "s3"])
async def test_archive_with_new_and_wiped_replicas(tmp_path: Path, where: str) -> None:
    with contextlib.ExitStack() as stack:
        if where == "s3":
            s3 = stack.enter_context(S3Server(tmp_path / "s3"))
            s3.create_bucket("waltz-archive")
            url, options = s3.url("waltz-archive"), s3.storage_options
        else:
            url, options = f"file://{tmp_path / 'archive'}", {}
        await new_and_wiped_replicas(tmp_path, url, options)


async def new_and_wiped_replicas(tmp_path: Path, url: str, options: dict[str, Any]) -> None:
    h = harness(tmp_path, url, storage_options=options)
    await h.start()
    try:
        client = await PartitionClient.connect(h, PARTITION, None)
        high = await commit(client, "load", 500)
        expected = {i: payload("load", i) for i in range(500)}
        assert high == 499

        async def archived() -> bool:
            starts = [(await local_log(h, i))[0] for i in range(3)]
            return (await mark(h)).mark >= 400 and all(start > 0 for start in starts)

        await wait_for(
            archived, DEADLINE, "the archive mark to pass 400 and every replica to delete"
        )
        current = await mark(h)
        assert current.url == url and current.ranges >= 2
        for i in range(3):
            start, top = await local_log(h, i)
            assert 0 < start <= current.mark + 1 and top == high
        await everything_in_order(h, high, expected)

        # a replica added after archiving starts at the archive mark, never at 0
        added = await h.add_storage_node()
        await h.add_replica(PARTITION, added)
        await h.wait_replica_set(PARTITION)
        high = await commit(client, "more", 40)

        async def added_caught_up() -> bool:
            start, top = await local_log(h, added)
            return top == high and start > 0

        await wait_for(added_caught_up, DEADLINE, "the added replica to catch up")
        assert (await local_log(h, added))[0] > 0

        # a storage node loses its disk; restored from the archive, then caught up
        await h.kill_storage_node(0)
        h.wipe_storage(0)
        await h.restart_storage_node(0)
        before = (await mark(h)).mark  # the archiver goes on meanwhile
        restored = await waltz(h, "restore", "--storage-node", h.storage_nodes[0])
        assert restored.returncode == 0, restored.stderr
        assert before <= marked(r"starts at the archive mark (\d+)", restored.stdout)
        assert marked(r"starts at the archive mark (\d+)", restored.stdout) <= (await mark(h)).mark
        high = await commit(client, "after", 40)

        async def wiped_caught_up() -> bool:
            start, top = await local_log(h, 0)
            return top == high and start > 0

        await wait_for(wiped_caught_up, DEADLINE, "the restored node to catch up")

        reach = ("--storage-options", json.dumps(options))
        before = (await mark(h)).mark
        status = await waltz(h, "status", *reach)
        assert status.returncode == 0, status.stderr
        assert before <= marked(r"archived 0\.\.(\d+)", status.stdout) <= (await mark(h)).mark
        verified = await waltz(h, "verify", *reach)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert ": ok" in verified.stdout
        await client.close()
    finally:
        await h.close()


class Applied(WaltzClientCallbacks):
    """A client application's callbacks: every transaction the feed delivers, kept."""

    def __init__(self) -> None:
        self.transactions: list[Transaction] = []

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.transactions[-1].transaction_id if self.transactions else -1

    def apply_transaction(self, transaction: Transaction) -> None:
        self.transactions.append(transaction)


async def the_client_library_reads(h: SystemHarness, high: int, expected: dict[int, bytes]) -> None:
    """The client library (``AsyncWaltzClient``) mounting from the start: its feed gets
    every id once and in order, and the lazy data fetch of archived transactions works."""
    applied = Applied()
    config = ClientConfig(h.coordination_uri, transport="zmq", partitions=[PARTITION])
    async with AsyncWaltzClient(applied, config):

        async def caught_up() -> bool:
            return applied.client_high_water_mark(PARTITION) >= high

        await wait_for(caught_up, DEADLINE, "the client's feed to reach the high-water mark")
        ids = [t.transaction_id for t in applied.transactions]
        assert ids[: high + 1] == list(range(high + 1))
        for transaction_id in (0, high // 2, high):
            data = await applied.transactions[transaction_id].fetch_data()
            assert data == expected[transaction_id], transaction_id


async def test_a_whole_cluster_lost_is_restored_from_the_archive(tmp_path: Path) -> None:
    """Every storage node and the coordination service are lost; a new cluster gets the
    archive's marks from `waltz archive restore --url` before its servers start, then
    serves the archived log (a client mounting from 0, a data fetch, range reads) and
    appends after the mark, its new replicas starting there."""
    archive_url = f"file://{tmp_path / 'archive'}"
    old = harness(tmp_path, archive_url)
    await old.start()
    try:
        client = await PartitionClient.connect(old, PARTITION, None)
        await commit(client, "old", 300)

        async def archived() -> bool:
            starts = [(await local_log(old, i))[0] for i in range(3)]
            return (await mark(old)).mark >= 200 and all(start > 0 for start in starts)

        await wait_for(archived, DEADLINE, "the old cluster to archive and delete")
        lost = await mark(old)
        await client.close()
    finally:
        await old.close()  # the disaster: storage nodes and coordination gone

    async def restore(h: SystemHarness) -> None:
        restored = await waltz(h, "restore", "--url", archive_url)
        assert restored.returncode == 0, restored.stdout + restored.stderr
        assert f"partition {PARTITION}: starts at the archive mark {lost.mark}" in (restored.stdout)

    new = old.sibling("restored", before_servers=restore)
    await new.start()
    try:
        current = await mark(new)
        assert (current.mark, current.manifest) == (lost.mark, lost.manifest)
        expected = {i: payload("old", i) for i in range(lost.mark + 1)}
        await everything_in_order(new, lost.mark, expected)
        await the_client_library_reads(new, lost.mark, expected)
        client = await PartitionClient.connect(new, PARTITION, None)
        high = await commit(client, "new", 40)
        assert high == lost.mark + 40
        for i in range(3):
            start, top = await local_log(new, i)
            assert start == lost.mark + 1 and top == high
        records = await read_log(new, PARTITION)
        assert [r.transaction_id for r in records] == list(range(high + 1))
        assert records[lost.mark + 1].data == payload("new", 0)
        again = await waltz(new, "restore", "--url", archive_url)
        assert again.returncode != 0 and "already has a log" in again.stderr
        await client.close()
    finally:
        await new.close()


async def test_archive_on_s3_survives_an_unreachable_and_a_corrupting_archive(
    tmp_path: Path,
) -> None:
    with S3Server(tmp_path / "s3") as s3:
        s3.create_bucket("waltz-archive")
        url = s3.url("waltz-archive")
        h = harness(tmp_path, url, storage_options=s3.storage_options, timeout=2.0)
        await h.start()
        try:
            client = await PartitionClient.connect(h, PARTITION, None)
            high = await commit(client, "one", 300)

            async def archived_past(at_least: int) -> bool:
                return (await mark(h)).mark >= at_least and (await local_log(h, 1))[0] > 0

            await wait_for(lambda: archived_past(200), DEADLINE, "archiving to S3")

            # the archive freezes: appends go on, the mark stays, nothing is deleted
            s3.pause()
            try:
                loop = asyncio.get_running_loop()
                started = loop.time()
                high = await commit(client, "two", 300)
                took = loop.time() - started
                assert high == 599
                frozen = await mark(h)  # (a round in flight when it froze may have ended)
                server_log = tmp_path / "server0.log"

                def failures() -> int:
                    return server_log.read_text(errors="replace").count("archiving failed")

                seen = failures()

                async def two_more_failed() -> bool:  # the second began after `frozen`
                    return failures() >= seen + 2

                await wait_for(two_more_failed, DEADLINE, "rounds to meet the frozen archive")
                assert (await mark(h)).mark == frozen.mark
                for i in range(3):  # nothing above the mark deleted, everything else held
                    start, top = await local_log(h, i)
                    assert start <= frozen.mark + 1 and top == high
                assert "nothing is deleted" in server_log.read_text(errors="replace")
            finally:
                s3.resume()
            await wait_for(lambda: archived_past(500), DEADLINE, "archiving to resume")
            assert took < DEADLINE, f"300 appends took {took:.1f}s while the archive was frozen"
            await everything_in_order(
                h,
                high,
                {i: payload("one", i) for i in range(300)}
                | {300 + i: payload("two", i) for i in range(300)},
            )

            # an archived object corrupted in the bucket: reported with range and name
            current = await mark(h)
            store = ArchiveStore(url, s3.storage_options)
            first = load_manifest(store, PARTITION, current.manifest).ranges[0]
            fs = s3.filesystem()
            key = store.path("partition-0", first.name)
            raw = bytearray(fs.cat_file(key))
            raw[len(raw) // 3 : len(raw) // 3 + 40] = bytes(40)
            fs.pipe_file(key, bytes(raw))
            verified = await waltz(h, "verify", "--storage-options", json.dumps(s3.storage_options))
            assert verified.returncode == 1
            assert (
                first.name in verified.stdout and f"{first.first}..{first.last}" in verified.stdout
            )
            # the server reads it with a fresh cache: its answer names range and object
            old_id, _, old_generation = await h.owner(PARTITION)
            await h.kill_server(0)
            await h.restart_server(0)
            await h.wait_moved(PARTITION, old_id, old_generation)
            _, endpoint, generation = await h.owner(PARTITION)
            assert h.client_transport is not None
            raw_client = await RawClient.connect(h.client_transport, endpoint, "checker")
            try:
                await raw_client.send(
                    RangeReadRequest(ReqId(998, generation, PARTITION, 1), first.first, 10, 1 << 20)
                )
                (error,) = await raw_client.wait(ErrorResponse, timeout=DEADLINE)
                assert (
                    first.name in error.message and f"{first.first}..{first.last}" in error.message
                )
            finally:
                await raw_client.close()
            await client.close()
        finally:
            await h.close()


def metric(text: str, name: str, labels: str = "") -> float | None:
    """One sample's value in Prometheus text (None when absent)."""
    found = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


async def scrape(h: SystemHarness) -> str:
    running = h.servers[0].running  # type: ignore[attr-defined]
    assert running is not None and running.http is not None
    return (await http_get(f"{running.http.url}/metrics")).body


async def local_logs(h: SystemHarness) -> list[LocalLog]:
    from waltz_storage_node import StorageAdminClient

    found = []
    for index in range(len(h.storage)):
        client = await h.storage_client(index)
        try:
            found.append(await StorageAdminClient(client).local_log(PARTITION))
        finally:
            await client.close()
    return found


async def test_archive_metrics_and_an_archive_that_goes_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WALTZ_HTTP__ENABLED", "true")  # /metrics, on a free port
    archive = tmp_path / "archive"
    h = harness(tmp_path, f"file://{archive}", processes=False)
    await h.start()
    try:
        client = await PartitionClient.connect(h, PARTITION, None)
        high = await commit(client, "load", 500)
        appended = sum(len(payload("load", i)) for i in range(500))

        scraped = ""

        async def settled() -> bool:
            # archived and deleted, and every archive metric says what the archive and the
            # replicas hold (read together: the archiver may still be going)
            nonlocal scraped
            m = await mark(h)
            logs = await local_logs(h)
            scraped = await scrape(h)
            return (
                m.mark >= 400
                and all(found.log_start > 0 for found in logs)
                and metric(scraped, "waltz_server_archive_mark", LABEL) == m.mark
                and metric(scraped, "waltz_server_archive_lag", LABEL) == high - m.mark
                and metric(scraped, "waltz_server_archived_records_total", LABEL) == m.mark + 1
                and metric(scraped, "waltz_server_archived_bytes_total", LABEL) == m.archived_bytes
                and metric(scraped, "waltz_server_archive_local_bytes", LABEL)
                in {found.local_bytes for found in logs}
                and m == await mark(h)
            )

        await wait_for(settled, DEADLINE, "the archive to settle and its metrics to say so")
        local_bytes = metric(scraped, "waltz_server_archive_local_bytes", LABEL)
        assert local_bytes is not None and 0 < local_bytes < appended
        assert metric(scraped, "waltz_server_archive_failures_total", LABEL) in (None, 0.0)
        await client.close()

        # a new owner (its caches empty): a client mounting from 0, a data fetch and range
        # reads below the mark are served from the archive, and timed
        old_id, _, old_generation = await h.owner(PARTITION)
        await h.kill_server(0)
        restarted_at = (await mark(h)).mark  # nothing archives until the new owner runs
        await h.restart_server(0)
        await h.wait_moved(PARTITION, old_id, old_generation)
        assert metric(await scrape(h), "waltz_server_archive_read_latency_seconds_count") in (
            None,
            0.0,
        )
        await everything_in_order(h, high, {i: payload("load", i) for i in range(500)})
        text = await scrape(h)
        assert (metric(text, "waltz_server_archive_read_latency_seconds_count") or 0) > 0
        assert (metric(text, "waltz_server_archive_read_latency_seconds_sum") or 0) > 0
        client = await PartitionClient.connect(h, PARTITION, None)

        # the archive goes away (its directory replaced by a file)
        away = tmp_path / "archive-away"
        archive.rename(away)
        archive.write_bytes(b"not a directory")
        try:
            frozen = (await mark(h)).mark
            starts = [found.log_start for found in await local_logs(h)]
            high = await commit(client, "more", 300)  # appends go on
            assert high == 799

            async def failed_rounds() -> bool:
                found = metric(await scrape(h), "waltz_server_archive_failures_total", LABEL)
                return found is not None and found >= 3

            await wait_for(failed_rounds, DEADLINE, "three archive rounds to fail")
            assert (await mark(h)).mark == frozen  # the mark stays
            logs = await local_logs(h)
            assert [found.log_start for found in logs] == starts  # nothing deleted
            assert all(found.max_transaction_id == high for found in logs)
        finally:
            archive.unlink()
            away.rename(archive)

        async def resumed() -> bool:
            logs = await local_logs(h)
            return (await mark(h)).mark >= 700 and all(
                found.log_start > start for found, start in zip(logs, starts, strict=True)
            )

        await wait_for(resumed, DEADLINE, "archiving and deletion to resume")

        async def counted() -> bool:  # this server's counters started at 0
            m = (await mark(h)).mark
            found = metric(await scrape(h), "waltz_server_archived_records_total", LABEL)
            return found == m - restarted_at and m == (await mark(h)).mark

        await wait_for(counted, DEADLINE, "the records archived here to be counted")
        await client.close()
    finally:
        await h.close()


def ranges_in(archive: Path) -> list[layout.RangeName]:
    """The range objects of the partition's directory (not those set aside)."""
    directory = archive / f"partition-{PARTITION}"
    found = [layout.RangeName.parse(p.name) for p in directory.glob("*.parquet")]
    return sorted((r for r in found if r is not None), key=lambda r: (r.first, r.last))


async def test_a_restored_cluster_never_serves_the_lost_clusters_orphan(tmp_path: Path) -> None:
    """Issue 28 with real processes. The cluster's server uploads a range and dies before
    writing its manifest (the archive's manifest directory replaced by a file: every
    round uploads, or adopts, the range, then fails), and the whole cluster is lost. A
    new cluster with the same cluster key is restored from the archive (`waltz archive
    restore --url`): the range above the mark is set aside. The lost server's upload
    arrives once more after the restore (a copy under a new name: a server that was
    still running). The new cluster commits other records above the mark; its archiver
    sets that object aside, archives its own, and the archive serves the new cluster's
    records, not the lost one's."""
    archive = tmp_path / "archive"
    url = f"file://{archive}"
    old = harness(tmp_path, url)
    manifests = archive / f"partition-{PARTITION}" / "manifest"
    held = tmp_path / "manifests-held"
    await old.start()
    try:
        client = await PartitionClient.connect(old, PARTITION, None)
        await commit(client, "old", 300)
        await wait_for(
            lambda: archived_to(old, 150), DEADLINE, "the old cluster to archive past 150"
        )
        manifests.rename(held)
        manifests.write_bytes(b"no manifest can be written from now on")
        server_log = tmp_path / "server0.log"
        failed_before = server_log.read_text(errors="replace").count("archiving failed")
        await commit(client, "more", 200)

        async def uploaded_without_manifest() -> bool:
            failed = server_log.read_text(errors="replace").count("archiving failed")
            top = (await mark(old)).mark
            return failed >= failed_before + 2 and any(
                r.first == top + 1 for r in ranges_in(archive)
            )

        await wait_for(uploaded_without_manifest, DEADLINE, "a range uploaded with no manifest")
        lost = await mark(old)
        await client.close()
    finally:
        await old.close()  # the disaster: storage nodes, server and coordination gone
    manifests.unlink()
    held.rename(manifests)
    orphans = [r for r in ranges_in(archive) if r.first > lost.mark]
    assert orphans and orphans[0].first == lost.mark + 1
    orphan = orphans[0]
    late = layout.RangeName(orphan.first, orphan.last, "1a7e0000")
    uploaded = (archive / f"partition-{PARTITION}" / orphan.name).read_bytes()

    restored_output: list[str] = []

    async def restore(h: SystemHarness) -> None:
        restored = await waltz(h, "restore", "--url", url)
        assert restored.returncode == 0, restored.stdout + restored.stderr
        restored_output.append(restored.stdout)
        # the lost server's upload, once more after the restore
        (archive / f"partition-{PARTITION}" / late.name).write_bytes(uploaded)

    # the new cluster keeps more ids local than the orphan holds: its first range can
    # only be planned once the orphan lies below its high-water mark (so it is looked at)
    keep = orphan.last - lost.mark + 20
    new = old.sibling(
        "restored",
        before_servers=restore,
        cluster_key=old.cluster_key,
        server_settings=archive_settings(url, keep_local_transactions=keep),
    )
    await new.start()
    try:
        assert f"starts at the archive mark {lost.mark}" in restored_output[0]
        client = await PartitionClient.connect(new, PARTITION, None)
        count = orphan.last - lost.mark + keep + 60
        high = await commit(client, "new", count)
        assert high == lost.mark + count
        await wait_for(
            lambda: archived_to(new, orphan.last), DEADLINE, "the new cluster to archive"
        )
        records = await read_log(new, PARTITION)
        assert [r.transaction_id for r in records] == list(range(high + 1))
        above = records[lost.mark + 1 : orphan.last + 1]
        wrong = [
            r.transaction_id
            for i, r in enumerate(above)
            if r.data != payload("new", i)  # the i-th record the new cluster committed
        ]
        assert not wrong, (
            f"{len(wrong)} of {len(above)} archived ids served the lost cluster's records "
            f"(id {wrong[0]}: {records[wrong[0]].data[:16]!r} where "
            f"{payload('new', wrong[0] - lost.mark - 1)[:16]!r} was committed)"
        )
        assert [r.data for r in records[: lost.mark + 1]] == [
            payload("old", i) for i in range(lost.mark + 1)
        ]
        current = await mark(new)
        manifest = load_manifest(ArchiveStore(url), PARTITION, current.manifest)
        assert {r.name for r in manifest.ranges}.isdisjoint({orphan.name, late.name})
        set_aside = archive / f"partition-{PARTITION}" / layout.SET_ASIDE_DIR
        assert (set_aside / orphan.name).exists() and (set_aside / late.name).exists()
        assert "set aside" in restored_output[0] and orphan.name in restored_output[0]
        new_log = (tmp_path / "restored" / "server0.log").read_text(errors="replace")
        assert f"{late.name} is not this cluster's log and is never adopted" in new_log
        verified = await waltz(new, "verify")
        assert verified.returncode == 0, verified.stdout + verified.stderr
        await client.close()
    finally:
        await new.close()


async def archived_to(h: SystemHarness, at_least: int) -> bool:
    return (await mark(h)).mark >= at_least


def test_a_restore_sets_aside_on_s3(tmp_path: Path) -> None:
    """On an object store (moto's S3, through s3fs) a restore's set-aside moves every
    range object starting above the mark and every manifest above it under set-aside/
    (copied, then deleted), and never onto an existing name."""
    from waltz_api.errors import ArchiveError
    from waltz_archive.manifest import Manifest
    from waltz_archive.objects import RangeWriter, WriteOptions
    from waltz_archive.records import records_to_batch
    from waltz_archive.tools import set_aside_above
    from waltz_conformance.records import make_record

    with S3Server(tmp_path / "s3") as s3:
        s3.create_bucket("waltz-archive")
        store = ArchiveStore(s3.url("waltz-archive"), s3.storage_options)
        directory = layout.partition_dir(PARTITION)
        ranges = []
        for first in (0, 10, 20):
            writer = RangeWriter(store, PARTITION, first, WriteOptions())
            writer.add(*records_to_batch([make_record(t) for t in range(first, first + 10)]))
            ranges.append(writer.finish()[0])
        manifests = []
        manifest = Manifest(PARTITION)
        for archived in ranges[:2]:
            manifest = manifest.extended(archived, "")
            name = layout.ManifestName(manifest.mark, layout.new_token()).name
            store.write_bytes(store.path(directory, name), manifest.encode())
            manifests.append(name)
        moved = set_aside_above(store, PARTITION, 9)
        assert sorted(moved) == sorted([ranges[1].name, ranges[2].name, manifests[1]])
        parquet = [n for n in store.list(store.path(directory)) if n.endswith(".parquet")]
        assert parquet == [ranges[0].name]
        assert store.list(store.path(directory, layout.MANIFEST_DIR)) == [
            manifests[0].rsplit("/", 1)[-1]
        ]
        for name in moved:
            assert store.exists(store.path(directory, layout.set_aside(name)))
        again = store.path(directory, layout.set_aside(ranges[1].name))
        with pytest.raises(ArchiveError, match="exists already"):
            store.move(store.path(directory, ranges[0].name), again)
        assert store.exists(store.path(directory, ranges[0].name))
