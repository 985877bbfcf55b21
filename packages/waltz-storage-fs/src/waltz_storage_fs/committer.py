"""The fs engine's writer: group commit, and the runners that run it.

One *committer* owns every write. Appends of all partitions queue to it, and go
through two stages, each with at most one flush under way (:class:`Pipeline`):

- *data*: everything queued (a run of appends: a *group*) is *written* (one
  ``pwrite`` per batch for the data, one for its index entries), then *flushed*
  (one ``fdatasync`` per touched file, all at once): its records are durable, and
  each partition's durable end is known. The next group starts as soon as this
  flush ended: while it is on the disk the next appends queue up, so concurrent
  appends coalesce.
- *control*: no append is acknowledged before its partition's acknowledged end in
  the control file covers it durably: recovery then knows a tail lost after it was
  acknowledged from a torn, unflushed write (:mod:`waltz_storage_fs.format`). As soon
  as a group is flushed (and the previous control flush ended), the ends it reached
  are *staged* (written in the control file) and the control file is flushed; then
  the appends of every group it covers are done (a failed control flush closes the
  partitions staged) and their records published.

The control flush of one group runs while the next group's data is flushed, so under
load each stage costs one flush time, and an append two (its data's, then the control
file's, started at once: no waiting for more work).

Any other job (an *action*: a truncation, a session info update, a repair...) runs
alone, once the appends queued before it are durable and acknowledged and nothing is
under way; the jobs queued after it wait for it. A job's future is resolved when it
is done.

A :class:`Runner` decides where this runs; both drive the same :class:`Pipeline`:

- :class:`ThreadRunner` (the default): a committer thread, a pool of reader
  threads, a flusher thread per stage, the files of a group spread over a few sync
  threads (:class:`SyncThreads`);
- :class:`LoopRunner`: everything on the event loop: the committer is a task, each
  flush a task of its own that *requests* it: it awaits ``flush_wait()`` (the time
  the flush takes; nothing by default) and only then calls ``fdatasync``, so a
  process that dies in between never made those writes durable; reads run on the
  loop. For the deterministic simulation (virtual time, no threads) and for tests;
  it blocks the loop for every file call.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import concurrent.futures
import errno
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from waltz_api.errors import StorageError
from waltz_storage_fs.pipeline import (
    CONTROL_FLUSH,
    DATA,
    DATA_FLUSH,
    INDEX,
    STOP,
    EnginePort,
    Flush,
    Job,
    Pipeline,
    Result,
    resolve,
)

__all__ = ["DATA", "INDEX", "Committer", "Job", "LoopRunner", "Runner", "ThreadRunner"]

log = logging.getLogger(__name__)

T = TypeVar("T")

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
    def start_committer(self, engine: EnginePort) -> Committer:
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

    def start_committer(self, engine: EnginePort) -> Committer:
        self._committer = _CommitterThread(engine, asyncio.get_running_loop())
        self._committer.start()
        return self._committer

    async def close(self) -> None:
        if self._committer is not None:
            await self.run(self._committer.join)
        self._readers.shutdown(wait=True)


class SyncThreads:
    """Flushes the files of a group at once (one caller at a time): the calling thread
    flushes the first one itself and up to ``helpers`` threads the others (each the
    files handed to it, in turn). The threads start when a group first has several
    files and stay for the engine's life; a hand-off is a SimpleQueue put and get, no
    future, no executor."""

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
        """End the threads (once no flush is under way: called by the committer)."""
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


@dataclass(slots=True)
class _Ended:
    """A flush ended (posted to the committer by a flusher thread)."""

    kind: str
    errors: list[OSError | None]
    seconds: float


class _CommitterThread(threading.Thread):
    """The one thread that writes (:class:`ThreadRunner`).

    Everything comes to it through one SimpleQueue: jobs (a put from the event loop),
    and the end of each flush (from the two flusher threads: a group's files, spread
    over :class:`SyncThreads`, and the control file; or its own, see :meth:`_advance`).
    It takes everything queued, starts what can start (:meth:`Pipeline.start`; an
    action runs here), and sends the results back to the loop in one
    ``call_soon_threadsafe`` (one wake-up of the loop per pass: a round's appends of
    every partition are resolved in one callback). ``submit`` and ``stop`` are called on
    the event loop: the jobs submitted in one loop iteration are put in the queue
    together at its end (one wake-up of this thread per iteration, not per job)."""

    def __init__(self, engine: EnginePort, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name=f"waltz-fs-committer:{engine.directory}", daemon=True)
        self._engine = engine
        self._pipe = Pipeline(engine)
        self._loop = loop
        self._inbox: queue.SimpleQueue[list[Job] | _Ended | None] = queue.SimpleQueue()
        self._handing: list[Job] = []
        """Jobs submitted in this loop iteration (:meth:`_hand_over` at its end)."""
        self._stopping = False
        # engine.files read at each flush (a test may replace the file layer's methods)
        self._syncs = SyncThreads("waltz-fs-sync", lambda fd: engine.files.fdatasync(fd))  # noqa: PLW0108
        self._flushers: dict[str, queue.SimpleQueue[list[int] | None]] = {}
        self._threads: list[threading.Thread] = []
        self._overlap = False
        """Whether a group's data flush ran beside the last control flush (appends come
        while the control file is flushed: the next one alone runs in a flusher thread,
        so that a group coming meanwhile starts at once)."""

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise StorageError("the storage engine is closed")
        handing = self._handing
        handing.append(job)
        if len(handing) == 1:
            self._loop.call_soon(self._hand_over)

    def _hand_over(self) -> None:
        """The jobs submitted in a loop iteration, handed over at its end in one put: one
        wake-up of this thread for all the requests of a received message."""
        jobs, self._handing = self._handing, []
        if jobs:
            self._inbox.put(jobs)

    def stop(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._hand_over()
            self._inbox.put(STOP)

    def run(self) -> None:
        inbox = self._inbox
        pipe = self._pipe
        stopped = False
        while not (stopped and pipe.idle()):
            item = inbox.get()
            results: list[Result] = []
            while True:
                if item is STOP:
                    stopped = True
                elif isinstance(item, _Ended):
                    results.extend(self._ended(item))
                else:
                    pipe.queue.extend(item)
                if inbox.empty():
                    break
                item = inbox.get_nowait()
            here: Flush | None = None
            try:
                here = self._advance(results)
            except BaseException as exc:  # never leave a waiter hanging
                log.exception("storage committer failed")
                results.extend(pipe.fail_all(exc))
            self._finish(results)
            if here is not None:  # its end is handled with whatever came meanwhile
                ended = self._flushed(here)
                if here.kind == CONTROL_FLUSH:  # beside a data flush, or jobs came
                    self._overlap = pipe.data is not None or not inbox.empty()
                inbox.put(ended)
        for flusher in self._flushers.values():
            flusher.put(None)
        for thread in self._threads:
            thread.join()
        self._syncs.stop()

    def _advance(self, results: list[Result]) -> Flush | None:
        """Start what can start (actions run here, one after the other); adds the results
        known to ``results``. The flush to run in this thread, if any (a thread hop less
        each way): the data flush while no control flush is under way (nothing else
        could start meanwhile); the control flush while a data flush is under way, or
        alone when no append came during the last one (under load, one alone runs in a
        flusher thread: a group coming meanwhile starts at once)."""
        pipe = self._pipe
        while True:
            known, started = pipe.start()
            results.extend(known)
            flushes = [work for work in started if isinstance(work, Flush)]
            here: Flush | None = None
            for flush in flushes:
                if flush.kind == CONTROL_FLUSH:
                    if pipe.data is not None or not self._overlap:
                        here = flush
                    self._overlap = pipe.data is not None
                elif pipe.cover is None:
                    here = flush
                else:
                    self._overlap = True
            for flush in flushes:
                if flush is not here:
                    self._flusher(flush.kind).put(flush.fds)
            if len(flushes) == len(started):
                return here
            assert here is None  # an action starts alone
            results.append(pipe.action_done())

    def _flushed(self, flush: Flush) -> _Ended:
        """Run ``flush`` here."""
        started = time.perf_counter()
        errors = self._sync(flush.kind, flush.fds)
        return _Ended(flush.kind, errors, time.perf_counter() - started)

    def _ended(self, ended: _Ended) -> list[Result]:
        observer = self._engine.fsync_observer
        if observer is not None:
            observer(ended.seconds)
        if ended.kind == DATA_FLUSH:
            self._pipe.data_done(ended.errors)
            return []
        return self._pipe.control_done(ended.errors[0])

    def _flusher(self, kind: str) -> queue.SimpleQueue[list[int] | None]:
        """The thread that flushes ``kind`` (started at its first flush)."""
        flusher = self._flushers.get(kind)
        if flusher is None:
            flusher = self._flushers[kind] = queue.SimpleQueue()
            thread = threading.Thread(
                target=self._flush,
                args=(kind, flusher),
                name=f"waltz-fs-{kind}-flush",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        return flusher

    def _flush(self, kind: str, flusher: queue.SimpleQueue[list[int] | None]) -> None:
        while (fds := flusher.get()) is not None:
            self._inbox.put(self._flushed(Flush(kind, fds)))

    def _sync(self, kind: str, fds: list[int]) -> list[OSError | None]:
        try:
            return self._syncs.sync_all(fds) if kind == DATA_FLUSH else self._sync_one(fds)
        except BaseException as exc:  # handed back as a failed flush: never a hang
            log.exception("storage flush failed")
            return [OSError(errno.EIO, f"the flush failed: {exc!r}")] * len(fds)

    def _sync_one(self, fds: list[int]) -> list[OSError | None]:
        (fd,) = fds
        try:
            self._engine.files.fdatasync(fd)
        except OSError as exc:
            return [exc]
        return [None]

    def _finish(self, results: list[Result]) -> None:
        if results:
            self._loop.call_soon_threadsafe(resolve, results)


async def _no_wait() -> None:
    """The default wait of :class:`LoopRunner`: none (one turn of the loop)."""
    await asyncio.sleep(0)


class LoopRunner(Runner):
    """Everything on the event loop (see the module): no thread at all.

    ``flush_wait``: awaited by each flush (a group's files, or the control file: each
    a task of the committer's, both under way at once) between requesting it and
    calling ``fdatasync`` (the flush's duration), and before each action (its own
    flushes happen inside it, synchronously); ``read_wait``: awaited before each read.
    A committer cancelled (its process died) cancels its flushes: those never make the
    writes durable."""

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
        self._pipe: Pipeline | None = None
        self._flushes: set[asyncio.Task[None]] = set()

    async def run(self, fn: Callable[[], T]) -> T:
        await self._read_wait()
        return fn()

    def start_committer(self, engine: EnginePort) -> Committer:
        self._pipe = Pipeline(engine)
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
        pipe, wake = self._pipe, self._wake
        assert pipe is not None and wake is not None
        stopped = False
        try:
            while True:
                while self._queue:
                    job = self._queue.popleft()
                    if job is STOP:
                        stopped = True
                    else:
                        pipe.queue.append(job)
                try:
                    known, started = pipe.start()
                except Exception as exc:  # never leave a waiter hanging
                    log.exception("storage committer failed")
                    known, started = pipe.fail_all(exc), []
                resolve(known)
                for work in started:
                    self._spawn(self._act() if isinstance(work, Job) else self._flush(work))
                if stopped and pipe.idle():
                    return
                await wake.wait()
                wake.clear()
        finally:
            for task in self._flushes:  # cancelled: the process died
                task.cancel()

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _act(self) -> None:
        """The action started: after a flush's time (its flushes are its own)."""
        pipe, wake = self._pipe, self._wake
        assert pipe is not None and wake is not None
        await self._flush_wait()
        resolve([pipe.action_done()])
        wake.set()

    async def _flush(self, flush: Flush) -> None:
        """Request the flush, wait for it, then make the writes durable."""
        pipe, wake = self._pipe, self._wake
        assert pipe is not None and wake is not None
        engine = pipe.engine
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self._flush_wait()
        errors: list[BaseException | None] = []
        for fd in flush.fds:
            try:
                engine.files.fdatasync(fd)
            except BaseException as exc:
                errors.append(exc)
            else:
                errors.append(None)
        observer = engine.fsync_observer
        if observer is not None:
            observer(loop.time() - started)
        try:
            flushed = _checked(errors)
            if flush.kind == DATA_FLUSH:
                pipe.data_done(flushed)
            else:
                resolve(pipe.control_done(flushed[0]))
        except Exception as exc:  # never leave a waiter hanging
            log.exception("storage committer failed")
            resolve(pipe.fail_all(exc))
        wake.set()
