"""A supervised child process: started with its log in a file, waited for until it is
ready, paused, resumed, and stopped by its pid.

Every Waltz component that runs another program as a child (``waltz dev``'s storage
nodes and servers, the test launchers of storage nodes, servers, ZooKeeper, etcd and an
S3 server, ``waltz chaos``'s processes) uses :class:`SupervisedProcess`; it is here, in
the ground floor, because shipped code (``waltz dev``, ``waltz chaos``, the conformance
suite) needs it and each of those may import ``waltz_api``.

- **Start**: ``argv`` with ``env`` (the whole environment; None: this process's),
  ``cwd``, stdin from /dev/null, stdout and stderr appended to ``log_path`` (None:
  discarded). ``new_session``: the child is not in this process's session, so a Ctrl-C
  at the terminal reaches this process only, which stops the child. ``die_with_parent``
  (Linux): the child gets SIGTERM should this process die. ``kill_at_exit``: killed
  at interpreter exit should nobody have stopped it (a crashed test run).
- **Ready**: :meth:`wait_ready` (asyncio) or :meth:`wait_ready_sync` waits for a line
  of *this* start's log matching a regular expression, or for a readiness callable to
  return True, until a deadline. A child that exits first, or a deadline that passes,
  raises :class:`~waltz_api.errors.ProcessStartError` whose message ends with the end
  of the log.
- **Stop** by pid: :meth:`terminate` (SIGTERM or another signal, then SIGKILL after
  ``timeout`` seconds; :meth:`stop` is the same for asyncio code) and :meth:`kill`
  (SIGKILL: a crash). Both reap the child. A paused child is resumed first.
- **Pause** (SIGSTOP) and **resume** (SIGCONT): the process stops running, keeps its
  sockets and memory; a fault to inject.

A start after a stop is a new run of the same command: its log is appended to, and
only what the new run wrote counts for its readiness and :meth:`output`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import ctypes.util
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from waltz_api.errors import InvalidArgumentError, ProcessStartError

log = logging.getLogger(__name__)

TAIL_CHARS = 2000
"""How much of the end of its log an error about a child carries."""
REAP_TIMEOUT = 30.0
"""Seconds to wait for a killed child to be reaped."""

Ready = str | re.Pattern[str] | Callable[[], bool]
"""What a child being ready is: a regular expression a line of its log matches, or a
callable that says (polled)."""
AsyncReady = Ready | Callable[[], Awaitable[bool]]

_live: dict[int, SupervisedProcess] = {}
_live_lock = threading.Lock()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux prctl)."""
    if not sys.platform.startswith("linux"):
        return
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(libc_name, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


class SupervisedProcess:
    """One child process, run by this process (see the module docstring)."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path | None,
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        new_session: bool = False,
        die_with_parent: bool = False,
        kill_at_exit: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self.name = name or Path(self.argv[0]).name
        self.env = None if env is None else dict(env)
        self.cwd = cwd
        self.new_session = new_session
        self.die_with_parent = die_with_parent
        self.kill_at_exit = kill_at_exit
        self.process: subprocess.Popen[bytes] | None = None
        """The running (or last) child; None before the first start."""
        self.paused = False
        self.log_offset = 0
        """Where this run's part of the log starts."""

    # -- state ----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def running(self) -> bool:
        """Started and not exited (a paused child is running)."""
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code of the last run (None: running, or never started)."""
        return None if self.process is None else self.process.poll()

    # -- start ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the command (a new run: the log is appended to)."""
        if self.running:
            raise ProcessStartError(f"{self.name} is already running (pid {self.pid})")
        log_file: IO[bytes] | int = subprocess.DEVNULL
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            log_file = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=self.new_session,
                preexec_fn=_die_with_parent if self.die_with_parent else None,  # noqa: PLW1509 - prctl only, before exec
            )
        finally:
            if not isinstance(log_file, int):
                log_file.close()
        self.paused = False
        if self.kill_at_exit:
            with _live_lock:
                _live[self.process.pid] = self
        log.info("%s started (pid %d)", self.name, self.process.pid)

    # -- the log --------------------------------------------------------------------------

    def output(self) -> str:
        """This run's part of the log ("" when there is none)."""
        if self.log_path is None:
            return ""
        with contextlib.suppress(OSError), self.log_path.open("rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")
        return ""

    def whole_log(self) -> str:
        """The whole log file, earlier runs' included."""
        if self.log_path is None:
            return ""
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def tail(self, chars: int = TAIL_CHARS) -> str:
        """The end of this run's log."""
        return self.output()[-chars:]

    # -- ready ----------------------------------------------------------------------------

    def _deadline(self, timeout: float | None, deadline: float | None) -> tuple[float, str]:
        if deadline is None:
            if timeout is None:
                raise InvalidArgumentError("wait_ready needs a timeout or a deadline")
            deadline = time.monotonic() + timeout
        return deadline, f"{timeout:g}s" if timeout is not None else "its deadline"

    def _check(self, pattern: re.Pattern[str] | None) -> re.Match[str] | None:
        """The ready line's match, if logged; raises when the child exited before it."""
        if pattern is not None and (found := pattern.search(self.output())) is not None:
            return found
        if not self.running:
            code = self.returncode
            raise ProcessStartError(
                f"{self.name} exited with {code} while starting; {self._log_note()}{self.tail()}",
                code,
            )
        return None

    def _late(self, after: str, waiting_for: str | Callable[[], str]) -> ProcessStartError:
        what = waiting_for() if callable(waiting_for) else waiting_for
        return ProcessStartError(
            f"{self.name} (pid {self.pid}) not ready after {after}"
            f"{f' ({what})' if what else ''}; {self._log_note()}{self.tail()}"
        )

    def _log_note(self) -> str:
        if self.log_path is None:
            return "it has no log"
        return f"its log ({self.log_path}) ends with:\n"

    async def wait_ready(
        self,
        ready: AsyncReady,
        *,
        timeout: float | None = None,
        deadline: float | None = None,
        interval: float = 0.05,
        waiting_for: str | Callable[[], str] = "",
    ) -> re.Match[str] | None:
        """Until this run is ready (see :data:`Ready`; a callable may be a coroutine
        function), by ``timeout`` seconds from now or the ``time.monotonic()``
        ``deadline``; the ready line's match (None for a callable). Raises
        ProcessStartError with the end of the log when the child exits first or is late
        (``waiting_for`` says what was awaited)."""
        end, after = self._deadline(timeout, deadline)
        pattern = re.compile(ready) if isinstance(ready, str) else None
        if isinstance(ready, re.Pattern):
            pattern = ready
        while True:
            if (found := self._check(pattern)) is not None:
                return found
            if pattern is None and callable(ready):
                answer = ready()
                if await answer if isinstance(answer, Awaitable) else answer:
                    return None
            if time.monotonic() > end:
                raise self._late(after, waiting_for)
            await asyncio.sleep(interval)

    def wait_ready_sync(
        self,
        ready: Ready,
        *,
        timeout: float | None = None,
        deadline: float | None = None,
        interval: float = 0.05,
        waiting_for: str | Callable[[], str] = "",
    ) -> re.Match[str] | None:
        """:meth:`wait_ready` for a thread that may block."""
        end, after = self._deadline(timeout, deadline)
        pattern = re.compile(ready) if isinstance(ready, str) else None
        if isinstance(ready, re.Pattern):
            pattern = ready
        while True:
            if (found := self._check(pattern)) is not None:
                return found
            if pattern is None and callable(ready) and ready():
                return None
            if time.monotonic() > end:
                raise self._late(after, waiting_for)
            time.sleep(interval)

    # -- signals ----------------------------------------------------------------------------

    def send_signal(self, signum: int) -> bool:
        """Send ``signum`` to the child if it runs; whether it was sent."""
        process = self.process
        if process is None or process.poll() is not None:
            return False
        try:
            os.kill(process.pid, signum)
        except ProcessLookupError:
            return False
        return True

    def pause(self) -> bool:
        """SIGSTOP: it stops running (its sockets stay open); whether it was paused now."""
        if self.paused or not self.send_signal(signal.SIGSTOP):
            return False
        self.paused = True
        return True

    def resume(self) -> bool:
        """SIGCONT after :meth:`pause`; whether it was paused."""
        if not self.paused:
            return False
        self.paused = False
        self.send_signal(signal.SIGCONT)
        return True

    # -- stop -------------------------------------------------------------------------------

    def _forget(self) -> None:
        if self.process is not None:
            with _live_lock:
                _live.pop(self.process.pid, None)

    def kill(self) -> int | None:
        """SIGKILL (a crash) and reap; the exit code (None: never started)."""
        process = self.process
        if process is None:
            return None
        self._forget()
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            try:
                process.wait(timeout=REAP_TIMEOUT)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) was not reaped after SIGKILL", self.name, process.pid)
        self.paused = False
        return process.returncode

    def _send_stop(self, signum: int) -> subprocess.Popen[bytes] | None:
        """Send the stop signal (resuming a paused child first); the process to wait for."""
        process = self.process
        if process is None:
            return None
        self._forget()
        if process.poll() is None:
            if self.paused:
                self.resume()
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)
        return process

    def _late_stop(self, process: subprocess.Popen[bytes], timeout: float) -> int | None:
        log.warning("%s (pid %d) did not stop in %gs: SIGKILL", self.name, process.pid, timeout)
        return self.kill()

    def terminate(self, timeout: float = 30.0, signum: int = signal.SIGTERM) -> int | None:
        """SIGTERM (or ``signum``), SIGKILL if it has not ended after ``timeout`` seconds;
        the exit code (None: never started)."""
        process = self._send_stop(signum)
        if process is None:
            return None
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return self._late_stop(process, timeout)
        return process.returncode

    async def stop(self, timeout: float = 30.0, signum: int = signal.SIGTERM) -> int | None:
        """:meth:`terminate` without blocking the event loop."""
        process = self._send_stop(signum)
        if process is None:
            return None
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # polls the child's exit
        if process.poll() is None:
            return self._late_stop(process, timeout)
        return process.returncode


class ChildHandle:
    """What a wrapper around one :class:`SupervisedProcess` (``self.child``) shows of it:
    its process, pid and state, and its pause, resume and kill. The wrappers (a waltz
    command's child, ``waltz dev``'s and ``waltz chaos``'s processes) add how theirs
    starts and when it is ready."""

    child: SupervisedProcess

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.child.process

    @property
    def pid(self) -> int | None:
        return self.child.pid

    @property
    def running(self) -> bool:
        return self.child.running

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        self.child.kill()

    def pause(self) -> None:
        """SIGSTOP: it answers nothing (its sockets stay open) until :meth:`resume`."""
        self.child.pause()

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self.child.resume()


class WaltzCommandProcess(ChildHandle):
    """A ``waltz <subcommand> [--config FILE]`` child (a server, a storage node) as tests,
    benchmarks and the upgrade harness run it: a :class:`SupervisedProcess` started,
    paused, killed and restarted by pid. Readiness is the product's own
    (``wait_ready`` of :class:`~waltz_server.server.testing.ServerProcess` and
    :class:`~waltz_storage_node.testing.StorageNodeProcess`).

    ``config_path`` None: configured by ``WALTZ_*`` variables in ``env`` alone (added
    to this process's environment, as ``env`` always is). ``wrap`` is put before the
    command (``ip netns exec NAME``: the process in a network namespace) and may change
    between starts (a test moves it elsewhere); with ``new_session`` the child is not in
    this process's session (a Ctrl-C at the terminal reaches this process only, which
    stops the child). ``command`` is the ``waltz`` to run (another venv's
    ``bin/waltz``; default: this Python's ``-m waltz_cli``) and may change between
    starts too (an upgrade)."""

    def __init__(
        self,
        subcommand: str,
        config_path: str | os.PathLike[str] | None,
        log_path: Path,
        *,
        name: str,
        env: Mapping[str, str] | None = None,
        wrap: Sequence[str] = (),
        new_session: bool = False,
        command: Sequence[str] = (),
    ) -> None:
        self.subcommand = subcommand
        self.config_path = None if config_path is None else Path(config_path)
        self.log_path = log_path
        self.env = None if env is None else dict(env)
        self.wrap = list(wrap)
        self.command = list(command) or [sys.executable, "-m", "waltz_cli"]
        self.child = SupervisedProcess([], log_path, name=name, new_session=new_session)

    def start(self) -> None:
        args = [*self.wrap, *self.command, self.subcommand]
        if self.config_path is not None:
            args += ["--config", str(self.config_path)]
        self.child.argv = args
        self.child.env = None if self.env is None else {**os.environ, **self.env}
        self.child.start()

    def output(self) -> str:
        """The whole log (every start's)."""
        return self.child.whole_log()

    def terminate(self, timeout: float = 30.0, signum: int = signal.SIGTERM) -> int | None:
        """SIGTERM (or ``signum``: a clean shutdown), SIGKILL if it does not end in
        time; the exit code."""
        return self.child.terminate(timeout, signum)


@atexit.register
def _kill_leftovers() -> None:
    """SIGKILL every ``kill_at_exit`` child still running (a run that crashed)."""
    with _live_lock:
        leftovers = list(_live.values())
        _live.clear()
    for child in leftovers:
        with contextlib.suppress(Exception):
            child.kill()


__all__ = ["AsyncReady", "Ready", "SupervisedProcess"]
