"""The virtual-time event loop and the simulated processes it runs.

:class:`SimLoop` is an ordinary asyncio selector event loop with two changes:

- its clock is virtual: :meth:`SimLoop.time` returns a number the loop owns, and
  its selector never blocks: when nothing is ready it moves the clock to the next
  timer, so a simulated minute of timeouts, heartbeats and back-offs passes in the
  time the callbacks take to run;
- every callback belongs to a simulated process (or to the world): the context a
  callback runs in carries its :class:`Incarnation` (a contextvar), and the loop
  asks the incarnation before running it. A *paused* incarnation's callbacks are
  parked until it resumes (SIGSTOP: time passes, nothing of it runs); a *dead* one's
  timers never fire again, while its tasks, cancelled at the crash, unwind.

One process, one loop, one thread: the real server, storage node and client code
run together and never notice. Nothing here reads a wall clock or a global random
generator; the order of callbacks is the order asyncio gives them (FIFO, timers by
deadline), so the same program with the same seed makes the same run.

Threads are refused (:meth:`SimLoop.run_in_executor` raises): a thread would run
outside virtual time. A client's callback thread (where the Waltz client runs plain,
synchronous callbacks) has a deterministic stand-in, :class:`CallbackThread`, that runs
them on the loop one at a time. The automatic garbage collector is off during a run; the
world collects at fixed virtual instants instead, so finalizers run at the same
point of every replay.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import enum
import functools
import heapq
import logging
import selectors
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol

from waltz_api.errors import WaltzError

log = logging.getLogger(__name__)

SPIN_LIMIT = 2_000_000
"""Loop iterations at one virtual instant before the run is declared a livelock."""
START_TIME = 1000.0
"""The virtual clock at the start of a run (traces print time since the start)."""


class SimulationError(WaltzError):
    """The simulation itself cannot go on (a stalled world, a thread in the core path,
    a simulated plugin used outside a simulated process)."""


class ProcessState(enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    DEAD = "dead"


class Resource(Protocol):
    """Something a process holds in the simulated world (a transport, a coordination
    client, an open storage engine): told when its process crashes, pauses, resumes."""

    def on_crash(self, power_loss: bool) -> None: ...

    def on_pause(self) -> None: ...

    def on_resume(self) -> None: ...


class SimulatedProcess(Protocol):
    """What the loop and the simulated contracts know of a process (the world's
    ``SimProcess``): its name and its world. Each contract reads what it needs of the
    world through a protocol of its own (``net.NetWorld``, ``disk.DiskWorld``...), so
    nothing below the world imports it."""

    @property
    def name(self) -> str: ...

    @property
    def world(self) -> Any: ...


CURRENT: contextvars.ContextVar[Incarnation | None] = contextvars.ContextVar(
    "waltz_sim_incarnation", default=None
)
"""The incarnation the running code belongs to (None: the world itself)."""


class Incarnation:
    """One life of a simulated process: from a start to a crash (a restart is a new one)."""

    def __init__(self, process: SimulatedProcess, number: int) -> None:
        self.process = process
        self.number = number
        self.state = ProcessState.RUNNING
        self.pause_epoch = 0
        """Counts the pauses: a detector armed at a pause checks it is still the same one."""
        self.context = contextvars.Context()
        self.context.run(CURRENT.set, self)
        self.tasks: dict[asyncio.Task[Any], None] = {}
        """Its live tasks, in creation order (cancelled in that order at a crash)."""
        self.resources: list[Resource] = []
        self.parked: list[tuple[Callable[..., Any], tuple[Any, ...], contextvars.Context]] = []

    @property
    def name(self) -> str:
        return f"{self.process.name}#{self.number}"

    @property
    def alive(self) -> bool:
        return self.state is not ProcessState.DEAD

    @property
    def running(self) -> bool:
        return self.state is ProcessState.RUNNING

    def __repr__(self) -> str:
        return f"<Incarnation {self.name} {self.state.value}>"


def current_incarnation() -> Incarnation:
    """The incarnation of the running code; a simulated plugin is only ever used by one."""
    incarnation = CURRENT.get()
    if incarnation is None:
        raise SimulationError(
            "a simulated plugin was used outside a simulated process: create it from code "
            "started by SimProcess.start (the world runs every process in its own context)"
        )
    return incarnation


WORLD_CONTEXT = contextvars.Context()
"""The context of the world's own callbacks (network deliveries, timers of the
coordination service, the nemesis): they belong to no process and always run."""


class _VirtualSelector(selectors.BaseSelector):
    """Never blocks and reports no I/O: a wait moves the loop's clock to the next timer."""

    def __init__(self) -> None:
        self._keys: dict[Any, selectors.SelectorKey] = {}
        self.loop: SimLoop | None = None
        self.spins = 0

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(
            fileobj, fileobj if isinstance(fileobj, int) else -1, events, data
        )
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self.register(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        loop = self.loop
        assert loop is not None
        if timeout is None:
            raise SimulationError(
                "the simulated world stalled: nothing is ready and no timer is scheduled, "
                "so every task waits for an event nothing will ever set"
            )
        if timeout > 0:
            loop._advance()
            self.spins = 0
        else:
            self.spins += 1
            if self.spins > SPIN_LIMIT:
                raise SimulationError(
                    f"livelock: {SPIN_LIMIT} loop iterations without the virtual clock moving "
                    "(callbacks keep scheduling callbacks at the same instant)"
                )
        return []

    def close(self) -> None:
        self._keys.clear()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys


class SimLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop on virtual time, aware of simulated processes."""

    def __init__(self, start: float = START_TIME) -> None:
        self._now = start
        self.start_time = start
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self.set_task_factory(_task_factory)  # type: ignore[arg-type]

    # -- the clock ------------------------------------------------------------------------

    def time(self) -> float:
        return self._now

    def _advance(self) -> None:
        """Move the clock to the earliest timer (called when nothing else is ready)."""
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        while scheduled and scheduled[0].cancelled():
            heapq.heappop(scheduled)
            self._timer_cancelled_count -= 1  # type: ignore[attr-defined]
        if scheduled:
            when = scheduled[0].when()
            if when > self._now:
                self._now = when

    # -- process-aware scheduling ------------------------------------------------------------

    def _call_soon(
        self, callback: Callable[..., Any], args: tuple[Any, ...], context: Any
    ) -> asyncio.Handle:
        if context is None:
            context = contextvars.copy_context()
        incarnation = context.get(CURRENT)
        if incarnation is None:
            return super()._call_soon(callback, args, context)  # type: ignore[misc, no-any-return]
        return super()._call_soon(  # type: ignore[misc, no-any-return]
            _run_soon, (incarnation, callback, args, context), context
        )

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., Any],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        if context is None:
            context = contextvars.copy_context()
        incarnation = context.get(CURRENT)
        if incarnation is None:
            return super().call_at(when, callback, *args, context=context)
        return super().call_at(
            when, _run_timer, incarnation, callback, args, context, context=context
        )

    def resume_parked(self, incarnation: Incarnation) -> None:
        """Schedule what a paused incarnation missed, in the order it would have run."""
        parked, incarnation.parked = incarnation.parked, []
        for callback, args, context in parked:
            self._call_soon(callback, args, context)

    def _write_to_self(self) -> None:
        """No thread ever waits in the selector: nothing to wake."""

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> Any:  # type: ignore[override]
        if isinstance(executor, CallbackThread):
            return asyncio.wrap_future(executor.submit(func, *args), loop=self)
        raise SimulationError(
            f"run_in_executor({getattr(func, '__qualname__', func)!r}) in the simulation: a "
            "thread runs outside virtual time and breaks determinism. Use async callbacks "
            "(async def) for clients, and plugins that run on the loop"
        )


class CallbackThread(concurrent.futures.Executor):
    """A deterministic stand-in for a Waltz client's callback thread (its plain,
    synchronous callbacks: ``AsyncWaltzClient(callback_executor=...)``): each call runs on
    the loop, to its end, one at a time, in the order submitted, in the context of the
    process that submitted it (parked while it is paused); a crashed process's calls
    never run. A callback cannot block on the loop, so ``Transaction.get_data()`` there
    reads the client's prefetched data (``ClientConfig(prefetch_data=True)``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._closed = False

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise RuntimeError("cannot schedule new futures after shutdown")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._loop.call_soon(self._run, functools.partial(fn, *args, **kwargs), future)
        return future

    @staticmethod
    def _run(call: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
        incarnation = CURRENT.get()
        if incarnation is not None and not incarnation.alive:
            return  # the thread died with its process
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = call()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._closed = True


def _run_soon(
    incarnation: Incarnation,
    callback: Callable[..., Any],
    args: tuple[Any, ...],
    context: contextvars.Context,
) -> None:
    if incarnation.state is ProcessState.PAUSED:
        incarnation.parked.append((callback, args, context))
        return
    # running, or dead: a crashed process's cancelled tasks unwind (their I/O is void)
    callback(*args)


def _run_timer(
    incarnation: Incarnation,
    callback: Callable[..., Any],
    args: tuple[Any, ...],
    context: contextvars.Context,
) -> None:
    state = incarnation.state
    if state is ProcessState.RUNNING:
        callback(*args)
    elif state is ProcessState.PAUSED:
        incarnation.parked.append((callback, args, context))
    # dead: a crashed process's timers never fire


def _task_factory(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, Any],
    context: contextvars.Context | None = None,
) -> asyncio.Task[Any]:
    task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, context=context)
    owner = (context if context is not None else contextvars.copy_context()).get(CURRENT)
    if owner is not None:
        owner.tasks[task] = None
        task.add_done_callback(owner.tasks.pop, context=WORLD_CONTEXT)
        if owner.state is ProcessState.DEAD:
            task.cancel()  # a crashed process starts nothing new
    return task
