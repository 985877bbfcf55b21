"""The fs engine's writer: group commit, and the runners that run it.

One *committer* owns every write. Appends of all partitions queue to it; each
round takes everything queued and splits it into *steps* (:func:`steps`): a run of
appends is one group, committed in five steps (:class:`GroupCommit`): *write*
(one ``pwrite`` per batch for the data, one for its index entries), *sync* (one
``fdatasync`` per touched file, all at once), *stage* (a failed flush closes its
partition; each of the others writes its new acknowledged end in the control file),
*sync* of the control file (one ``fdatasync`` for all of them), *finish* (a failed
control flush closes the partitions staged; the others publish their records). No
append is acknowledged before its partition's acknowledged end covers it durably:
recovery then knows a tail lost after it was acknowledged from a torn, unflushed
write (:mod:`waltz_storage_fs.format`). Any other job (an *action*: a truncation, a
session info update, a repair...) runs alone, after the appends queued before it are
durable. The round's futures are resolved at its end. While a round is on the disk
the next appends queue up, so concurrent appends coalesce.

A :class:`Runner` decides where this runs; both call the same steps:

- :class:`ThreadRunner` (the default): a committer thread, a pool of reader
  threads, and the flushes of a round spread over a few sync threads
  (:class:`SyncThreads`);
- :class:`LoopRunner`: everything on the event loop, one task for the committer:
  a round is written synchronously, then its flushes are *requested*: the runner
  awaits ``flush_wait()`` (the time the flush takes; nothing by default) and only
  then calls ``fdatasync``, so a process that dies in between never made those
  writes durable; reads run on the loop. For the deterministic simulation (virtual
  time, no threads) and for tests; it blocks the loop for every file call.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from waltz_api.errors import StorageError

if TYPE_CHECKING:
    from waltz_storage_fs.engine import FsStorageEngine, FsStoragePartition

log = logging.getLogger(__name__)

T = TypeVar("T")

DATA, INDEX = 0, 1
"""The kinds of file a group flushes (data files first)."""

Result = tuple["Job", BaseException | None]


@dataclass
class Job:
    future: asyncio.Future[None]
    partition: FsStoragePartition | None = None
    blob: bytes = b""
    lengths: list[int] = field(default_factory=list)
    first_txid: int = 0
    action: Callable[[], None] | None = None


STOP = None
"""Queued after the last job: the committer ends once it is reached."""


# -- the logic, shared ------------------------------------------------------------------


def steps(jobs: list[Job]) -> list[Job | list[Job]]:
    """A round's steps, in order: each run of appends as one group (a list), each other
    job (an action) alone."""
    if all(job.action is None for job in jobs):  # the usual round: appends only
        return [jobs]
    out: list[Job | list[Job]] = []
    group: list[Job] = []
    for job in jobs:
        if job.action is None:
            group.append(job)
            continue
        if group:
            out.append(group)
            group = []
        out.append(job)
    if group:
        out.append(group)
    return out


@dataclass(slots=True)
class Written:
    """A group after its write step: what to flush, and what is known already."""

    results: list[Result]
    """Appends refused before their flush (a partition closed by an error)."""
    done: list[Job]
    """Appends written, waiting for their flush."""
    syncs: list[tuple[FsStoragePartition, int, int]]
    """(partition, kind, fd) of every file to flush."""
    fds: list[int]
    """The files to flush (the fds of ``syncs``)."""
    touched: list[FsStoragePartition]
    """The partitions written (each publishes its records once they are durable)."""


class GroupCommit:
    """The steps of a round (see the module); the runners call them."""

    def __init__(self, engine: FsStorageEngine) -> None:
        self.engine = engine

    @staticmethod
    def act(job: Job) -> Result:
        """Run an action (after the appends queued before it are durable)."""
        assert job.action is not None
        try:
            job.action()
        except BaseException as exc:
            return job, exc
        return job, None

    @staticmethod
    def write(jobs: list[Job]) -> Written:
        """Write a group's batches (not flushed yet)."""
        results: list[Result] = []
        touched: dict[FsStoragePartition, set[tuple[int, int]]] = {}
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
        syncs = [
            (part, kind, fd) for part, flushes in touched.items() for kind, fd in sorted(flushes)
        ]
        return Written(results, done, syncs, [fd for _, _, fd in syncs], list(touched))

    @staticmethod
    def stage(written: Written, errors: list[OSError | None]) -> list[FsStoragePartition]:
        """After the data flushes (``errors``: each file's, None when it completed): a
        failed flush closes its partition; each of the others writes its acknowledged
        end (not flushed yet). The partitions that wrote one: the control file must be
        flushed before their appends are acknowledged."""
        for (part, _, _), error in zip(written.syncs, errors, strict=True):
            if error is not None and part.broken is None:
                part.mark_broken(error)
        staged: list[FsStoragePartition] = []
        for part in written.touched:
            if part.broken is not None:
                continue
            try:
                if part.stage_acked_end():
                    staged.append(part)
            except OSError as exc:
                part.mark_broken(exc)
        return staged

    @staticmethod
    def finish(
        written: Written, staged: list[FsStoragePartition], control_error: OSError | None
    ) -> list[Result]:
        """After the control file's flush (``control_error``: None when it completed or
        none was needed): a failed one closes the partitions staged, as a failed data
        flush would; the appends of the others are done and published."""
        if control_error is not None:
            for part in staged:
                if part.broken is None:
                    part.mark_broken(control_error)
        results = written.results
        for job in written.done:
            assert job.partition is not None
            if job.partition.broken is not None:
                results.append((job, job.partition.broken_error()))
            else:
                results.append((job, None))
        for part in written.touched:
            if part.broken is None:
                part.publish()
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


# -- runners ------------------------------------------------------------------------------


class Committer(Protocol):
    """What the engine asks of its committer (on the event loop)."""

    def submit(self, job: Job) -> None: ...

    def stop(self) -> None: ...


class Runner(abc.ABC):
    """Where the engine's committer and its reads run (one runner per engine open)."""

    @abc.abstractmethod
    def run(self, fn: Callable[[], T]) -> Awaitable[T]:
        """Run a blocking call of the engine (a read, recovery at open): its result."""

    @abc.abstractmethod
    def start_committer(self, engine: FsStorageEngine) -> Committer:
        """Start the engine's committer."""

    @abc.abstractmethod
    async def close(self) -> None:
        """After the committer's ``stop``: wait until its last round is done, then release
        what the runner holds (callable without a committer, when the open failed)."""


class ThreadRunner(Runner):
    """The real one: a committer thread, reader threads, sync threads."""

    def __init__(self, read_threads: int) -> None:
        self._readers = concurrent.futures.ThreadPoolExecutor(
            max_workers=read_threads, thread_name_prefix="waltz-fs-reader"
        )
        self._committer: _CommitterThread | None = None

    def run(self, fn: Callable[[], T]) -> Awaitable[T]:
        return asyncio.get_running_loop().run_in_executor(self._readers, fn)

    def start_committer(self, engine: FsStorageEngine) -> Committer:
        self._committer = _CommitterThread(engine, asyncio.get_running_loop())
        self._committer.start()
        return self._committer

    async def close(self) -> None:
        if self._committer is not None:
            await self.run(self._committer.join)
        self._readers.shutdown(wait=True)


class SyncThreads:
    """Flushes the files of a round at once: the committer flushes the first one
    itself and up to ``helpers`` threads the others (each the files handed to it, in
    turn). The threads start when a round first has several files and stay for the
    engine's life; a hand-off is a SimpleQueue put and get, no future, no executor."""

    def __init__(self, name: str, fdatasync: Callable[[int], None], helpers: int = 3) -> None:
        self._name = name
        self._fdatasync = fdatasync
        self._helpers = helpers
        self._inboxes: list[queue.SimpleQueue[tuple[int, int] | None]] = []
        self._threads: list[threading.Thread] = []
        self._done: queue.SimpleQueue[tuple[int, BaseException | None]] = queue.SimpleQueue()

    def _sync(self, fd: int) -> BaseException | None:
        try:
            self._fdatasync(fd)
        except BaseException as exc:  # handed back: the committer decides
            return exc
        return None

    def _helper(self, inbox: queue.SimpleQueue[tuple[int, int] | None]) -> None:
        while (item := inbox.get()) is not None:
            index, fd = item
            self._done.put((index, self._sync(fd)))

    def sync_all(self, fds: list[int]) -> list[OSError | None]:
        """fdatasync every one of ``fds`` (concurrently); the error of each (None: ok).
        Anything else than an OSError is raised, once every flush has ended."""
        errors: list[BaseException | None] = [None] * len(fds)
        if len(fds) > 1:
            while len(self._inboxes) < min(self._helpers, len(fds) - 1):
                inbox: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._helper,
                    args=(inbox,),
                    name=f"{self._name}-{len(self._inboxes)}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)
                self._inboxes.append(inbox)
            inboxes = self._inboxes
            for index in range(1, len(fds)):
                inboxes[(index - 1) % len(inboxes)].put((index, fds[index]))
        if fds:
            errors[0] = self._sync(fds[0])
        for _ in range(len(fds) - 1):
            index, error = self._done.get()
            errors[index] = error
        return _checked(errors)

    def stop(self) -> None:
        """End the threads (after the round under way: called by the committer)."""
        for inbox in self._inboxes:
            inbox.put(None)
        for thread in self._threads:
            thread.join()


def _checked(errors: list[BaseException | None]) -> list[OSError | None]:
    """The flushes' OSErrors; anything else is raised."""
    flushed: list[OSError | None] = []
    for error in errors:
        if error is not None and not isinstance(error, OSError):
            raise error
        flushed.append(error)
    return flushed


class _CommitterThread(threading.Thread):
    """The one thread that writes (:class:`ThreadRunner`).

    Jobs come through a SimpleQueue (a put from the event loop, a get here that takes
    everything queued as one round); a round's results go back to the loop in one
    ``call_soon_threadsafe``. ``submit`` and ``stop`` are called on the event loop."""

    def __init__(self, engine: FsStorageEngine, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name=f"waltz-fs-committer:{engine.directory}", daemon=True)
        self._engine = engine
        self._logic = GroupCommit(engine)
        self._loop = loop
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._stopping = False
        # engine.files read at each flush (a test may replace the file layer's methods)
        self._syncs = SyncThreads("waltz-fs-sync", lambda fd: engine.files.fdatasync(fd))  # noqa: PLW0108

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise StorageError("the storage engine is closed")
        self._queue.put(job)

    def stop(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._queue.put(STOP)

    def run(self) -> None:
        pending = self._queue
        stopped = False
        while not stopped:
            first = pending.get()
            if first is STOP:
                break
            jobs = [first]
            while not pending.empty():
                job = pending.get_nowait()
                if job is STOP:
                    stopped = True
                    break
                jobs.append(job)
            try:
                self._round(jobs)
            except BaseException as exc:  # never leave a waiter hanging
                log.exception("storage committer failed")
                self._finish([(job, exc) for job in jobs if not job.future.done()])
        self._syncs.stop()

    def _round(self, jobs: list[Job]) -> None:
        logic = self._logic
        results: list[Result] = []
        for step in steps(jobs):
            if isinstance(step, Job):
                results.append(logic.act(step))
                continue
            written = logic.write(step)
            if not written.fds:
                results.extend(logic.finish(written, [], None))
                continue
            started = time.perf_counter()
            staged = logic.stage(written, self._syncs.sync_all(written.fds))
            control_error = self._sync_control() if staged else None
            observer = self._engine.fsync_observer
            if observer is not None:
                observer(time.perf_counter() - started)
            results.extend(logic.finish(written, staged, control_error))
        self._finish(results)

    def _sync_control(self) -> OSError | None:
        """Flush the control file (the round's acknowledged ends); its error, if any.
        (The group's files were flushed before, all at once: fdatasync for both kinds,
        data and index at a checkpoint; it flushes the size too, not the mtime.)"""
        try:
            self._engine.control.sync()
        except OSError as exc:
            return exc
        return None

    def _finish(self, results: list[Result]) -> None:
        if results:
            self._loop.call_soon_threadsafe(resolve, results)


async def _no_wait() -> None:
    """The default wait of :class:`LoopRunner`: none (one turn of the loop)."""
    await asyncio.sleep(0)


class LoopRunner(Runner):
    """Everything on the event loop (see the module): no thread at all.

    ``flush_wait``: awaited once per group of flushes between requesting them and
    calling ``fdatasync`` (the flush's duration), and before each action (its own
    flushes happen inside it, synchronously); ``read_wait``: awaited before each read.
    A task cancelled in a wait (its process died) never makes the writes durable."""

    def __init__(
        self,
        *,
        flush_wait: Callable[[], Awaitable[None]] = _no_wait,
        read_wait: Callable[[], Awaitable[None]] = _no_wait,
    ) -> None:
        self._flush_wait = flush_wait
        self._read_wait = read_wait
        self._queue: collections.deque[Job | None] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._logic: GroupCommit | None = None

    async def run(self, fn: Callable[[], T]) -> T:
        await self._read_wait()
        return fn()

    def start_committer(self, engine: FsStorageEngine) -> Committer:
        self._logic = GroupCommit(engine)
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"waltz-fs-committer:{engine.directory}"
        )
        return self

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise StorageError("the storage engine is closed")
        assert self._wake is not None
        self._queue.append(job)
        self._wake.set()

    def stop(self) -> None:
        if not self._stopping and self._wake is not None:
            self._stopping = True
            self._queue.append(STOP)
            self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            await asyncio.wait([self._task])

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            jobs: list[Job] = []
            stopped = False
            while self._queue:
                job = self._queue.popleft()
                if job is STOP:
                    stopped = True
                    break
                jobs.append(job)
            if jobs:
                try:
                    await self._round(jobs)
                except Exception as exc:  # never leave a waiter hanging
                    log.exception("storage committer failed")
                    resolve([(job, exc) for job in jobs if not job.future.done()])
            if stopped:
                return

    async def _round(self, jobs: list[Job]) -> None:
        logic = self._logic
        assert logic is not None
        results: list[Result] = []
        for step in steps(jobs):
            if isinstance(step, Job):
                await self._flush_wait()
                results.append(logic.act(step))
                continue
            written = logic.write(step)
            if not written.fds:
                results.extend(logic.finish(written, [], None))
                continue
            engine = logic.engine
            loop = asyncio.get_running_loop()
            started = loop.time()
            staged = logic.stage(written, await self._sync_all(engine, written.fds))
            control_error = None
            if staged:  # a flush of its own, after the data's: it takes its time too
                (control_error,) = await self._sync_all(engine, [engine.control.fd])
            observer = engine.fsync_observer
            if observer is not None:
                observer(loop.time() - started)
            results.extend(logic.finish(written, staged, control_error))
        resolve(results)

    async def _sync_all(self, engine: FsStorageEngine, fds: list[int]) -> list[OSError | None]:
        """Request the flushes, wait for them, then make the writes durable."""
        await self._flush_wait()
        errors: list[BaseException | None] = []
        for fd in fds:
            try:
                engine.files.fdatasync(fd)
            except BaseException as exc:
                errors.append(exc)
            else:
                errors.append(None)
        return _checked(errors)
