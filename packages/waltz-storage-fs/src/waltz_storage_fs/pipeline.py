"""The committer's logic (:class:`Pipeline`), shared by its runners
(:mod:`waltz_storage_fs.committer` describes both): the jobs, a group's write step and
what each flush's end makes known; and what it asks of the engine and of a partition
(:class:`EnginePort`, :class:`PartitionPort`)."""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from waltz_api.errors import StorageError
from waltz_api.faultpoints import point
from waltz_storage_fs.control import ControlFile
from waltz_storage_fs.files import Files
from waltz_storage_fs.journal import Chunk, Journal
from waltz_storage_fs.views import View

log = logging.getLogger(__name__)

DATA, INDEX, JOURNAL = 0, 1, 2
"""The kinds of file a group flushes (data files first; the journal alone at format 4)."""

Result = tuple["Job", BaseException | None]


class PartitionPort(Protocol):
    """What the committer asks of a partition
    (:class:`waltz_storage_fs.partition.FsStoragePartition`)."""

    broken: OSError | None
    partition_id: int

    def broken_error(self) -> StorageError: ...
    def mark_broken(self, exc: OSError) -> None: ...
    def write_batch(self, job: Job, flushes: set[tuple[int, int]]) -> None: ...
    def publish(self) -> None: ...
    def note_flushed(self) -> None: ...
    def stage_acked_end(self) -> bool: ...
    def take_flushed_view(self) -> View | None: ...
    def publish_view(self, view: View) -> None: ...


class EnginePort(Protocol):
    """What the committer asks of the engine
    (:class:`waltz_storage_fs.engine.FsStorageEngine`)."""

    directory: Path
    control: ControlFile
    files: Files
    fsync_observer: Callable[[float], None] | None
    journal: Journal | None
    journal_failed: OSError | None

    def close_partitions(self, error: OSError) -> None: ...
    def checkpoint_due(self, size: int) -> bool: ...
    def checkpoint(self) -> None: ...


@dataclass
class Job:
    future: asyncio.Future[None]
    partition: PartitionPort | None = None
    blob: bytes = b""
    lengths: list[int] = field(default_factory=list)
    first_txid: int = 0
    action: Callable[[], None] | None = None


JOB_OVERHEAD = 64
"""The bytes of a journal entry an append costs beyond its records (its chunk's head and
a share of the entry's head and padding), counted by the group's cap."""

STOP = None
"""Queued after the last job: the committer ends once it is reached."""


# -- the logic, shared ------------------------------------------------------------------


@dataclass(slots=True)
class Written:
    """A group after its write step: what to flush, and what is known already."""

    results: list[Result]
    """Appends refused before their flush (a partition closed by an error)."""
    done: list[Job]
    """Appends written, waiting for their flush (then for the control flush covering them)."""
    syncs: list[tuple[PartitionPort, int, int]]
    """(partition, kind, fd) of every file to flush."""
    fds: list[int]
    """The files to flush (the fds of ``syncs``)."""
    touched: list[PartitionPort]
    """The partitions written (each publishes its records once they are acknowledged)."""


@dataclass(slots=True)
class Cover:
    """A control flush: the groups flushed before it that it covers."""

    groups: list[Written]
    staged: list[PartitionPort]
    """The partitions whose new end it wrote in the control file."""
    covered: dict[PartitionPort, View | None]
    """The partitions open when it was written (their appends are done once it is
    durable), with the records they publish then (None: no newer ones)."""


@dataclass(slots=True)
class Flush:
    """A flush to start (:meth:`Pipeline.start`): a group's files, or the control file."""

    kind: str
    """:data:`DATA_FLUSH` or :data:`CONTROL_FLUSH`."""
    fds: list[int]


DATA_FLUSH, CONTROL_FLUSH = "data", "control"


class Pipeline:
    """The committer's state between its flushes (see the module); both runners drive
    it: they queue jobs, start what :meth:`start` returns, and report each flush's end.

    Two stages, at most one flush each under way: a group's data (what is queued, as
    soon as the previous group's data flush ended) and the control file (covering every
    group flushed since the last one, as soon as the previous control flush ended). A
    control struct is written only while no control flush is under way (each partition
    alternates between its two structs: the one being flushed is never the one written
    over), and an action only when nothing is under way."""

    def __init__(self, engine: EnginePort) -> None:
        self.engine = engine
        self.queue: collections.deque[Job] = collections.deque()
        """Jobs not started, in order."""
        self.data: Written | None = None
        """The group whose data flush is under way."""
        self.flushed: list[Written] = []
        """Groups whose data flush ended, waiting for a control flush."""
        self.cover: Cover | None = None
        """The control flush under way."""
        self.acting: Job | None = None
        """The action under way (nothing else starts meanwhile)."""

    def idle(self) -> bool:
        return (
            not self.queue
            and self.data is None
            and not self.flushed
            and self.cover is None
            and self.acting is None
        )

    def start(self) -> tuple[list[Result], list[Flush | Job]]:
        """Start what can start now: the results known already, and the flushes and the
        action (at most one, last) for the runner to carry out."""
        results: list[Result] = []
        started: list[Flush | Job] = []
        while self.acting is None:
            if self.cover is None and self.flushed:
                groups, self.flushed = self.flushed, []
                cover = self.stage(groups)
                if cover.staged:
                    self.cover = cover
                    started.append(Flush(CONTROL_FLUSH, [self.engine.control.fd]))
                else:  # nothing to make durable (partitions closed meanwhile)
                    results.extend(self.finish(cover, None))
                continue
            if not self.queue:
                break
            if self.queue[0].action is not None or self.alone(self.queue[0]):
                if self.data is None and self.cover is None and not self.flushed:
                    self.acting = self.queue.popleft()
                    started.append(self.acting)
                break
            if self.data is not None:
                break
            group = self.take_group()
            try:
                written = self.write(group)
            except BaseException as exc:  # a bug: fail the group, go on
                log.exception("storage committer failed")
                results.extend((job, exc) for job in group)
                continue
            results.extend(written.results)
            if written.done:
                self.data = written
                started.append(Flush(DATA_FLUSH, written.fds))
        return results, started

    def data_done(self, errors: list[OSError | None]) -> None:
        """The data flush under way ended (``errors``: each file's, None when it completed)."""
        written = self.data
        assert written is not None
        self.data = None
        failed = next((e for e in errors if e is not None), None)
        if failed is not None and self.engine.journal is not None:
            # what the journal holds from this entry on is unknown (a later entry made
            # durable after a lost one would read as damaged): no round is written
            # until the node restarts, whatever the partition
            self.engine.journal_failed = failed
            self.engine.close_partitions(failed)
        elif self.engine.journal is not None and written.done:
            # the round is durable in the journal alone (its segments are not flushed)
            point("storage.journal_round", records=sum(len(j.lengths) for j in written.done))
        self.flushed_group(written, errors)
        self.flushed.append(written)

    def control_done(self, error: OSError | None) -> list[Result]:
        """The control flush under way ended: the appends it covers are done."""
        cover = self.cover
        assert cover is not None
        self.cover = None
        return self.finish(cover, error)

    def action_done(self) -> Result:
        """Run the action started (:meth:`start`): its result. An append started as an
        action (:meth:`alone`) is written straight to its segments (:meth:`write_alone`)."""
        job = self.acting
        assert job is not None
        try:
            if self.engine.journal is not None:
                # so that a replay never crosses an action (a truncation, a prefix drop...)
                self.engine.checkpoint()
            if job.action is None:
                self.write_alone(job)
            else:
                job.action()
        except BaseException as exc:
            return job, exc
        finally:
            self.acting = None
        return job, None

    def fail_all(self, exc: BaseException) -> list[Result]:
        """After a bug in the committer: fail every job not done (never leave a waiter
        hanging); the flushes under way still end (their results then are ignored)."""
        jobs = list(self.queue)
        self.queue.clear()
        for written in [*([self.data] if self.data else []), *self.flushed]:
            jobs.extend(written.done)
        if self.cover is not None:
            jobs.extend(job for written in self.cover.groups for job in written.done)
        if self.acting is not None:
            jobs.append(self.acting)
            self.acting = None
        return [(job, exc) for job in jobs]

    def alone(self, job: Job) -> bool:
        """Whether ``job`` is an append larger than a round may hold (half the node
        journal's body, :meth:`take_group`): it runs alone, as an action does, and is
        written straight to its segments (:meth:`write_alone`), never to the journal."""
        journal = self.engine.journal
        return (
            journal is not None
            and job.action is None
            and len(job.blob) + JOB_OVERHEAD > journal.header.body_size // 2
        )

    def write_alone(self, job: Job) -> None:
        """An append larger than a round (:meth:`alone`), once the checkpoint before it
        emptied the journal's ring: its records written to its segments (the files it
        writes are the partition's to flush), then a checkpoint flushes them, writes the
        partition's acknowledged end and flushes the control file, as a round at
        feature level 2 does; then readers see them. The journal holds none of it: a
        crash before that checkpoint completed leaves records past the acknowledged end
        (never acknowledged: recovery treats them as any unflushed tail), after it they
        are durable and acknowledged; the rounds after it go on in the journal from the
        same position, replayed (if need be) on top of it."""
        part = job.partition
        assert part is not None
        if part.broken is not None:
            raise part.broken_error()
        try:
            part.write_batch(job, set())
        except OSError as exc:
            part.mark_broken(exc)
            raise part.broken_error() from exc
        # written, not flushed: neither the journal nor the control file holds them yet
        point("storage.journal_direct_written", records=len(job.lengths))
        self.engine.checkpoint()
        part.publish()

    def take_group(self) -> list[Job]:
        """The queued appends up to the next action: one group. With a node journal, a
        group is one journal entry, so it takes no more than half the journal's body:
        a checkpoint can always make room for it, and appends queued past it wait for
        the next group, however many partitions queued large batches at once. An append
        larger than that on its own is no group's: it runs alone (:meth:`alone`)."""
        journal = self.engine.journal
        limit = None if journal is None else journal.header.body_size // 2
        group: list[Job] = []
        size = 0
        while self.queue and self.queue[0].action is None and not self.alone(self.queue[0]):
            cost = len(self.queue[0].blob) + JOB_OVERHEAD
            if group and limit is not None and size + cost > limit:
                break
            group.append(self.queue.popleft())
            size += cost
        return group

    def write(self, jobs: list[Job]) -> Written:
        """Write a group's batches (not flushed yet); with a node journal (format 4),
        the group is also one journal entry, and the journal is the one file to flush."""
        journal = self.engine.journal
        if journal is not None and self.engine.journal_failed is not None:
            error = StorageError(
                f"the storage's journal failed ({self.engine.journal_failed}); restart the "
                "storage node so that recovery checks it"
            )
            return Written([(job, error) for job in jobs], [], [], [], [])
        if journal is not None and self.engine.checkpoint_due(
            sum(len(job.blob) + JOB_OVERHEAD for job in jobs)
        ):
            try:  # nothing under way: the ring's room, the replay's length
                self.engine.checkpoint()
            except StorageError as exc:  # the journal cannot be freed: no entry is written
                return Written([(job, exc) for job in jobs], [], [], [], [])
        results: list[Result] = []
        touched: dict[PartitionPort, set[tuple[int, int]]] = {}
        done: list[Job] = []
        for job in jobs:
            part = job.partition
            assert part is not None
            if part.broken is not None:
                results.append((job, part.broken_error()))
                continue
            try:
                flushes = touched.setdefault(part, set())
                part.write_batch(job, flushes)
                done.append(job)
            except OSError as exc:
                part.mark_broken(exc)
                results.append((job, part.broken_error()))
        # One flush per touched file. The data files and the index files that
        # reached a checkpoint are flushed concurrently (the file system can then
        # fold them into one journal commit); an index entry made durable before
        # its record is harmless: recovery verifies the checkpointed entry and
        # falls back to the checkpoint before it, whose flush completed.
        if journal is not None:
            return self.write_entry(journal, results, done, list(touched))
        syncs = [
            (part, kind, fd) for part, flushes in touched.items() for kind, fd in sorted(flushes)
        ]
        return Written(results, done, syncs, [fd for _, _, fd in syncs], list(touched))

    @staticmethod
    def write_entry(
        journal: Journal, results: list[Result], done: list[Job], touched: list[PartitionPort]
    ) -> Written:
        """The group's batches written to their segments as one journal entry: the
        journal is the one file its flush makes durable (its records are then, whatever
        the segments: recovery writes them back)."""
        chunks = []
        for job in done:
            assert job.partition is not None
            chunks.append(
                Chunk(job.partition.partition_id, job.first_txid, len(job.lengths), job.blob)
            )
        if chunks:
            try:
                journal.append(chunks)
            except (OSError, StorageError) as exc:
                # The records are in the segments already (``write_batch``) and no entry
                # holds them: a partition that went on would run ahead of what it
                # acknowledged (its next append of the same ids refused as not
                # continuing its log). Each partition touched is closed until the
                # restart, whose recovery decides its tail from the files.
                error = (
                    exc
                    if isinstance(exc, OSError)
                    else OSError(errno.EIO, f"the node journal refused the round: {exc}")
                )
                for part in touched:
                    if part.broken is None:
                        part.mark_broken(error)
                results.extend(
                    (job, job.partition.broken_error()) for job in done if job.partition is not None
                )
                return Written(results, [], [], [], [])
        syncs = [(part, JOURNAL, journal.fd) for part in touched]
        return Written(results, done, syncs, [journal.fd] if done else [], touched)

    @staticmethod
    def flushed_group(written: Written, errors: list[OSError | None]) -> None:
        """After a group's data flushes: a failed flush closes its partition (its appends
        fail when the group is covered); each of the others notes its durable end."""
        error_of = dict(zip(written.fds, errors, strict=True))
        for part, _, fd in written.syncs:
            error = error_of[fd]
            if error is not None and part.broken is None:
                part.mark_broken(error)
        for part in written.touched:
            if part.broken is None:
                part.note_flushed()

    @staticmethod
    def stage(groups: list[Written]) -> Cover:
        """Write the durable end of each partition of the groups flushed that is still
        open, in the control file (not flushed yet)."""
        staged: list[PartitionPort] = []
        covered: dict[PartitionPort, View | None] = {}
        for part in dict.fromkeys(p for written in groups for p in written.touched):
            if part.broken is not None:
                continue
            try:
                if part.stage_acked_end():
                    staged.append(part)
            except OSError as exc:
                part.mark_broken(exc)
                continue
            covered[part] = part.take_flushed_view()
        return Cover(groups, staged, covered)

    @staticmethod
    def finish(cover: Cover, control_error: OSError | None) -> list[Result]:
        """After the control flush that covers flushed groups (``control_error``: None
        when it completed or none was needed): a failed one closes the partitions staged,
        as a failed data flush would; the appends of the others are done and published."""
        if control_error is not None:
            for part in cover.staged:
                if part.broken is None:
                    part.mark_broken(control_error)
        results: list[Result] = []
        for written in cover.groups:
            for job in written.done:
                owner = job.partition
                assert owner is not None
                if owner in cover.covered and (control_error is None or owner not in cover.staged):
                    results.append((job, None))
                else:
                    results.append((job, owner.broken_error()))
        for part, view in cover.covered.items():
            if part.broken is None and view is not None:
                part.publish_view(view)
        return results


def resolve(results: list[Result]) -> None:
    """Resolve the futures of a round (on the event loop)."""
    for job, exc in results:
        if job.future.done():
            continue
        if exc is None:
            job.future.set_result(None)
        else:
            job.future.set_exception(exc)
