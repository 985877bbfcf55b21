"""Scripted scenarios: faults placed by a script on virtual time instead of the nemesis.

A seeded run (:func:`waltz_sim.run_seed`) draws its faults at random; a *scenario*
places them where a script says, to replay one interleaving exactly: the world
starts as usual (the cluster, then the clients and their workload), then the script
runs on virtual time with a :class:`Scenario` in hand, then everything is healed
(paused processes resume, crashed ones restart, the script's slow fsyncs end), the
workload goes on through the quiet phase, the cluster is read back, and the checker
judges the history as it judges any run::

    async def script(s: Scenario) -> None:
        opened = await s.session_opened(0)
        s.slow_fsync(s.storage(2), 2.5)
        await s.wait_acknowledged(0, opened.low_water_mark + 10)
        s.crash(s.storage(0))
        s.lose_tail(s.storage(0), 0, 3)
        hook = s.crash_owner_on_rejoin(0, s.storage(0))
        s.restart(s.storage(0))
        await s.wait_fired(hook)

    result = run_scenario(SimConfig(seed=1, faults="none"), script)
    assert result.ok, result.violations

What a script can do: crash (kill -9), restart, pause (SIGSTOP) and resume a
process; slow a storage node's fsyncs, or stall them until the script releases them;
damage a crashed node's disk (a lost tail its
engine reports as ``LOST_SESSION``, a wiped disk, a snapshot restored); act on a log
record of the real components the moment it is emitted (:meth:`Scenario.on_log`: the
handler runs synchronously inside the component's code, so "crash the owner when it
logs X" happens exactly there, before the component takes its next step); wait for a
condition or a log record with a deadline in virtual seconds. A seed still draws
every latency and the workload, so one script over several seeds covers several
interleavings around the scripted points, each replayable.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from waltz_sim.checker import OK
from waltz_sim.disk import PartitionImage, SimDisk
from waltz_sim.loop import CURRENT, SimulationError
from waltz_sim.runner import SeedResult, run_seed
from waltz_sim.trace import CAPTURED_LOGGERS
from waltz_sim.world import STORAGE_PORT, SimConfig, SimProcess, World

log = logging.getLogger(__name__)

SESSION_OPEN = "partition %d: store session %d open at high-water mark %d"
"""waltz_server.server.store_session: a store session opened (partition, session, mark)."""
REJOIN = "partition %d session %d: replica %s rejoins at %d"
"""waltz_server.server.store_session: a replica rejoins a session it left (partition,
session, replica, the mark it rejoins at)."""
CHECKPOINT = "partition %d: checkpoint interval reached in session %d, starting a new one"
"""waltz_server.server.store: a session rolls over (partition, session)."""
CLOSING_MARK = "partition %d session %d: closing high-water mark of the last session is %s"
"""waltz_server.server.recovery: a recovery decided (partition, new session, mark), the
start of its message (match it with ``message_is(CLOSING_MARK, ..., prefix=True)``)."""

Script = Callable[["Scenario"], Awaitable[None]]


@dataclass(eq=False)
class LogHook:
    """Log records that match, as they are emitted, and what to do on each."""

    match: Callable[[logging.LogRecord], bool]
    action: Callable[[logging.LogRecord], None] | None = None
    once: bool = True
    records: list[logging.LogRecord] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    """The incarnation that logged each record (``server-1#1``)."""
    active: bool = True
    event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def fired(self) -> bool:
        return bool(self.records)


def message_is(
    template: str, *args: object, prefix: bool = False
) -> Callable[[logging.LogRecord], bool]:
    """A record of the message ``template`` (``prefix``: a message that starts with it)
    whose leading arguments are ``args`` (None: any)."""

    def match(record: logging.LogRecord) -> bool:
        msg = record.msg
        if not isinstance(msg, str) or not isinstance(record.args, tuple):
            return False
        if msg != template and not (prefix and msg.startswith(template)):
            return False
        return all(a is None or a == b for a, b in zip(args, record.args, strict=False))

    return match


class _LogWatch(logging.Handler):
    def __init__(self, scenario: Scenario) -> None:
        super().__init__(logging.NOTSET)
        self.scenario = scenario
        self.hooks: list[LogHook] = []

    def emit(self, record: logging.LogRecord) -> None:
        for hook in list(self.hooks):
            if not hook.active or not hook.match(record):
                continue
            incarnation = CURRENT.get()
            hook.records.append(record)
            hook.times.append(self.scenario.world.loop.time())
            hook.sources.append(incarnation.name if incarnation is not None else "world")
            if hook.once:
                hook.active = False
            hook.event.set()
            if hook.action is not None:
                hook.action(record)


@dataclass(frozen=True)
class SessionOpened:
    time: float
    partition: int
    session_id: int
    low_water_mark: int
    server: str
    """The process of the server that opened it (the partition's owner)."""


class Scenario:
    """A script's hold on a running world (see the module docstring)."""

    def __init__(self, world: World) -> None:
        if world.config.trace_level > logging.INFO:
            raise SimulationError(
                "a scenario acts on the components' INFO logs: run it at trace level INFO or "
                f"lower, not {logging.getLevelName(world.config.trace_level)}"
            )
        self.world = world
        self._watch = _LogWatch(self)
        self._slowed: list[tuple[SimDisk, float]] = []
        self._stalled: list[SimDisk] = []
        self._sessions = self.watch(message_is(SESSION_OPEN))

    # -- set-up ---------------------------------------------------------------------------

    def install(self) -> None:
        for name in CAPTURED_LOGGERS:
            logging.getLogger(name).addHandler(self._watch)

    def uninstall(self) -> None:
        for name in CAPTURED_LOGGERS:
            logging.getLogger(name).removeHandler(self._watch)

    # -- the world ----------------------------------------------------------------------

    @property
    def now(self) -> float:
        """Virtual seconds since the start of the run."""
        return self.world.loop.time() - self.world.started_at

    def note(self, text: str) -> None:
        """A line in the trace (kind ``script``)."""
        self.world.trace.add("script", text, source="script")

    def process(self, name: str) -> SimProcess:
        try:
            return self.world.processes[name]
        except KeyError:
            raise SimulationError(
                f"no process {name!r}; the world has {', '.join(sorted(self.world.processes))}"
            ) from None

    def storage(self, index: int) -> SimProcess:
        return self.process(f"storage-{index}")

    @staticmethod
    def replica_name(process: SimProcess) -> str:
        """The storage node as the cluster metadata and the server's logs name it."""
        return f"{process.name}:{STORAGE_PORT}"

    def disk(self, process: SimProcess) -> SimDisk:
        disk = self.world.disks.get(self.world.data_dir(process.name))
        if disk is None:
            raise SimulationError(f"{process.name} has no disk yet (it never started)")
        if not isinstance(disk, SimDisk):
            raise SimulationError(
                f"a scripted scenario acts on the disks of the `sim` storage engine; "
                f"{process.name} runs {self.world.config.storage_engine!r}"
            )
        return disk

    def log_end(self, process: SimProcess, partition: int) -> int:
        """The highest transaction id the node's engine shows for ``partition`` (-1: none)."""
        image = self.disk(process).partitions.get(partition)
        return -1 if image is None else image.visible - 1

    def acknowledged(self, partition: int) -> int:
        """The highest transaction id a client was told is committed (-1: none yet)."""
        ids = [
            e.transaction_id
            for e in self.world.history.ops
            if e.kind == OK and e.partition == partition
        ]
        return max(ids, default=-1)

    def sessions(self, partition: int) -> list[SessionOpened]:
        """The store sessions of ``partition`` opened so far, in order."""
        opened = []
        hook = self._sessions
        for record, time, source in zip(hook.records, hook.times, hook.sources, strict=True):
            args = record.args
            if isinstance(args, tuple) and args[0] == partition:
                session_id, mark = args[1], args[2]
                assert isinstance(session_id, int) and isinstance(mark, int)
                server = self.process_of(source).name
                opened.append(SessionOpened(time, partition, session_id, mark, server))
        return opened

    def process_of(self, source: str) -> SimProcess:
        """The process of an incarnation's name (``server-1#2``), as a hook records it."""
        return self.process(source.split("#", maxsplit=1)[0])

    def expect(self, condition: bool, what: str) -> None:
        """A step of the script did not do what it says: SimulationError (the run's error)."""
        if not condition:
            raise SimulationError(f"scenario: expected {what}")

    # -- waiting ------------------------------------------------------------------------

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_until(
        self,
        predicate: Callable[[], bool],
        what: str,
        timeout: float = 30.0,
        interval: float = 0.01,
    ) -> None:
        """Poll ``predicate`` every ``interval`` virtual seconds; SimulationError after
        ``timeout``."""
        loop = self.world.loop
        deadline = loop.time() + timeout
        while not predicate():
            if loop.time() >= deadline:
                raise SimulationError(f"scenario: {what} did not happen within {timeout:g} s")
            await asyncio.sleep(interval)

    async def wait_fired(self, hook: LogHook, what: str = "", timeout: float = 30.0) -> None:
        """Until ``hook`` matched a record."""
        try:
            await asyncio.wait_for(hook.event.wait(), timeout)
        except TimeoutError:
            raise SimulationError(
                f"scenario: {what or 'the log record awaited'} was not logged within "
                f"{timeout:g} s (did its message change? scenario.py matches it by its format)"
            ) from None

    async def session_opened(
        self, partition: int, after: int = -1, timeout: float = 30.0
    ) -> SessionOpened:
        """The first store session of ``partition`` with an id above ``after`` to open."""

        def found() -> bool:
            return any(s.session_id > after for s in self.sessions(partition))

        await self.wait_until(found, f"a store session of partition {partition} > {after}", timeout)
        return next(s for s in self.sessions(partition) if s.session_id > after)

    async def wait_acknowledged(
        self, partition: int, transaction_id: int, timeout: float = 30.0
    ) -> int:
        """Until a client was told a transaction at or above ``transaction_id`` committed."""
        await self.wait_until(
            lambda: self.acknowledged(partition) >= transaction_id,
            f"an acknowledgement of partition {partition} at or above {transaction_id}",
            timeout,
        )
        return self.acknowledged(partition)

    # -- log hooks ------------------------------------------------------------------------

    def on_log(
        self,
        match: Callable[[logging.LogRecord], bool],
        action: Callable[[logging.LogRecord], None] | None = None,
        *,
        once: bool = True,
    ) -> LogHook:
        """Run ``action(record)`` on the next record that matches (every one: ``once=False``),
        synchronously, inside the code that logs it (in its process)."""
        hook = LogHook(match, action, once)
        self._watch.hooks.append(hook)
        return hook

    def watch(self, match: Callable[[logging.LogRecord], bool]) -> LogHook:
        """Collect every record that matches."""
        return self.on_log(match, once=False)

    def crash_owner_on_rejoin(
        self, partition: int, replica: SimProcess, session_id: int | None = None
    ) -> LogHook:
        """kill -9 the server that logs ``replica``'s rejoin of a store session of
        ``partition`` (of ``session_id`` only, when given), at that record: after the
        rejoin's truncation and low-water mark are on the replica, before the session
        sends it anything."""

        def crash(record: logging.LogRecord) -> None:
            incarnation = CURRENT.get()
            if incarnation is None:
                raise SimulationError("the rejoin was logged outside a server process")
            self.note(f"{record.getMessage()}: crash the owner {incarnation.name}")
            self.world.processes[incarnation.process.name].crash()

        match = message_is(REJOIN, partition, session_id, self.replica_name(replica))
        return self.on_log(match, crash)

    # -- process faults -------------------------------------------------------------------

    def crash(self, process: SimProcess) -> None:
        self.note(f"crash {process.name}")
        process.crash()

    def restart(self, process: SimProcess) -> None:
        self.note(f"restart {process.name}")
        if process.alive:
            raise SimulationError(f"{process.name} is running: crash it before a restart")
        process.start()

    def pause(self, process: SimProcess) -> None:
        self.note(f"pause {process.name}")
        process.pause()

    def resume(self, process: SimProcess) -> None:
        self.note(f"resume {process.name}")
        process.resume()

    # -- disk faults ----------------------------------------------------------------------

    def slow_fsync(self, process: SimProcess, extra: float) -> None:
        """Each fsync of the node takes ``extra`` seconds more (half to all of it), until
        :meth:`unslow_fsync` or the heal."""
        self.note(f"slow fsyncs on {process.name}: +{extra * 1000:.0f} ms")
        disk = self.disk(process)
        disk.extra_fsync.append(extra)
        self._slowed.append((disk, extra))

    def stall_fsync(self, process: SimProcess) -> None:
        """The node's fsyncs do not complete until :meth:`release_fsync` (or the heal): a
        slow fdatasync whose end the script chooses. The node runs and stays connected; its
        partitions, which take their requests in order, answer nothing meanwhile."""
        self.note(f"fsyncs on {process.name} stall")
        disk = self.disk(process)
        if disk.stall is None or disk.stall.is_set():
            disk.stall = asyncio.Event()
        self._stalled.append(disk)

    def release_fsync(self, process: SimProcess) -> None:
        """End :meth:`stall_fsync`: the fsyncs waiting complete now."""
        disk = self.disk(process)
        self._release(disk)
        self.note(f"fsyncs on {process.name} complete again")

    @staticmethod
    def _release(disk: SimDisk) -> None:
        if disk.stall is not None:
            disk.stall.set()
            disk.stall = None

    def unslow_fsync(self, process: SimProcess) -> None:
        disk = self.disk(process)
        for slowed in [s for s in self._slowed if s[0] is disk]:
            self._slowed.remove(slowed)
            if slowed[1] in disk.extra_fsync:
                disk.extra_fsync.remove(slowed[1])
        self.note(f"fsyncs on {process.name} at their normal speed")

    def lose_tail(self, process: SimProcess, partition: int, count: int) -> int:
        """The crashed node's next start-up finds the last ``count`` records of
        ``partition`` lost to damage (its engine reports LOST_SESSION)."""
        lost = self.disk(process).lose_tail(partition, count)
        self.note(f"{process.name}: partition {partition}: its last {lost} records lost to damage")
        return lost

    def wipe(self, process: SimProcess, partition: int | None = None) -> None:
        """The crashed node's disk is wiped (only ``partition``, when given)."""
        self.disk(process).wipe(partition)
        which = "every partition" if partition is None else f"partition {partition}"
        self.note(f"{process.name}: disk wiped ({which})")

    def snapshot(self, process: SimProcess) -> dict[int, PartitionImage]:
        """A copy of the node's disk as it is now (a backup), for :meth:`restore`."""
        images = self.disk(process).snapshot()
        ends = ", ".join(f"p{p} up to {len(i.written) - 1}" for p, i in images.items())
        self.note(f"snapshot of {process.name}'s disk: {ends}")
        return images

    def restore(self, process: SimProcess, images: dict[int, PartitionImage]) -> None:
        """The crashed node's disk is restored from a :meth:`snapshot`."""
        self.disk(process).restore(images)
        self.note(f"{process.name}: disk restored from a snapshot")

    # -- the end --------------------------------------------------------------------------

    def heal(self) -> None:
        """End the script's faults (slow and stalled fsyncs); the world then resumes what is
        paused and restarts what is down."""
        for disk, extra in self._slowed:
            if extra in disk.extra_fsync:
                disk.extra_fsync.remove(extra)
        self._slowed.clear()
        for stalled in self._stalled:
            self._release(stalled)
        self._stalled.clear()


def run_scenario(config: SimConfig, script: Script, *, keep_trace: bool = False) -> SeedResult:
    """Run ``script`` in a world of ``config`` (its seed draws everything the script does
    not place; ``faults`` should be ``none``) and check the run."""

    scenarios: list[Scenario] = []

    async def play(world: World) -> None:
        scenario = Scenario(world)
        scenarios.append(scenario)
        scenario.install()  # until the end of the run: hooks may act on the recovery after it
        try:
            await scenario.wait_until(
                lambda: world.ready_at is not None, "the cluster's start (owners, clients)", 60.0
            )
            await script(scenario)
        finally:
            scenario.heal()

    try:
        return run_seed(config, keep_trace=keep_trace, script=play)
    finally:
        for scenario in scenarios:
            scenario.uninstall()


def lost_acknowledged(result: SeedResult) -> list[str]:
    """The ops acknowledged as committed that the committed log does not hold (per the
    checker's ``acknowledged-lost`` violations)."""
    return [v.op_id or v.message for v in result.violations if v.invariant == "acknowledged-lost"]


__all__ = [
    "CHECKPOINT",
    "CLOSING_MARK",
    "REJOIN",
    "SESSION_OPEN",
    "LogHook",
    "Scenario",
    "SessionOpened",
    "lost_acknowledged",
    "message_is",
    "run_scenario",
]
