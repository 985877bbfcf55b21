"""The fs engine with a node journal (control file format 4, feature level 3): its
checkpoints, its replay at the open, its creation when the level is raised.

A round (a group of appends of any partitions) is written to the segment files as
before and as one journal entry (:mod:`waltz_storage_fs.journal`); the journal's flush
alone makes it durable, so a round is one flush whatever the partitions it holds (the
segment files are flushed by checkpoints only; docs/performance.md, "One durable round
per storage node").

A *checkpoint* flushes every segment and index file written since the one before, writes
each partition's acknowledged end (the end of its log, durable in its segments now) and
the journal's position in the control file, flushes the control file, and frees the
ring behind that position. The committer makes one when the journal written since the
last reaches ``checkpoint_bytes`` or has no room for the next round, and before every
action (a truncation, a prefix drop, a repair, a scrub's commit, a session info update,
a partition added or removed): so a replay never crosses an action.

*Appends larger than a round.* A round takes no more than half the journal's body (a
checkpoint can always make room for it); an append larger than that on its own (a
transaction larger than the journal itself, up to the transport's frame) is no round's
and is never written to the journal: the committer runs it alone, as an action, once
everything queued before it is acknowledged and nothing is under way
(:meth:`Pipeline.write_alone <waltz_storage_fs.pipeline.Pipeline.write_alone>`): the
checkpoint before every action (every journaled round so far durable in its segments,
the ring empty), the records written to their segments, then a checkpoint again, which
flushes them, writes the partition's acknowledged end and flushes the control file (the
steps of a round at feature level 2), and only then the append is acknowledged and
readers see it. A crash before that checkpoint's control flush leaves records past the
acknowledged end, never acknowledged: the segment recovery keeps the whole ones (they
count once it wrote the end) and cuts a torn tail, as after any unflushed write;
the journal's checkpoint position is the same before and after the direct write, so the
rounds after it are replayed on top of it. Its protocol steps: the two checkpoints are
``storage.journal_checkpoint`` below, and the records written between them, not yet
flushed, ``storage.journal_direct_written``.

At the open, recovery scans the journal from the checkpoint (a ``damaged`` journal: the
node does not open, nothing is cut), runs each partition's segment recovery against the
checkpoint's acknowledged end, writes back into the segments the records the entries
hold past each partition's recovered end (the journal proves them durable), and makes a
checkpoint. What the node cannot see itself: a write lost of the very last round before a
power loss (a disk that acknowledged a flush it did not keep) looks like a torn,
unflushed round; the server's check (a replica below what it acknowledged is marked
suspect) catches it.

The steps this argument rests on are protocol points the simulation strikes (a crash,
a pause or a cut of the storage node exactly there, ``--faults points --storage-engine
fs``): ``storage.journal_round`` (a round durable in the journal alone),
``storage.journal_checkpoint`` (segments flushed, ends and position written, the ring
freed), ``storage.journal_replayed`` (records written back, not yet flushed) and
``storage.journal_direct_written`` (an append larger than a round written to its
segments, not yet flushed). The last two windows close in the same synchronous step (the
checkpoint after them): the simulation crashes the node (kill -9 or a power loss) at
once, inside the point, so that the checkpoint never runs.
"""

from __future__ import annotations

import logging

from waltz_api.errors import CorruptionError, StorageError
from waltz_api.faultpoints import point
from waltz_storage_fs import format as fmt
from waltz_storage_fs.host import JournalHost
from waltz_storage_fs.journal import (
    ALIGN,
    JOURNAL_FILE_NAME,
    Chunk,
    Journal,
    JournalScan,
    replay_plan,
)

log = logging.getLogger(__name__)


def open_journal(engine: JournalHost) -> JournalScan | None:
    """At the open (a format-4 directory): open the journal, scanned from the control
    file's checkpoint (CorruptionError: damaged, or not this cluster's)."""
    if not engine.control.keeps_journal:
        return None
    checkpoint = engine.control.read_checkpoint()
    journal, scan = Journal.open(
        engine.files, engine.directory, (checkpoint.position, checkpoint.sequence)
    )
    if journal.header.cluster_key != engine.cluster_key:
        journal.close()
        raise CorruptionError(
            f"{journal.path} belongs to cluster {journal.header.cluster_key}, the control "
            f"file to {engine.cluster_key}: restore the storage directory whole"
        )
    engine.journal = journal
    if scan.tail == "torn":
        log.info(
            "%s: the journal ends with a torn round (#%d at offset %d, never acknowledged)",
            journal.path,
            scan.sequence,
            scan.position,
        )
    return scan


def replay(engine: JournalHost, scan: JournalScan) -> None:
    """After the partitions' segment recovery: write back the records the journal holds
    past each partition's end, flushed, then checkpoint (the journal is free again)."""
    parts = {pid: part for pid, part in engine.hosted().items() if part.broken is None}
    plan = replay_plan(scan.entries, {pid: part.next_txid for pid, part in parts.items()})
    for pid, chunks in plan.items():
        part = parts[pid]
        written: set[tuple[int, int]] = set()
        for chunk in chunks:
            part.write_records(chunk.first_txid, chunk.blob, record_lengths(chunk), written)
        part.replayed()
        log.info(
            "partition %d: %d record(s) written back from the journal (ids %d..%d)",
            pid,
            sum(c.count for c in chunks),
            chunks[0].first_txid,
            part.next_txid - 1,
        )
    # written back, not flushed: the journal still holds them until the checkpoint
    point("storage.journal_replayed", partitions=len(plan))
    checkpoint(engine)


def record_lengths(chunk: Chunk) -> list[int]:
    """Each record's length in a chunk of a whole entry (each record checked)."""
    lengths: list[int] = []
    offset = 0
    for number in range(chunk.count):
        try:
            end = fmt.check_record(chunk.blob, offset, chunk.first_txid + number)
        except fmt.RecordFormatError as exc:
            raise CorruptionError(
                f"partition {chunk.partition_id}: record {chunk.first_txid + number} of a "
                f"whole journal entry is invalid ({exc}): a bug wrote it; nothing was cut: "
                "repair this node from a replica"
            ) from None
        lengths.append(end - offset)
        offset = end
    if offset != len(chunk.blob):
        raise CorruptionError(
            f"partition {chunk.partition_id}: a whole journal entry holds bytes after its "
            f"{chunk.count} record(s): a bug wrote it; repair this node from a replica"
        )
    return lengths


def checkpoint_due(engine: JournalHost, size: int) -> bool:
    journal = engine.journal
    if journal is None:
        return False
    size += ALIGN  # the entry's head, its padding
    return journal.used + size >= engine.options.checkpoint_bytes or not journal.fits(size)


def checkpoint(engine: JournalHost) -> None:
    """Make a checkpoint (committer side, nothing under way). StorageError when it
    cannot: then no partition is written until the node restarts (the journal is not
    freed, and recovery replays it)."""
    journal = engine.journal
    assert journal is not None
    if engine.journal_failed is not None:
        raise _failed(engine)
    position, sequence = journal.position, journal.sequence
    parts = [p for p in engine.hosted().values() if p.broken is None]
    try:
        for part in parts:
            part.flush_dirty()
        for part in parts:
            part.checkpoint_end()
        engine.control.write_checkpoint(position, sequence)
        engine.control.sync()
    except OSError as exc:
        # segments or ends not known durable: the ring must keep every entry since the
        # last checkpoint until recovery replays them
        engine.journal_failed = exc
        for part in parts:
            if part.broken is None:
                part.mark_broken(exc)
        raise _failed(engine) from exc
    journal.checkpointed(position)
    point("storage.journal_checkpoint", position=position, sequence=sequence)


def _failed(engine: JournalHost) -> StorageError:
    return StorageError(
        f"{engine.directory}: a journal checkpoint failed ({engine.journal_failed}); the "
        "partitions are closed: restart the storage node so that recovery replays the journal"
    )


def create_journal(engine: JournalHost) -> Journal:
    """The journal of a directory being moved to format 4 (zero-filled, flushed, its
    directory entry flushed); one left by an interrupted attempt is replaced."""
    path = engine.directory / JOURNAL_FILE_NAME
    if engine.files.exists(path):
        engine.files.unlink(path)
    return Journal.create(
        engine.files, engine.directory, engine.cluster_key, engine.options.journal_size
    )
